"""Taps inside JAX programs: what `tap` builds at trace time.

A tap is the identity on its argument. At trace time it flattens the argument into a
tree spec and leaves, checks every dtype can travel, and records what is static (the
`TapSite`). At run time the callback copies the leaves and hands them to the `Sender`,
which returns at once while there is buffer space.

Batching: the tap is a `custom_vmap`, so `vmap` makes one tap per batched call carrying
`("batch", {"batch_dims": ...})` in its transforms, as host_callback reported; nested
vmaps stack entries. Differentiation: the tap is a `custom_jvp` whose rule taps the
primal value only, so gradients pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from tapd.emitter import lifecycle, sharding
from tapd.emitter.native_backend import FFI_TARGET, NativeEmitter
from tapd.emitter.sender import TapSite
from tapd.errors import TapDefinitionError
from tapd.protocol import flatten
from tapd.protocol.dtypes import dtype_name

logger = logging.getLogger("tapd.emitter")

_META_TYPES = (str, int, float, bool, type(None))
_MAX_CONSUMER_LENGTH = 256


# ---- the taps ------------------------------------------------------------------------


def tap(
    arg: Any, name: str, *, step: Any = None, spec: PartitionSpec | None = None, **static_meta: Any
) -> Any:
    """Send `arg` (any pytree of arrays) to the subscribers of consumer `name`; return it.

    `step` may be a traced integer. Inside `shard_map`/`pmap`, `spec` says how this
    device's block tiles the global value, as shard_map's `out_specs` would (default:
    blocks stacked along new leading axes, as pmap stacks them); one spec serves every
    leaf of `arg`; see `tapd.emitter.sharding`. Other keywords are static metadata (str, int, float,
    bool, None) handed to the handler in `meta.meta`.
    """
    _check_consumer(name)
    emit(name, arg, step, static_meta, spec)
    return arg


def _check_consumer(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > _MAX_CONSUMER_LENGTH:
        raise TapDefinitionError(
            f"tap name {name!r} must be a non-empty str of at most {_MAX_CONSUMER_LENGTH} chars"
        )


def _describe_custom_node(node: Any) -> tuple[str, list[str], list[Any]] | None:
    """Tree hook: a registered pytree node other than the protocol's containers."""
    leaves_with_paths, _ = jax.tree_util.tree_flatten_with_path(node)
    if len(leaves_with_paths) == 1 and leaves_with_paths[0][1] is node:
        return None  # a leaf
    paths = [jax.tree_util.keystr(path) for path, _ in leaves_with_paths]
    return type(node).__name__, paths, [leaf for _, leaf in leaves_with_paths]


def emit(
    consumer: str,
    arg: Any,
    step: Any,
    static_meta: dict[str, Any],
    spec: PartitionSpec | None = None,
) -> None:
    for key, value in static_meta.items():
        if not isinstance(value, _META_TYPES):
            raise TapDefinitionError(
                f"tap {consumer!r}: metadata {key}={value!r} must be str, int, float, bool or "
                "None (it is static; pass arrays as part of the tapped value)"
            )
    tree, leaves = flatten(arg, custom=_describe_custom_node)
    arrays = []
    for index, leaf in enumerate(leaves):
        try:
            array = jnp.asarray(leaf)
            dtype_name(np.dtype(array.dtype))
        except (TypeError, ValueError) as exc:  # PRNG keys, strings, object arrays...
            raise TapDefinitionError(
                f"tap {consumer!r}, leaf {index} ({type(leaf).__name__}): cannot be tapped: {exc}"
            ) from exc
        arrays.append(array)
    step_operand = None if step is None else jnp.asarray(step).astype(int)
    fields = {"tree": tree, "meta": static_meta}
    if sharding.manual_axes():
        _emit_per_device(consumer, fields, arrays, step_operand, [spec] * len(arrays))
        return
    if spec is not None:
        raise TapDefinitionError(
            f"tap {consumer!r}: spec= describes a block of a sharded value, so it applies "
            "inside shard_map or pmap only"
        )
    placed = sharding.trace_mesh(arrays)
    native = lifecycle.get_sender().native is not None
    if placed is None or not (native or any(map(sharding.splits, placed[1]))):
        _tap_fn(consumer, fields, ())(tuple(arrays), step_operand, None)  # the whole value
        return
    mesh, specs = placed
    operands = (tuple(arrays),) if step_operand is None else (tuple(arrays), step_operand)
    in_specs = (tuple(specs),) if step_operand is None else (tuple(specs), sharding.REPLICATED)
    if any(map(sharding.splits, specs)):  # jit over an Explicit mesh: tap each shard

        def per_shard(leaves: tuple[Any, ...], *step_local: Any) -> tuple[()]:
            step_value = step_local[0] if step_local else None
            _emit_per_device(consumer, fields, list(leaves), step_value, specs)
            return ()

        jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=())(*operands)
        return

    # The compiler shards it (Auto axes): XLA cannot place a native tap there itself, so
    # gather the value onto every device and tap it on the first, as debug.callback does.
    def on_first_device(leaves: tuple[Any, ...], *step_local: Any) -> tuple[()]:
        first = jnp.all(sharding.coordinates(sharding.manual_axes()) == 0)
        step_value = step_local[0] if step_local else None
        tap_once = _tap_fn(consumer, fields, ())

        def tap_here() -> None:
            tap_once(leaves, step_value, None)

        lax.cond(first, tap_here, lambda: None)
        return ()

    jax.shard_map(on_first_device, mesh=mesh, in_specs=in_specs, out_specs=())(*operands)


def _emit_per_device(
    consumer: str,
    fields: dict[str, Any],
    arrays: list[Any],
    step: Any,
    specs: Sequence[PartitionSpec | None],
) -> None:
    """A tap inside pmap/shard_map: each device taps its block with its coordinates."""
    axes = sharding.manual_axes()
    layouts = [
        sharding.layout(consumer, axes, array.shape, spec)
        for array, spec in zip(arrays, specs, strict=True)
    ]
    shard = {"axes": [name for name, _ in axes], "sizes": [size for _, size in axes],
             "layout": layouts}  # fmt: skip
    coords = sharding.coordinates(axes)
    _tap_fn(consumer, {**fields, "shard": shard}, ())(tuple(arrays), step, coords)


def _native_tap(
    native: NativeEmitter, site: TapSite, leaves: Sequence[Any], step: Any, coords: Any
) -> None:
    """Emit the FFI call; XLA runs the C++ handler, which writes to the ring. Shard
    coordinates travel as one more leaf, which the daemon takes off (site "shard")."""
    tapped = [*leaves] if coords is None else [*leaves, coords]
    described = [
        [dtype_name(np.dtype(leaf.dtype)), list(leaf.shape),
         int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize]
        for leaf in tapped
    ]  # fmt: skip
    site_id = native.register_site(site.consumer, dict(site.fields), described)
    operands = tapped if step is None else [*tapped, step]
    jax.ffi.ffi_call(FFI_TARGET, (), has_side_effect=True)(
        *operands,
        site=np.int64(site_id),
        consumer=np.int64(native.consumer_id(site.consumer)),
        has_step=np.int64(step is not None),
    )


def _tap_fn(
    consumer: str, site_fields: dict[str, Any], transforms: tuple[Any, ...]
) -> Callable[..., Any]:
    """The identity on (leaves, step, coords) with the tap as its side effect; batches
    and differentiates as the module docstring says."""
    site = TapSite(consumer, {**site_fields, "transforms": [list(t) for t in transforms]})

    def callback(leaves: Sequence[Any], step: Any, coords: Any) -> None:
        # Runs on an XLA thread: copy now (XLA may reuse the buffers), no JAX calls.
        copies = [np.array(leaf, copy=True) for leaf in leaves]
        step_value = None if step is None else int(np.ravel(np.asarray(step))[0])
        shard_coords = None if coords is None else [int(c) for c in np.asarray(coords)]
        lifecycle.get_sender().submit(
            site, copies, step=step_value, device=None, coords=shard_coords
        )

    @jax.custom_batching.custom_vmap
    def batched(leaves: tuple[Any, ...], step: Any, coords: Any) -> tuple[Any, ...]:
        native = lifecycle.get_sender().native
        if native is None:
            jax.debug.callback(callback, leaves, step, coords)
        else:
            _native_tap(native, site, leaves, step, coords)
        return leaves

    @batched.def_vmap
    def _batch_rule(
        axis_size: int, in_batched: Sequence[Any], leaves: tuple[Any, ...], step: Any, coords: Any
    ) -> tuple[tuple[Any, ...], Any]:
        leaves_batched = tuple(in_batched[0])
        if in_batched[2]:  # coordinates come from lax.axis_index, which vmap never batches
            raise TapDefinitionError(f"tap {consumer!r}: batched shard coordinates")
        entry = ("batch", {"batch_dims": [0 if b else None for b in leaves_batched]})
        fields = site_fields
        if "shard" in fields:  # a batched leaf's block and global value gain the batch dim
            shard = fields["shard"]
            layouts = [
                [[axis_size, *shape], [[], *dims]] if b else [shape, dims]
                for (shape, dims), b in zip(shard["layout"], leaves_batched, strict=True)
            ]
            fields = {**fields, "shard": {**shard, "layout": layouts}}
        inner = _tap_fn(consumer, fields, (*transforms, entry))
        return inner(leaves, step, coords), leaves_batched

    @jax.custom_jvp
    def differentiable(leaves: tuple[Any, ...], step: Any, coords: Any) -> tuple[Any, ...]:
        return batched(leaves, step, coords)  # type: ignore[no-any-return]

    @differentiable.defjvp
    def _jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
        leaves, step, coords = primals
        return differentiable(leaves, step, coords), tangents[0]

    return differentiable
