"""What a handler learns about each tap besides its value."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tapd.protocol.message import made


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


@dataclasses.dataclass(frozen=True)
class TapMeta:
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
