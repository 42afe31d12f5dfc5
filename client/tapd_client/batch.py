"""`TapBatch`: taps of one site that arrived together, as columns, for batch handlers.

    @sub.on("loss", batch=True)
    def log(batch: TapBatch) -> None:
        writer.add_scalars(batch.seq, batch.value)   # value: shape (len(batch),)

Every tap of a batch comes from one site of one emitter: same consumer, tree, leaf
shapes and dtypes, and static metadata (`batch.meta` holds those). Each leaf of
`batch.value` is stacked along a new first axis. Where the taps lie evenly spaced in
the received message (ring records of one site, the common case), a leaf is a
read-only view of the message, not a copy. The message's buffer is the batch's own
(never reused for a later message), so a handler may keep a leaf, or a row of it,
past its call; only `Subscriber(views=True)` gives views of a ring, valid during the
call alone (tapd_client/shm.py).

The meta columns (`seq`, `step`, ...) are made on first access: a handler that reads
none of them costs nothing per tap. `Columns` holds a batch's per-tap fields as the
wire gave them, for the per-tap path too (tapd_client/handlers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from tapd.protocol import Message, unflatten
from tapd.protocol.batch import SiteRun
from tapd.protocol.dtypes import dtype_from_name
from tapd.protocol.message import RunColumns, tap_values
from tapd.protocol.ring_format import NO_STEP
from tapd.protocol.tree import LEAF
from tapd_client.meta import Columns, MetaTemplate, TapMeta


def last_tid(runs: Sequence[SiteRun]) -> int:
    """The highest delivery id of the taps of `runs`."""
    return max(run.last_tid for run in runs)


class TapBatch:
    """Taps of one site, in order: stacked leaves and per-tap meta columns.

    `seq`, `step` (-1 where a tap has no step), `device` (-1 where unknown), `process`:
    int64 arrays; `time`: float64 unix seconds (`TapMeta.time`); `shard_index`: int64,
    or None when the site is not sharded. `metas()` and iteration give the per-tap
    `(value, TapMeta)` pairs a per-tap handler gets.
    """

    __slots__ = (
        "_cache",
        "_columns",
        "_header_of",
        "_tree",
        "leaves",
        "value",
    )

    def __init__(
        self,
        columns: Columns,
        tree: Any,
        leaves: list[np.ndarray],
        header_of: Callable[[int], dict[str, Any]],
    ) -> None:
        """`columns`: every tap's per-tap fields, and the site's template; `tree`:
        its pytree; `header_of(i)`: tap i's full header, made only when asked for."""
        self._header_of = header_of
        self._columns = columns
        self._cache: dict[str, Any] = {}
        self._tree = tree
        self.leaves = leaves
        self.value: Any = leaves[0] if self._tree == LEAF else unflatten(self._tree, leaves)

    def _column(self, name: str, make: Callable[[], Any]) -> Any:
        column = self._cache.get(name)
        if column is None and name not in self._cache:
            column = self._cache[name] = make()
        return column

    @property
    def tids(self) -> list[int]:
        return self._column("tids", lambda: list(self._columns.tids))  # type: ignore[no-any-return]

    @property
    def seq(self) -> np.ndarray:
        return self._column("seq", lambda: self._array("seqs"))  # type: ignore[no-any-return]

    @property
    def step(self) -> np.ndarray:
        return self._column("step", lambda: self._array("steps"))  # type: ignore[no-any-return]

    @property
    def device(self) -> np.ndarray:
        return self._column("device", lambda: self._array("devices"))  # type: ignore[no-any-return]

    @property
    def process(self) -> np.ndarray:
        return self._column(  # type: ignore[no-any-return]
            "process", lambda: np.full(len(self), self.meta.process, np.int64)
        )

    @property
    def time(self) -> np.ndarray:
        return self._column("time", lambda: self._array("times") / 1e9)  # type: ignore[no-any-return]

    def _array(self, name: str) -> np.ndarray:
        """A per-tap field as int64, -1 for None (a tap without a step, or a device):
        columnar runs' arrays as they came, else the column made from rows."""
        runs = self._columns.arrays()
        if runs is not None:
            parts = [_run_array(run, name) for run in runs]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)
        return _int_column(getattr(self._columns, name))

    @property
    def shard_index(self) -> np.ndarray | None:
        if not self._columns.sharded:
            return None
        return self._column(  # type: ignore[no-any-return]
            "shard_index", lambda: np.array([m.shard_index for m in self.metas()], np.int64)
        )

    @property
    def consumer(self) -> str:
        return self._columns.template.consumer

    @property
    def meta(self) -> TapMeta:
        """The first tap's meta: its static fields (consumer, emitter, process, host,
        transforms, `meta`) are every tap's."""
        return self._column("meta", lambda: self._columns.meta(0))  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self._columns)

    def metas(self) -> list[TapMeta]:
        """Each tap's meta, as a per-tap handler gets it."""
        return list(map(self._columns.meta, range(len(self))))

    def headers(self) -> list[dict[str, Any]]:
        """Each tap's header as the wire protocol has it (docs/PROTOCOL.md, `tap`): for
        tools that keep taps as they travelled (`tapd record`)."""
        return [self._header_of(i) for i in range(len(self))]

    def __iter__(self) -> Iterator[tuple[Any, TapMeta]]:
        values = tap_values(self._tree, self.leaves, len(self))
        return zip(values, self.metas(), strict=True)

    def __repr__(self) -> str:
        seqs = self._columns.seqs
        return f"<TapBatch {self.consumer!r} x{len(self)} seq {seqs[0]}..{seqs[-1]}>"


def _run_array(columns: RunColumns, name: str) -> np.ndarray:
    if name == "steps":
        if columns.steps is None:
            return np.full(len(columns.offsets), -1, np.int64)
        return np.where(columns.steps == NO_STEP, -1, columns.steps)
    array: np.ndarray = getattr(columns, name)
    return array.astype(np.int64)  # (seqs come as uint64; a copy: the batch's own)


def _int_column(values: Sequence[int | None]) -> np.ndarray:
    """int64, -1 for None (a tap without a step, or a device)."""
    if None in values:
        values = [-1 if value is None else value for value in values]
    return np.array(values, np.int64)


def single_value(run: SiteRun) -> Any:
    """The value of a run's one tap, as `run.values()[0]` is, made without stacking
    (what sites that take turns in a loop send: runs of one tap each)."""
    # (Made on an array of the body, not on the body: it keeps the body's hold on its
    # buffer, a ring's mapping with views=True; as message.stacked_leaves does.)
    raw = np.frombuffer(run.body, np.uint8)
    offset = run.row(0)[8]
    arrays = []
    for (name, shape, _), (start, size) in zip(run.fields["leaves"], run.layout, strict=True):
        dtype = dtype_from_name(name)
        if size == 0:
            array = np.zeros(shape, dtype)
        else:
            array = raw[offset + start : offset + start + size].view(dtype).reshape(shape)
        array.flags.writeable = False
        arrays.append(array)
    tree = run.fields["tree"]
    return arrays[0] if tree == LEAF else unflatten(tree, arrays)


def batch_of_runs(runs: Sequence[SiteRun], template: MetaTemplate) -> TapBatch:
    """The taps of runs of one static entry, stacked, in the runs' order."""
    static = runs[0].static
    per_run = [run.leaves() for run in runs]
    if len(per_run) == 1:
        leaves = per_run[0]
    else:
        leaves = [np.concatenate(parts) for parts in zip(*per_run, strict=True)]
    rows: list[list[Any]] = []

    def header_of(i: int) -> dict[str, Any]:
        if not rows:
            rows.extend(row for run in runs for row in run.rows)
        return static.tap_header(rows[i])

    return TapBatch(Columns(template, runs), static.fields["tree"], leaves, header_of)


def batch_of_tap(message: Message, template: MetaTemplate) -> TapBatch:
    """One `tap` message as a batch of one."""
    h = message.header
    coords = None if h.get("shard") is None else h["shard"]["coords"]
    row = [0, h.get("tid"), h["seq"], h["step"], h["device"], h["time"], coords, 0, 0]
    leaves = [leaf[np.newaxis] for leaf in message.arrays()]
    return TapBatch(Columns(template, rows=[row]), h["tree"], leaves, lambda _: h)
