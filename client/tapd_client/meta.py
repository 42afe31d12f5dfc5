"""What a handler learns about each tap besides its value.

`TapMeta` is a frozen dataclass. The taps of a batch (a run of one site's records)
get a `ColumnMeta` each instead: the same fields and behaviour (equality, repr,
`dataclasses.fields`/`asdict`/`replace`, `isinstance(meta, TapMeta)`), read on access
from the batch's columns (`Columns`), so that a per-tap handler's meta costs one
small object rather than a dict of twelve fields, a ShardInfo and a copy of the
site's metadata made for every tap whether the handler looks at them or not.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

from tapd.protocol.batch import SiteRun
from tapd.protocol.message import RunColumns, made
from tapd.protocol.ring_format import NO_STEP


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where a tap inside pmap/shard_map (or a per-shard jit tap) sits in the global value.

    `coords` are the device's coordinates on the mesh axes it ran under; `index` is
    their row-major rank, from 0 to `count` - 1. For each leaf of the tapped value,
    `global_shapes` has the global array's shape and `dims` the mesh axes that split
    each global dimension (docs/PROTOCOL.md, "shard").
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    coords: tuple[int, ...]
    global_shapes: tuple[tuple[int, ...], ...]
    dims: tuple[tuple[tuple[str, ...], ...], ...]

    @property
    def index(self) -> int:
        index = 0
        for coord, size in zip(self.coords, self.sizes, strict=True):
            index = index * size + coord
        return index

    @property
    def count(self) -> int:
        return math.prod(self.sizes)

    @property
    def mesh_coords(self) -> dict[str, int]:
        return dict(zip(self.axes, self.coords, strict=True))

    def block(self, leaf: int = 0) -> tuple[slice, ...]:
        """The slice of leaf `leaf`'s global array that this tap's block fills."""
        sizes = dict(zip(self.axes, self.sizes, strict=True))
        where = self.mesh_coords
        out = []
        for extent, split in zip(self.global_shapes[leaf], self.dims[leaf], strict=True):
            position = 0
            for name in split:  # row-major over the axes that split this dimension
                position = position * sizes[name] + where[name]
            length = extent // math.prod(sizes[name] for name in split)
            out.append(slice(position * length, (position + 1) * length))
        return tuple(out)

    @classmethod
    def from_header(cls, shard: dict[str, Any]) -> ShardInfo:
        return cls(
            axes=tuple(shard["axes"]),
            sizes=tuple(shard["sizes"]),
            coords=tuple(shard["coords"]),
            global_shapes=tuple(tuple(shape) for shape, _ in shard["layout"]),
            dims=tuple(tuple(tuple(split) for split in dims) for _, dims in shard["layout"]),
        )


class _TapMetaType(type):
    """TapMeta's metaclass: a `ColumnMeta` is a TapMeta for isinstance (it is one in
    every other respect, without being a subclass: a subclass would carry the frozen
    dataclass's Python-level __setattr__ and an instance dict, per tap)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or type(instance) is ColumnMeta


@dataclasses.dataclass(frozen=True)
class TapMeta(metaclass=_TapMetaType):
    consumer: str  # the tap's name: "loss", or "module:qualname"
    seq: int  # per (emitter, device, consumer), from 0, in program order
    step: int | None  # the step= given at the tap site
    device: int | None  # device id where the backend knows it
    process: int  # jax.process_index() of the emitting process
    host: str
    pid: int
    emitter: str  # "host:pid"
    # e.g. (("batch", {"batch_dims": (0,)}),): host_callback's form, outermost last
    transforms: tuple[tuple[str, dict[str, Any]], ...]
    time: float  # unix seconds when the tap ran
    meta: dict[str, Any]  # static metadata given at the tap site
    shard: ShardInfo | None = None  # inside pmap/shard_map, or a per-shard jit tap

    @property
    def shard_index(self) -> int | None:
        return None if self.shard is None else self.shard.index

    @property
    def global_shape(self) -> tuple[int, ...] | None:
        """The global shape of a one-leaf tapped value (`shard.global_shapes` has them
        all); None for unsharded taps."""
        if self.shard is None or len(self.shard.global_shapes) != 1:
            return None
        return self.shard.global_shapes[0]

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> TapMeta:
        """The metadata of a decoded tap; `MetaTemplate` does the same, quicker, for
        many taps that share their static fields."""
        return cls(
            consumer=header["consumer"],
            seq=header["seq"],
            step=header["step"],
            device=header["device"],
            process=header["process"],
            host=header["host"],
            pid=header["pid"],
            emitter=str(header.get("emitter") or f"{header['host']}:{header['pid']}"),
            transforms=_transforms(header["transforms"]),
            time=header["time"] / 1e9,
            meta=dict(header["meta"]),
            shard=ShardInfo.from_header(header["shard"]) if header.get("shard") else None,
        )


def _transforms(wire: list[Any]) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The protocol's `[name, params]` pairs as host_callback gave them: tuples, with
    `batch_dims` a tuple too (msgpack has only lists)."""
    out = []
    for name, params in wire:
        params = dict(params)
        if isinstance(params.get("batch_dims"), list):
            params["batch_dims"] = tuple(params["batch_dims"])
        out.append((str(name), params))
    return tuple(out)


class MetaTemplate:
    """What the taps of one site (a `taps` batch's static entry) share, parsed once:
    `meta(header)` then fills in only what changes from tap to tap."""

    def __init__(self, header: dict[str, Any]) -> None:
        first = TapMeta.from_header(header)
        self._shared = (first.process, first.host, first.pid, first.emitter, first.transforms)
        self.consumer = first.consumer
        self._meta = first.meta
        self._shard = first.shard

    def meta(self, header: dict[str, Any]) -> TapMeta:
        shard = header["shard"]["coords"] if self._shard is not None else None
        return self.meta_of(header["seq"], header["step"], header["device"], header["time"], shard)

    def meta_of(
        self, seq: int, step: int | None, device: int | None, time_ns: int, coords: Any
    ) -> TapMeta:
        """The meta of one tap of the site, from its per-tap fields (a `taps` row's)."""
        process, host, pid, emitter, transforms = self._shared
        shard = self._shard
        if shard is not None:
            shard = dataclasses.replace(shard, coords=tuple(coords))
        # (not through __init__, which costs an object.__setattr__ per field of a frozen
        # dataclass; tests/test_batching.py pins these keys to TapMeta's fields)
        fields = {
            "consumer": self.consumer,
            "seq": seq,
            "step": step,
            "device": device,
            "process": process,
            "host": host,
            "pid": pid,
            "emitter": emitter,
            "transforms": transforms,
            "time": time_ns / 1e9,
            "meta": dict(self._meta),
            "shard": shard,
        }
        meta: TapMeta = made(TapMeta, fields)
        return meta


_FIELDS = tuple(field.name for field in dataclasses.fields(TapMeta))


_ROW_INDEX = {"tids": 1, "seqs": 2, "steps": 3, "devices": 4, "times": 5, "coords": 6}


class Columns:
    """The per-tap fields of a batch of one site's taps, a sequence each (tap i's at
    index i), and the site's `MetaTemplate`: what a batch's `ColumnMeta`s and its
    `TapBatch` read. Made from the batch's runs of a `taps` message (columnar runs'
    arrays, or rows: [static, tid, seq, step, device, time, coords, frame, offset],
    checked by decode), or from rows alone; each column is made on its first use, in C
    (a handler that reads no step makes no step column), and kept: later reads are a
    slot's. It holds the runs' fields, not the runs: a meta a handler keeps keeps a
    few bytes a tap alive, not the message's body."""

    __slots__ = (
        "coords",
        "count",
        "devices",
        "parts",
        "seqs",
        "sharded",
        "steps",
        "template",
        "tids",
        "times",
    )

    template: MetaTemplate
    sharded: bool  # coords name the shard of each tap
    parts: list[RunColumns | Sequence[Sequence[Any]]]  # per run: its columns, or its rows
    count: int
    tids: Sequence[int]
    seqs: Sequence[int]
    steps: Sequence[int | None]
    devices: Sequence[int | None]
    times: Sequence[int]
    coords: Sequence[Any]

    def __init__(
        self,
        template: MetaTemplate,
        runs: Sequence[SiteRun] = (),
        rows: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        self.template = template
        self.sharded = template._shard is not None
        if rows is not None:
            self.parts = [rows]
            self.count = len(rows)
        else:
            self.parts = [run.rows if run.columns is None else run.columns for run in runs]
            self.count = sum(map(len, runs))

    def __getattr__(self, name: str) -> Any:
        """A column not made yet (an unset slot): made, and kept."""
        index = _ROW_INDEX.get(name)
        if index is None:
            raise AttributeError(name)
        parts = self.parts
        column: Sequence[Any]
        if len(parts) == 1:
            column = _part_column(parts[0], index)
        else:
            column = [value for part in parts for value in _part_column(part, index)]
        setattr(self, name, column)
        return column

    def __len__(self) -> int:
        return self.count

    def arrays(self) -> list[RunColumns] | None:
        """Each run's columns where every run came as a columnar run, else None."""
        parts = self.parts
        if all(isinstance(part, RunColumns) for part in parts):
            return parts  # type: ignore[return-value]
        return None

    def meta(self, index: int) -> TapMeta:
        """Tap `index`'s meta (a `ColumnMeta`: a TapMeta in all but its type)."""
        meta: Any = _new(ColumnMeta)
        meta._columns = self
        meta._index = index
        return meta  # type: ignore[no-any-return]


_new = object.__new__


def _part_column(part: RunColumns | Sequence[Sequence[Any]], index: int) -> Sequence[Any]:
    """Field `index` of a row (tid, seq, step, device, time, coords: 1..6) of each tap
    of a run: from its arrays where it came as a columnar run (docs/PROTOCOL.md, "taps")."""
    if not isinstance(part, RunColumns):
        return list(map(operator.itemgetter(index), part))
    count = len(part.offsets)
    if index == 1:
        return range(part.first_tid, part.first_tid + count)
    if index == 3:
        if part.steps is None:
            return [None] * count
        steps: list[int | None] = part.steps.tolist()
        return [None if step == NO_STEP else step for step in steps] if NO_STEP in steps else steps
    if index == 6:
        return [None] * count
    array = (part.seqs, part.devices, part.times)[(2, 4, 5).index(index)]
    return array.tolist()  # type: ignore[no-any-return]


def _fields_of(meta: Any) -> tuple[Any, ...]:
    return tuple(getattr(meta, name) for name in _FIELDS)


class ColumnMeta:
    """A TapMeta (the same fields, equal to the eager one of the same tap) that reads
    tap `_index` of a batch's `Columns` when a field is asked for. Its `meta` dict
    and `shard` are made on first access and kept: a handler may change the dict, and
    find its change there again, as with a TapMeta. Read-only as TapMeta is; copies,
    pickles and `dataclasses.replace` give a plain TapMeta, `vars()` its fields."""

    __slots__ = ("_columns", "_index", "_meta", "_shard")
    __dataclass_fields__ = TapMeta.__dataclass_fields__
    __match_args__ = TapMeta.__match_args__

    _columns: Columns
    _index: int
    _meta: dict[str, Any]
    _shard: ShardInfo | None

    def __new__(cls, *args: Any, **fields: Any) -> Any:
        """Called with fields (`dataclasses.replace`, say): a plain TapMeta of them."""
        return TapMeta(*args, **fields)

    @property
    def consumer(self) -> str:
        return self._columns.template.consumer

    @property
    def seq(self) -> int:
        return self._columns.seqs[self._index]

    @property
    def step(self) -> int | None:
        return self._columns.steps[self._index]

    @property
    def device(self) -> int | None:
        return self._columns.devices[self._index]

    @property
    def process(self) -> int:
        return self._columns.template._shared[0]

    @property
    def host(self) -> str:
        return self._columns.template._shared[1]

    @property
    def pid(self) -> int:
        return self._columns.template._shared[2]

    @property
    def emitter(self) -> str:
        return self._columns.template._shared[3]

    @property
    def transforms(self) -> tuple[tuple[str, dict[str, Any]], ...]:
        return self._columns.template._shared[4]

    @property
    def time(self) -> float:
        return self._columns.times[self._index] / 1e9

    @property
    def meta(self) -> dict[str, Any]:
        try:
            return self._meta
        except AttributeError:
            meta = self._meta = dict(self._columns.template._meta)
            return meta

    @property
    def shard(self) -> ShardInfo | None:
        try:
            return self._shard
        except AttributeError:
            shard = self._columns.template._shard
            if shard is not None:
                coords = tuple(self._columns.coords[self._index])
                shard = dataclasses.replace(shard, coords=coords)
            self._shard = shard
            return shard

    shard_index = TapMeta.shard_index
    global_shape = TapMeta.global_shape

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TapMeta):
            return NotImplemented
        return _fields_of(self) == _fields_of(other)

    def __hash__(self) -> int:  # (as TapMeta's: unhashable, for its `meta` dict)
        return hash(_fields_of(self))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in _FIELDS)
        return f"TapMeta({fields})"

    def __reduce__(self) -> tuple[type[TapMeta], tuple[Any, ...]]:
        return TapMeta, _fields_of(self)

    def __replace__(self, **changes: Any) -> TapMeta:  # (copy.replace, Python 3.13)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var, return-value]

    @property
    def __dict__(self) -> dict[str, Any]:  # type: ignore[override]
        """Its fields, as a TapMeta's `vars()` gives them (a copy: it is read-only)."""
        return dict(zip(_FIELDS, _fields_of(self), strict=True))
