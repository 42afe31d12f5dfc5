"""`Sink`: the handler every tool's sink is: taps in, `Point`s (sinks/_points.py) out to
the tool's writer.

`process_in_tag` starts each tag with the emitting process (`p0/loss`); `assemble` puts
the shards of a sharded tap back together with `Assembler` first (by (name, step): tap
with `step=`), so the global value is written once, without a shard suffix or process
prefix. Steps whose shards do not all arrive within `assemble_timeout` seconds are
logged and dropped.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from tapd_client.assemble import Assembler
from tapd_client.meta import TapMeta
from tapd_client.sinks._points import Point, assembled_points, tap_points

logger = logging.getLogger("tapd.sinks")


class Sink(abc.ABC):
    """A subscriber handler writing the taps it is given to one tool."""

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

    def __call__(self, value: Any, meta: TapMeta) -> None:
        self.handle([(value, meta)])

    def handle(self, taps: Iterable[tuple[Any, TapMeta]]) -> None:
        """Write these taps' points, with one `write` call."""
        points: list[Point] = []
        for value, meta in taps:
            if self._assembler is not None and meta.shard is not None:
                self._assembler(value, meta)  # a complete step lands in _assembled
            else:
                points.extend(tap_points(value, meta, process_in_tag=self.process_in_tag))
        points.extend(self._assembled)
        self._assembled.clear()
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

    @property
    def written(self) -> int:
        return sum(sink.written for sink in self.sinks)

    def __call__(self, value: Any, meta: TapMeta) -> None:
        self.handle([(value, meta)])

    def handle(self, taps: Iterable[tuple[Any, TapMeta]]) -> None:
        taps = list(taps)
        error: Exception | None = None
        for sink in self.sinks:
            try:
                sink.handle(taps)
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
