"""`Sink`: the handler every tool's sink is: taps in, `Point`s (sinks/_points.py) out to
the tool's writer. A sink is a batch handler (`takes_batch`): the subscriber gives it a
`TapBatch` of one site's taps, and its points go to the tool in one `write` call.

`process_in_tag` starts each tag with the emitting process (`p0/loss`); `assemble` puts
the shards of a sharded tap back together with `Assembler` first (by (name, step): tap
with `step=`), so the global value is written once, without a shard suffix or process
prefix. Steps whose shards do not all arrive within `assemble_timeout` seconds are
logged and dropped.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from tapd.protocol import flatten, unflatten
from tapd_client.assemble import Assembler
from tapd_client.batch import TapBatch
from tapd_client.meta import TapMeta
from tapd_client.sinks._points import Point, assembled_points, batch_points

logger = logging.getLogger("tapd.sinks")


class Sink(abc.ABC):
    """A subscriber batch handler writing the taps it is given to one tool."""

    takes_batch = True
    where = ""  # what the CLI names as the destination: a logdir, a run

    def __init__(
        self,
        *,
        process_in_tag: bool = False,
        assemble: bool = False,
        assemble_timeout: float = 60.0,
    ) -> None:
        self.process_in_tag = process_in_tag
        self._assembled: list[Point] = []
        self._assembler = (
            Assembler(self._collect_assembled, timeout=assemble_timeout) if assemble else None
        )
        self.written = 0  # points (scalars, histograms, images)

    def __call__(self, batch: TapBatch) -> None:
        """Write a batch's points, with one `write` call."""
        if self._assembler is not None and batch.shard_index is not None:
            for value, meta in batch:  # a complete step lands in _assembled
                self._assembler(_owned(value), meta)
            points, self._assembled = self._assembled, []
        else:
            points = list(batch_points(batch, process_in_tag=self.process_in_tag))
        if points:
            self.write(points)
            self.written += len(points)

    def _collect_assembled(self, value: Any, metas: list[TapMeta]) -> None:
        self._assembled.extend(assembled_points(value, metas))

    @abc.abstractmethod
    def write(self, points: Sequence[Point]) -> None:
        """Send points to the tool (in one call where its library batches)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush, and end the tool's run."""


class Tee:
    """Several sinks as one handler (one consumer has one handler): each gets every tap;
    the first error is raised once all have been tried, so one tool's failure does not
    starve the others."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        if not sinks:
            raise ValueError("a Tee needs at least one sink")
        self.sinks = list(sinks)

    takes_batch = True

    @property
    def written(self) -> int:
        return sum(sink.written for sink in self.sinks)

    def __call__(self, batch: TapBatch) -> None:
        error: Exception | None = None
        for sink in self.sinks:
            try:
                sink(batch)
            except Exception as exc:
                logger.error("sink %s failed: %r", type(sink).__name__, exc)
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        error: Exception | None = None
        for sink in self.sinks:  # every run ends, even after one tool failed to end its own
            try:
                sink.close()
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error


def _owned(value: Any) -> Any:
    """A copy of a tapped value whose leaves may be views of the received message (valid
    only during the handler call), for the Assembler to hold until its step completes."""
    tree, leaves = flatten(value)
    return unflatten(tree, [np.array(leaf) for leaf in leaves])
