"""A decoded message (`Message`), and the taps a `taps` message carries: runs of one
static entry (`SiteRun`), or a `ring_taps` message: spans of a ring (`RingSpan`). What
`decode` (wire.py) and `read_runs`/`read_spans` (batch.py) return, already checked
(schema.py); the framing both ends share (`MAGIC`, `encode_header`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from tapd.protocol.dtypes import dtype_from_name
from tapd.protocol.ring_format import NO_STEP
from tapd.protocol.tree import LEAF, rebuilder, unflatten

VERSION = 1
MAGIC = b"TAPD" + bytes([VERSION])

Frame = bytes | memoryview


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Pack a header (the daemon also uses it to stamp delivery ids on forwarded taps)."""
    packed: bytes = msgpack.packb(dict(header), use_bin_type=True)
    return packed


@dataclasses.dataclass(frozen=True)
class Message:
    """A decoded message: its header and, for taps, the raw array frames."""

    header: dict[str, Any]
    frames: Sequence[Frame] = ()
    runs: Sequence[SiteRun] = ()  # a `taps` message's taps, checked, by static entry
    spans: Sequence[RingSpan] = ()  # a `ring_taps` message's taps, checked, by ring span
    site: Hashable | None = None  # equal for taps of one site: static fields equal too

    @functools.cached_property
    def batch(self) -> list[Message]:
        """A `taps` message's taps, each a `tap` Message viewing a body frame."""
        return [run.message(i) for run in self.runs for i in range(len(run))]

    @property
    def kind(self) -> str:
        return str(self.header["kind"])

    def arrays(self) -> list[np.ndarray]:
        """The tap's leaves as read-only numpy arrays viewing the frames."""
        out = []
        for (name, shape, _), frame in zip(self.header["leaves"], self.frames, strict=True):
            array = np.frombuffer(frame, dtype=dtype_from_name(name)).reshape(shape)
            array.flags.writeable = False  # it views the message's frame
            out.append(array)
        return out

    def value(self) -> Any:
        """The tapped value, rebuilt with its pytree structure."""
        arrays = self.arrays()
        if self.header["tree"] == LEAF:  # the common case: one array, nothing to rebuild
            return arrays[0]
        return unflatten(self.header["tree"], arrays)


class StaticEntry:
    """A `taps` message's static entry, checked (schema.check_batch_static): its
    fields, where each leaf lies from a tap's offset, and its shard axes' sizes."""

    def __init__(self, fields: dict[str, Any], sizes: Sequence[int]) -> None:
        self.fields = fields
        self.sizes = list(sizes)
        # Each leaf's (start, size) from the tap's offset, padded to 8; and the whole.
        self.layout: list[tuple[int, int]] = []
        self.extent = 0
        for nbytes in self.sizes:
            self.layout.append((self.extent, nbytes))
            self.extent += nbytes + (-nbytes % 8)
        shard = fields.get("shard")
        self.shard_sizes: list[int] | None = None if shard is None else list(shard["sizes"])

    def tap_header(self, row: list[Any]) -> dict[str, Any]:
        """The full header of the tap a (checked) row describes."""
        _, tid, seq, step, device, time, coords, _, _ = row
        header = {
            **self.fields,
            "kind": "tap",
            "tid": tid,
            "seq": seq,
            "step": step,
            "device": device,
            "time": time,
        }
        if coords is not None:
            header["shard"] = {**self.fields["shard"], "coords": coords}
        return header


def site_every(fields: Mapping[str, Any]) -> int:
    """A site's own K (`tap(x, name, every=K)`) from a tap's header or a `taps` static
    entry: its taps' seqs count every execution, copied or not (docs/PROTOCOL.md)."""
    k = fields.get("every", 1)
    return k if type(k) is int and k >= 1 else 1


def made(cls: type[Any], fields: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass `cls` holding `fields` (all of its fields,
    and any private extras), made without its generated __init__, which costs one
    object.__setattr__ per field: the per-tap path makes a Message and a TapMeta per tap."""
    instance = object.__new__(cls)
    object.__setattr__(instance, "__dict__", fields)
    return instance


class _RunTap(Message):
    """A tap of a SiteRun: its arrays are rows of the run's stacked leaves, sliced
    from them rather than each made anew from its frames."""

    def arrays(self) -> list[np.ndarray]:
        leaves = self.__dict__.get("_leaves")
        if leaves is None:  # (made by its __init__: dataclasses.replace, say)
            return super().arrays()
        i = self.__dict__["_index"]
        return [leaf[i, ...] for leaf in leaves]


class RunColumns(NamedTuple):
    """A columnar run's per-tap fields as the wire gave them (docs/PROTOCOL.md, "taps"):
    delivery ids `first_tid` on, one each; where each tap's leaves start in the body;
    seqs; steps (NO_STEP where a tap has none; None: no tap has one); devices; times."""

    first_tid: int
    offsets: np.ndarray  # int64
    seqs: np.ndarray  # uint64
    steps: np.ndarray | None  # int64
    devices: np.ndarray  # int64
    times: np.ndarray  # int64, ns


class SiteRun:
    """Consecutive taps of a `taps` message that share one static entry and one body
    frame, checked: what a batch handler gets as columns (tapd_client.TapBatch) and a
    per-tap handler as one `tap` Message each.

    Its taps came as rows (`rows`, one list per tap) or as a columnar run (`columns`,
    an array per field): either is there for every run, the other made from it when
    first asked for. `column_lists()` gives the per-tap fields as lists either way,
    without a row per tap."""

    __slots__ = ("_columns", "_leaves", "_place", "_rows", "body", "static")

    def __init__(
        self,
        static: StaticEntry,
        body: memoryview,
        rows: list[list[Any]] | None = None,
        columns: RunColumns | None = None,
        place: tuple[int, int] = (0, 0),
    ) -> None:
        self.static = static
        self.body = body
        # [static, tid, seq, step, device, time, coords, frame, offset]
        self._rows = rows
        self._columns = columns
        self._place = place  # a columnar run's (static index, body frame), for its rows
        self._leaves: list[np.ndarray] | None = None

    @property
    def rows(self) -> list[list[Any]]:
        """One row per tap, as a `taps` message's rows are (made from the columns of a
        columnar run, once)."""
        if self._rows is None:
            assert self._columns is not None
            static, frame = self._place
            count = len(self._columns.offsets)
            tids, seqs, steps, devices, times, coords = self.column_lists()
            self._rows = list(
                map(
                    list,
                    zip(
                        itertools.repeat(static, count),
                        tids,
                        seqs,
                        steps,
                        devices,
                        times,
                        coords,
                        itertools.repeat(frame, count),
                        self._columns.offsets.tolist(),
                        strict=True,
                    ),
                )
            )
        return self._rows

    @property
    def columns(self) -> RunColumns | None:
        """A columnar run's fields as arrays; None for a run that came as rows."""
        return self._columns

    def column_lists(self) -> tuple[Sequence[Any], ...]:
        """tids, seqs, steps, devices, times and shard coordinates of its taps, in
        order, each a sequence (steps and devices None where a tap has none)."""
        columns = self._columns
        if columns is None:
            return tuple(list(column) for column in list(zip(*self.rows, strict=True))[1:7])
        count = len(columns.offsets)
        steps: list[Any] = [None] * count
        if columns.steps is not None:
            steps = columns.steps.tolist()
            if NO_STEP in steps:
                steps = [None if step == NO_STEP else step for step in steps]
        return (
            range(columns.first_tid, columns.first_tid + count),
            columns.seqs.tolist(),
            steps,
            columns.devices.tolist(),
            columns.times.tolist(),
            [None] * count,
        )

    @property
    def last_tid(self) -> int:
        """The highest delivery id of its taps."""
        if self._columns is not None:
            return self._columns.first_tid + len(self._columns.offsets) - 1
        return int(max(row[1] for row in self.rows))

    def offsets(self) -> np.ndarray:
        """Where each tap's leaves start in `body`."""
        if self._columns is not None:
            return self._columns.offsets
        return np.array([row[8] for row in self.rows], np.int64)

    def leaves(self) -> list[np.ndarray]:
        """Each leaf of the run's taps stacked along a new axis 0, read-only: a strided
        view of the body where the taps are evenly spaced, else a gathered copy."""
        if self._leaves is None:
            self._leaves = stacked_leaves(self.static, self.body, self.offsets())
        return self._leaves

    def __len__(self) -> int:
        return len(self._columns.offsets) if self._columns is not None else len(self.rows)

    @property
    def fields(self) -> dict[str, Any]:
        """The static fields every tap of the run shares (consumer, tree, leaves, ...)."""
        return self.static.fields

    @property
    def layout(self) -> list[tuple[int, int]]:
        """Each leaf's (start, size) in bytes, from a tap's offset in `body`."""
        return self.static.layout

    def header(self, i: int) -> dict[str, Any]:
        return self.static.tap_header(self.row(i))

    def row(self, i: int) -> list[Any]:
        """Tap i's row (of a columnar run: that row alone, made now)."""
        columns = self._columns
        if columns is None or self._rows is not None:
            return self.rows[i]
        step = None if columns.steps is None else int(columns.steps[i])
        return [
            self._place[0],
            columns.first_tid + i,
            int(columns.seqs[i]),
            None if step == NO_STEP else step,
            int(columns.devices[i]),
            int(columns.times[i]),
            None,
            self._place[1],
            int(columns.offsets[i]),
        ]

    def values(self) -> Sequence[Any]:
        """Each tap's value, as `message(i).value()` gives it: rows of the stacked
        leaves (read-only views), rebuilt with the pytree structure where there is one."""
        return tap_values(self.fields["tree"], self.leaves(), len(self))

    def message(self, i: int) -> Message:
        offset, body = int(self.offsets()[i]), self.body
        frames = [body[offset + start : offset + start + n] for start, n in self.static.layout]
        fields = {"header": self.header(i), "frames": frames, "runs": (), "spans": (),
                  "site": self.static}  # fmt: skip
        return made(_RunTap, {**fields, "_leaves": self.leaves(), "_index": i})  # type: ignore[no-any-return]


class RingSpan:
    """Consecutive taps of a `ring_taps` message that share one static entry and lie
    close together in one ring, checked: ring positions [start, end) of ring file `ring`
    hold them, tap i's leaves from `start + rows[i][8]` on (each row's offset is from
    `start`). A subscriber reads those bytes (a copy, or a view) and has a `SiteRun`."""

    __slots__ = ("end", "ring", "rows", "start", "static")

    def __init__(
        self, static: StaticEntry, ring: str, start: int, end: int, rows: list[list[Any]]
    ) -> None:
        self.static = static
        self.ring = ring
        self.start = start
        self.end = end
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def run(self, body: memoryview) -> SiteRun:
        """The span's taps, its bytes read into `body` (end - start bytes)."""
        return SiteRun(self.static, body, self.rows)


def _rows(leaf: np.ndarray) -> list[np.ndarray]:
    """A stacked leaf's rows, each an array (a 0-d one too: iterating would give scalars)."""
    return list(leaf) if leaf.ndim > 1 else [leaf[i, ...] for i in range(len(leaf))]


def _c_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """The strides of a C-ordered array of `shape` (no extent 0), as numpy gives them,
    without making one: a large leaf would be allocated for nothing."""
    strides = []
    step = itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def tap_values(tree: Any, leaves: list[np.ndarray], count: int) -> Sequence[Any]:
    """Each of `count` taps' value from its site's stacked leaves (`stacked_leaves`):
    rows of them (read-only views), rebuilt with the pytree structure where there is one."""
    rows = [_rows(leaf) for leaf in leaves]
    if tree == LEAF:
        return rows[0]
    rebuild = rebuilder(tree)
    if not rows:  # a value without arrays: (), None, {}
        return [rebuild([]) for _ in range(count)]
    return [rebuild(arrays) for arrays in zip(*rows, strict=True)]


def stacked_leaves(static: StaticEntry, body: memoryview, offsets: np.ndarray) -> list[np.ndarray]:
    """Each leaf of the taps of one site whose leaves start at `offsets` in `body`,
    stacked along a new axis 0, read-only: a strided view of the body where the taps
    are evenly spaced, else a gathered copy."""
    count = len(offsets)
    steps = np.diff(offsets)
    stride = int(steps[0]) if count > 1 else 0
    even = count == 1 or bool((steps == stride).all())
    # (An array made on a memoryview keeps only the view's object, not the view: one
    # made on this array keeps the view's hold on the buffer, so that a ring's mapping
    # is not unmapped under a value a handler kept: tapd_client/shm.py, views=True.)
    raw = np.frombuffer(body, np.uint8)
    out = []
    for (name, shape, _), (start, size) in zip(static.fields["leaves"], static.layout, strict=True):
        dtype = dtype_from_name(name)
        if size == 0:
            leaf = np.zeros((count, *shape), dtype)
        elif even:
            inner = _c_strides(shape, dtype.itemsize)
            leaf = np.ndarray(
                (count, *shape),
                dtype,
                buffer=raw,
                offset=int(offsets[0]) + start,
                strides=(stride, *inner),
            )
        else:
            where = offsets[:, np.newaxis] + (start + np.arange(size))
            leaf = raw[where].view(dtype).reshape(count, *shape)
        leaf.flags.writeable = False
        out.append(leaf)
    return out
