"""Where a tap sits in a sharded program: mesh axes, shard coordinates, global shapes.

Inside `pmap` and `shard_map` every device runs the tap on its own block, and the mesh
axes it runs under are *manual*. The tap then carries its coordinates on those axes
(`lax.axis_index`, a traced operand, so it costs one tiny extra leaf) and a static
layout per leaf: the global shape and, for each global dimension, the mesh axes that
split it. A subscriber rebuilds the global array from the blocks with that layout
(`tapd_client.Assembler`).

Layout of a leaf, by default, is pmap's: the blocks stack along new leading dimensions,
one per manual axis, so a pmap over 8 devices of an f32[3] tap has global shape
(8, 3). `tap(..., spec=P("data"))` says instead how the block tiles the global value,
as `shard_map`'s `out_specs` would: f32[3] under `spec=P("data")` with 8 "data" shards
has global shape (24,).

`jit` with an explicitly sharded argument (mesh axes of type Explicit, so the sharding
is known while tracing) runs the tap inside a `shard_map` over the argument's mesh:
one tap per device, on its own shard, not an all-gather. Where the sharding is only
decided by the compiler (Auto axes), the tap has to see the global value: JAX gives no
choice then. `jax.debug.callback` gathers it to the first device and runs there; the
native backend does the same through a `shard_map` with a replicated operand (so
every device receives the gathered value) in which only the first device taps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from tapd.errors import TapDefinitionError

Axes = tuple[tuple[str, int], ...]  # (mesh axis name, size), in mesh order
REPLICATED: PartitionSpec = PartitionSpec()  # type: ignore[no-untyped-call]


def manual_axes() -> Axes:
    """The mesh axes this trace runs per device under (pmap, shard_map); () in jit."""
    try:
        from jax._src.mesh import get_abstract_mesh

        mesh = get_abstract_mesh()
        names = tuple(mesh.manual_axes)
    except (ImportError, AttributeError):  # a JAX without abstract meshes: no sharding info
        return ()
    return tuple((str(name), int(mesh.shape[name])) for name in names)


def coordinates(axes: Axes) -> jax.Array:
    """This device's index on each manual axis, as an int32 vector (traced)."""
    return jnp.stack([lax.axis_index(name) for name, _ in axes]).astype(jnp.int32)


def trace_mesh(leaves: Sequence[Any]) -> tuple[Any, list[PartitionSpec]] | None:
    """(mesh, one spec per leaf) when the leaves live on a multi-device mesh this trace
    knows; a leaf's spec is P() where the compiler decides its sharding (Auto axes).
    None outside such a mesh, or when the leaves are on different meshes."""
    mesh = None
    specs = []
    for leaf in leaves:
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        leaf_mesh = getattr(sharding, "mesh", None)
        if leaf_mesh is None or getattr(leaf_mesh, "empty", True) or leaf_mesh.size == 1:
            specs.append(REPLICATED)
            continue
        if mesh is not None and leaf_mesh != mesh:
            return None
        mesh = leaf_mesh
        specs.append(getattr(sharding, "spec", None) or REPLICATED)
    return None if mesh is None else (mesh, specs)


def splits(spec: PartitionSpec) -> bool:
    """Whether `spec` shards anything (names a mesh axis)."""
    return any(_entry_axes(entry) for entry in spec)


def layout(
    consumer: str, axes: Axes, local_shape: Sequence[int], spec: PartitionSpec | None
) -> list[Any]:
    """`[global_shape, dims]` of one leaf: `dims[d]` lists the mesh axes splitting
    global dimension d (docs/PROTOCOL.md, "shard")."""
    sizes = dict(axes)
    if spec is None:  # pmap's layout: one new leading dimension per manual axis
        global_shape = [size for _, size in axes] + list(local_shape)
        dims = [[name] for name, _ in axes] + [[] for _ in local_shape]
        return [global_shape, dims]
    entries = list(spec)
    if len(entries) > len(local_shape):
        raise TapDefinitionError(
            f"tap {consumer!r}: spec {spec} has {len(entries)} entries but the tapped leaf "
            f"has only {len(local_shape)} dimensions"
        )
    entries += [None] * (len(local_shape) - len(entries))
    global_shape, dims = [], []
    for extent, entry in zip(local_shape, entries, strict=True):
        names = _entry_axes(entry)
        for name in names:
            if name not in sizes:
                raise TapDefinitionError(
                    f"tap {consumer!r}: spec {spec} names mesh axis {name!r}, but the tap "
                    f"runs under {sorted(sizes) or 'no per-device axes'} "
                    "(spec= is for taps inside shard_map or pmap)"
                )
        global_shape.append(extent * math.prod(sizes[name] for name in names))
        dims.append(names)
    return [global_shape, dims]


def _entry_axes(entry: Any) -> list[str]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return []
    if isinstance(entry, str):
        return [entry]
    return [str(name) for name in entry]
