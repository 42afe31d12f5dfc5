"""`WandbSink`: taps into a Weights & Biases run (`tapd sink wandb`).

Each point (sinks/_points.py: leaves named by path, step `meta.step` or the tap's seq)
goes to one run, started with `wandb.init` and finished on close (the extra
`tapd[wandb]`): a scalar as a number, an array as a `wandb.Histogram`, an image as a
`wandb.Image`. `WANDB_MODE`, `WANDB_DIR` and the rest of wandb's environment apply
(`WANDB_MODE=offline` needs no network; `wandb sync` uploads later).

wandb's own step must never decrease within a run, but taps of several processes, or
a restarted emitter, arrive in any order of steps. So the step is logged as the metric
`tapd/step`, the x-axis of every tag (`define_metric(tag, step_metric="tapd/step")`),
and wandb's step just counts `log` calls: one per distinct step in a handler call.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tapd_client.sinks._points import Point
from tapd_client.sinks.base import Sink

STEP = "tapd/step"


class WandbSink(Sink):
    """A handler logging the taps it is given to a W&B run."""

    def __init__(
        self,
        project: str | None = None,
        *,
        run_name: str | None = None,
        dir: str | Path | None = None,  # (wandb.init's name for it)
        process_in_tag: bool = False,
        assemble: bool = False,
    ) -> None:
        super().__init__(process_in_tag=process_in_tag, assemble=assemble)
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("the W&B sink logs with wandb: pip install 'tapd[wandb]'") from exc
        self._wandb = wandb
        # console="off": wandb would otherwise take over this process's stdout and stderr.
        self.run = wandb.init(
            project=project or "tapd",
            name=run_name,
            dir=None if dir is None else str(dir),
            settings=wandb.Settings(console="off"),
        )
        self.run.define_metric(STEP)
        self._defined: set[str] = set()
        self.where = f"W&B run {self.run.id} ({self.run.dir})"

    def write(self, points: Sequence[Point]) -> None:
        rows: dict[int, dict[str, Any]] = {}  # by step, in order of arrival
        for point in points:
            if point.tag not in self._defined:
                self.run.define_metric(point.tag, step_metric=STEP)
                self._defined.add(point.tag)
            if point.kind == "scalar":
                value: Any = point.value
            elif point.kind == "histogram":
                value = self._wandb.Histogram(point.value)
            else:
                value = self._wandb.Image(point.value)
            rows.setdefault(point.step, {STEP: point.step})[point.tag] = value
        for row in rows.values():
            self.run.log(row)

    def close(self) -> None:
        self.run.finish()
