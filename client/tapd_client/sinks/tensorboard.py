"""`TensorBoardSink`: taps into TensorBoard event files (`tapd sink tensorboard`).

Each point (sinks/_points.py: leaves named by path, step `meta.step` or the tap's seq)
is written at wall time `meta.time`: a scalar as a scalar, an array as a histogram, an
image as an image. The writer is tensorboardX's `SummaryWriter` (the extra
`tapd[tensorboard]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tapd_client.sinks._points import Point
from tapd_client.sinks.base import Sink


class TensorBoardSink(Sink):
    """A handler writing the taps it is given to an event file in `logdir`."""

    def __init__(
        self,
        logdir: str | Path,
        *,
        process_in_tag: bool = False,
        assemble: bool = False,
        flush_secs: float = 1.0,
        writer: Any = None,
    ) -> None:
        super().__init__(process_in_tag=process_in_tag, assemble=assemble)
        if writer is None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as exc:
                raise ImportError(
                    "the TensorBoard sink writes with tensorboardX: pip install 'tapd[tensorboard]'"
                ) from exc
            writer = SummaryWriter(str(logdir), flush_secs=flush_secs)
        self.writer = writer
        self.where = str(logdir)

    def write(self, points: Sequence[Point]) -> None:
        for point in points:
            if point.kind == "scalar":
                self.writer.add_scalar(point.tag, point.value, point.step, walltime=point.time)
            elif point.kind == "histogram":
                self.writer.add_histogram(point.tag, point.value, point.step, walltime=point.time)
            else:
                formats = "HW" if point.value.ndim == 2 else "HWC"
                self.writer.add_image(
                    point.tag, point.value, point.step, walltime=point.time, dataformats=formats
                )

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
