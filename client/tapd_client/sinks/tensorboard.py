"""`TensorBoardSink`: taps into TensorBoard event files (`tapd sink tensorboard`).

Per tap, at step `meta.step` (the tap's `seq` when it has none), wall time `meta.time`:
- a value with one element becomes a scalar;
- a larger array a histogram (empty arrays are skipped);
- an `HxW` or `HxWxC` (C = 1, 3 or 4) array tapped with `image=True` in its static
  metadata (`tapd.tap(img, "samples", image=True)`) an image: uint8, or floats in [0, 1];
- a pytree's leaves are named by their path under the tap's name: `grads/w`, `state/0`,
  `point/x` (dict keys, sequence indices, namedtuple fields); `None` leaves are skipped.
A tap made per shard (pmap, shard_map) is written per shard, `name/shard<index>`, and
with `process_in_tag` every tag starts with the emitting process, `p<index>/...`, so that
the processes of a multi-host job do not write over each other's points.

The writer is tensorboardX's `SummaryWriter` (the extra `tapd[tensorboard]`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tapd_client.meta import TapMeta


class TensorBoardSink:
    """A handler writing the taps it is given to an event file in `logdir`."""

    def __init__(
        self,
        logdir: str | Path,
        *,
        process_in_tag: bool = False,
        flush_secs: float = 1.0,
        writer: Any = None,
    ) -> None:
        if writer is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "the TensorBoard sink writes with tensorboardX: pip install 'tapd[tensorboard]'"
                ) from exc
            writer = SummaryWriter(str(logdir), flush_secs=flush_secs)
        self.writer = writer
        self.process_in_tag = process_in_tag
        self.written = 0  # points (scalars, histograms, images)

    def __call__(self, arg: Any, meta: TapMeta) -> None:
        step = meta.step if meta.step is not None else meta.seq
        prefix = f"p{meta.process}/" if self.process_in_tag else ""
        suffix = f"/shard{meta.shard_index}" if meta.shard is not None else ""
        image = bool(meta.meta.get("image"))
        for path, leaf in _leaves(arg):
            tag = prefix + "/".join([meta.consumer, *path]) + suffix
            self._write(tag, np.asarray(leaf), step, meta.time, image)

    def _write(self, tag: str, value: np.ndarray, step: int, walltime: float, image: bool) -> None:
        if value.size == 0:
            return
        if image and _is_image(value):
            formats = "HW" if value.ndim == 2 else "HWC"
            if value.dtype != np.uint8:
                value = value.astype(np.float32)
            self.writer.add_image(tag, value, step, walltime=walltime, dataformats=formats)
        elif value.size == 1:
            number = value.reshape(()).item()
            if isinstance(number, complex):
                number = abs(number)
            self.writer.add_scalar(tag, float(number), step, walltime=walltime)
        else:
            if np.iscomplexobj(value):
                value = np.abs(value)
            self.writer.add_histogram(tag, value.astype(np.float64).reshape(-1), step,
                                      walltime=walltime)  # fmt: skip
        self.written += 1

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _is_image(value: np.ndarray) -> bool:
    return value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4))


def _leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[list[str], Any]]:
    """(path, leaf) for every leaf of a tapped value, as subscribers rebuild it."""
    if value is None:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, (*path, str(key)))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        for field, child in zip(value._fields, value, strict=True):
            yield from _leaves(child, (*path, field))
    elif isinstance(value, tuple | list):
        for index, child in enumerate(value):
            yield from _leaves(child, (*path, str(index)))
    else:
        yield list(path), value
