"""`TapBatch`: taps of one site that arrived together, as columns, for batch handlers.

    @sub.on("loss", batch=True)
    def log(batch: TapBatch) -> None:
        writer.add_scalars(batch.seq, batch.value)   # value: shape (len(batch),)

Every tap of a batch comes from one site of one emitter: same consumer, tree, leaf
shapes and dtypes, and static metadata (`batch.meta` holds those). Each leaf of
`batch.value` is stacked along a new first axis. Where the taps lie evenly spaced in
the received message (ring records of one site, the common case), a leaf is a
read-only view of the message, not a copy: copy it to keep it past the handler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tapd.protocol import Message, unflatten
from tapd.protocol.batch import SiteRun
from tapd.protocol.tree import LEAF
from tapd_client.meta import MetaTemplate, TapMeta


class TapBatch:
    """Taps of one site, in order: stacked leaves and per-tap meta columns.

    `seq`, `step` (-1 where a tap has no step), `device` (-1 where unknown), `process`:
    int64 arrays; `time`: float64 unix seconds (`TapMeta.time`); `shard_index`: int64,
    or None when the site is not sharded. `metas()` and iteration give the per-tap
    `(value, TapMeta)` pairs a per-tap handler gets.
    """

    __slots__ = (
        "_header_of",
        "_template",
        "_tree",
        "device",
        "leaves",
        "process",
        "seq",
        "shard_index",
        "step",
        "tids",
        "time",
        "value",
    )

    def __init__(
        self,
        template: MetaTemplate,
        first: dict[str, Any],
        rows: Sequence[Sequence[Any]],
        leaves: list[np.ndarray],
        header_of: Callable[[int], dict[str, Any]],
    ) -> None:
        """`first`: the first tap's header; `rows`: every tap's per-tap fields, as a
        `taps` message's rows (tid, seq, step, device, time at 1..5); `header_of(i)`:
        tap i's full header, made only when metas are asked for."""
        self._template = template
        self._header_of = header_of
        self._tree = first["tree"]
        self.leaves = leaves
        self.value: Any = leaves[0] if self._tree == LEAF else unflatten(self._tree, leaves)
        _, tids, seqs, steps, devices, times = list(zip(*rows, strict=False))[:6]
        self.tids = list(tids)
        self.seq = np.array(seqs, np.int64)
        self.step = _int_column(steps)
        self.device = _int_column(devices)
        self.process = np.full(len(rows), first["process"], np.int64)
        self.time = np.array(times, np.int64) / 1e9
        self.shard_index: np.ndarray | None = None
        if first.get("shard") is not None:
            self.shard_index = np.array([m.shard_index for m in self.metas()], np.int64)

    @property
    def consumer(self) -> str:
        return self._template.consumer

    @property
    def meta(self) -> TapMeta:
        """The first tap's meta: its static fields (consumer, emitter, process, host,
        transforms, `meta`) are every tap's."""
        return self._template.meta(self._header_of(0))

    def __len__(self) -> int:
        return len(self.tids)

    def metas(self) -> list[TapMeta]:
        return [self._template.meta(self._header_of(i)) for i in range(len(self.tids))]

    def headers(self) -> list[dict[str, Any]]:
        """Each tap's header as the wire protocol has it (docs/PROTOCOL.md, `tap`): for
        tools that keep taps as they travelled (`tapd record`)."""
        return [self._header_of(i) for i in range(len(self.tids))]

    def __iter__(self) -> Iterator[tuple[Any, TapMeta]]:
        for i, meta in enumerate(self.metas()):
            leaves = [leaf[i] for leaf in self.leaves]
            yield (leaves[0] if self._tree == LEAF else unflatten(self._tree, leaves)), meta

    def __repr__(self) -> str:
        return f"<TapBatch {self.consumer!r} x{len(self)} seq {self.seq[0]}..{self.seq[-1]}>"


def _int_column(values: Sequence[int | None]) -> np.ndarray:
    """int64, -1 for None (a tap without a step, or a device)."""
    if None in values:
        values = [-1 if value is None else value for value in values]
    return np.array(values, np.int64)


def batch_of_runs(runs: Sequence[SiteRun], template: MetaTemplate) -> TapBatch:
    """The taps of runs of one static entry, stacked, in the runs' order."""
    static = runs[0].static
    rows = runs[0].rows if len(runs) == 1 else [row for run in runs for row in run.rows]
    per_run = [run.leaves() for run in runs]
    if len(per_run) == 1:
        leaves = per_run[0]
    else:
        leaves = [np.concatenate(parts) for parts in zip(*per_run, strict=True)]
    return TapBatch(
        template, static.tap_header(rows[0]), rows, leaves, lambda i: static.tap_header(rows[i])
    )


def batch_of_tap(message: Message, template: MetaTemplate) -> TapBatch:
    """One `tap` message as a batch of one."""
    h = message.header
    row = [0, h.get("tid"), h["seq"], h["step"], h["device"], h["time"]]
    leaves = [leaf[np.newaxis] for leaf in message.arrays()]
    return TapBatch(template, h, [row], leaves, lambda _: h)
