"""`MlflowSink`: taps into an MLflow run (`tapd sink mlflow`).

Each point (sinks/_points.py: leaves named by path, step `meta.step` or the tap's seq)
goes to one run, created on start and set FINISHED on close, through mlflow's own
`MlflowClient` (the extra `tapd[mlflow]`):
- a scalar becomes a metric at its step, timestamped `meta.time`; the metrics of one
  handler call go in one `log_batch` (of at most 1000, mlflow's limit per call);
- MLflow has no histograms, so an array becomes four metrics that plot well over
  steps: `tag/mean`, `tag/min`, `tag/max` and `tag/norm` (the L2 norm);
- an image becomes `log_image(key=tag, step=step)`, which the MLflow UI shows per step
  (before mlflow 2.12, the artifact `images/<tag>/step<step>.png`).
Characters MLflow refuses in metric names (it takes letters, digits, `_-. /` and `:`)
become `_`.

Where: `tracking_uri`, else `MLFLOW_TRACKING_URI`, else the file store `./mlruns`.
MLflow 3 keeps the file store only behind `MLFLOW_ALLOW_FILE_STORE=true` (it prefers a
database, which mlflow-skinny cannot run); for a `file:` store this sink sets that
variable unless it is already set.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tapd_client.sinks._points import Point
from tapd_client.sinks.base import Sink

_BATCH = 1000  # mlflow's MAX_METRICS_PER_BATCH
_REFUSED = re.compile(r"[^\w.\- :/]")


class MlflowSink(Sink):
    """A handler logging the taps it is given to an MLflow run."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment: str | None = None,
        run_name: str | None = None,
        process_in_tag: bool = False,
        assemble: bool = False,
    ) -> None:
        super().__init__(process_in_tag=process_in_tag, assemble=assemble)
        try:
            from mlflow import MlflowClient
            from mlflow.entities import Metric
            from mlflow.exceptions import MlflowException
        except ImportError as exc:
            raise ImportError(
                "the MLflow sink logs with mlflow: pip install 'tapd[mlflow]'"
            ) from exc
        uri = (
            tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or Path("mlruns").resolve().as_uri()
        )
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric = Metric
        # log_image(key=, step=) came in mlflow 2.12; before it, an artifact per image.
        self._keyed_images = "key" in inspect.signature(MlflowClient.log_image).parameters
        try:
            self.client = MlflowClient(uri)
            experiment_id = self._experiment_id(experiment or "Default", MlflowException)
            self.run_id: str = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        except MlflowException as exc:
            raise ValueError(f"cannot start an MLflow run at {uri!r}: {exc}") from exc
        self.tracking_uri = uri
        self.where = f"MLflow run {self.run_id} at {uri}"

    def _experiment_id(self, name: str, error: type[Exception]) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except error:  # made meanwhile by another sink: use that one
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def write(self, points: Sequence[Point]) -> None:
        metrics: list[Any] = []
        for point in points:
            tag = _REFUSED.sub("_", point.tag)
            ms = int(point.time * 1000)
            if point.kind == "scalar":
                metrics.append(self._metric(tag, point.value, ms, point.step))
            elif point.kind == "histogram":
                values = point.value
                stats = {
                    "mean": values.mean(),
                    "min": values.min(),
                    "max": values.max(),
                    "norm": np.linalg.norm(values),
                }
                for stat, number in stats.items():
                    metrics.append(self._metric(f"{tag}/{stat}", float(number), ms, point.step))
            elif self._keyed_images:
                self.client.log_image(
                    self.run_id, point.value, key=tag, step=point.step, timestamp=ms
                )
            else:
                artifact = f"images/{tag}/step{point.step}.png"
                self.client.log_image(self.run_id, point.value, artifact_file=artifact)
        for start in range(0, len(metrics), _BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + _BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
