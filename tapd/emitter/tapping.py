"""Taps inside JAX programs: what `tap` builds at trace time.

A tap is the identity on its argument. At trace time it flattens the argument into a
tree spec and leaves, checks every dtype can travel, records what is static (the site's
tree and metadata) and binds `tapd.emitter.primitive.tap_p` on the leaves; how that
primitive batches, differentiates, keeps order and lowers is said there and in
`tapd.emitter.lowering`. Inside `pmap`/`shard_map` (or a `jit` over an Explicit mesh,
which gets a `shard_map` here) every device taps its own block with its coordinates.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from tapd.consumers import MAX_NAME
from tapd.emitter import (
    jax_compat,
    lifecycle,
    loop_invariant,  # noqa: F401  (a tap of a loop-invariant value under grad of a scan)
    lowering,  # noqa: F401  (registers the rule)
    primitive,
    sharding,
)
from tapd.errors import TapDefinitionError
from tapd.protocol import flatten
from tapd.protocol.dtypes import dtype_name
from tapd.protocol.schema import check_static_size

logger = logging.getLogger("tapd.emitter")

_META_TYPES = (str, int, float, bool, type(None))
_MAX_CONSUMER_LENGTH = MAX_NAME
# Taps made for jax.debug calls (tapd.debug) follow jax.debug.callback where it differs
# from host_callback's taps: `jax.checkpoint` runs them again when it recomputes, and a
# batched while condition evaluates an unordered one twice an iteration. Set while tracing.
_as_jax_debug: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tapd_as_jax_debug", default=False
)


@contextlib.contextmanager
def as_jax_debug() -> Iterator[None]:
    """Taps emitted inside follow `jax.debug.callback`'s rules (see above)."""
    token = _as_jax_debug.set(True)
    try:
        yield
    finally:
        _as_jax_debug.reset(token)


# How a tap keeps order: True (program order inside one computation, tapd's own token),
# False (none), or "strict" (JAX's ordered effect: also between computations).
STRICT: Literal["strict"] = "strict"
Ordering = bool | Literal["strict"]
# Whether taps keep program order when `tap` is not told: None is the emitter setting
# (TAPD_ORDERED, default on). bench/dormant.py's probe (bench/run.py's section 4) sets it
# for one variant, to measure what the order costs. Read when a tap is traced.
ordered_taps: Ordering | None = None


def tap(
    arg: Any,
    name: str,
    *,
    step: Any = None,
    spec: PartitionSpec | None = None,
    ordered: Ordering | None = None,
    every: int = 1,
    **static_meta: Any,
) -> Any:
    """Send `arg` (any pytree of arrays) to the subscribers of consumer `name`; return it.

    `step` may be a traced integer. Inside `shard_map`/`pmap`, `spec` says how this
    device's block tiles the global value, as shard_map's `out_specs` would (default:
    blocks stacked along new leading axes, as pmap stacks them); one spec serves every
    leaf of `arg`; see `tapd.emitter.sharding`.

    `ordered` (default: TAPD_ORDERED, on) keeps the taps of one computation in program
    order, inside scan, cond and while bodies too, with a token that lives inside the
    XLA computation: the step keeps JAX's C++ dispatch path. `ordered="strict"` uses
    JAX's ordered effect instead, as `io_callback(ordered=True)` does: order also holds
    between computations and across `jax.effects_barrier()`, at JAX's per-call cost.
    `ordered=False` threads no token: XLA may run the tap before or after its
    neighbours, and the subscriber orders a site's records by `meta.seq`. Other
    keywords are static metadata (str, int, float, bool, None) handed to the handler in
    `meta.meta`.

    `every=K` copies only the executions whose `meta.seq` (which counts every execution
    of the site, per device) is a multiple of K; the others copy nothing and are counted
    as skipped in `tapd.stats()`. A site no subscriber takes is dormant: it copies nothing
    either, until one does (docs/PROTOCOL.md, "Dormant and sampled taps"; TAPD_DORMANT=0
    sends every tap).
    """
    _check_consumer(name)
    check_ordered(name, ordered)
    _check_every(name, every)
    return emit(name, arg, step, static_meta, spec, ordered=ordered, every=every)


def check_ordered(name: str, ordered: object) -> None:
    if ordered is not None and not isinstance(ordered, bool) and ordered != STRICT:
        raise TapDefinitionError(
            f"tap {name!r}: ordered={ordered!r} must be True, False or {STRICT!r}"
        )


def spans_devices(leaves: Sequence[Any]) -> bool:
    """Whether a tap of `leaves` traced here lands in a computation split over more than
    one device, whose taps tapd's order pass cannot place (`lowering`, `order`): inside
    `pmap`/`shard_map` over several devices, in a trace under a mesh of several devices
    (`jax.set_mesh`, a `with mesh:` block), or of a leaf sharded over several. A `jit`
    that the compiler partitions only from its `in_shardings` is not seen here."""
    for mesh in jax_compat.ambient_meshes():
        if _device_count(mesh) > 1:
            return True
    for leaf in leaves:
        try:
            leaf_sharding = getattr(jax.typeof(leaf), "sharding", None)
        except TypeError:  # not a JAX value (the protocol's own leaves: None, str...)
            continue
        if _device_count(getattr(leaf_sharding, "mesh", None)) > 1:
            return True
    return False


def _device_count(mesh: Any) -> int:
    if mesh is None or getattr(mesh, "empty", True):
        return 0
    size = getattr(mesh, "size", 0)
    return size if isinstance(size, int) else 0


_MAX_EVERY = 2**63 - 1  # the handler's attribute is an int64


def _check_every(name: str, every: object) -> None:
    if isinstance(every, bool) or not isinstance(every, int | np.integer):
        raise TapDefinitionError(f"tap {name!r}: every={every!r} must be an int >= 1")
    if not 1 <= int(every) <= _MAX_EVERY:
        raise TapDefinitionError(f"tap {name!r}: every={every!r} must be an int from 1 to 2**63-1")


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
    *,
    ordered: Ordering | None = None,
    every: int = 1,
    always: bool = False,
) -> Any:
    """Tap `arg` for `consumer`; returns `arg` as the tap's output (same tree), so that
    later uses of it come after the tap. `every`: the site's own sampling; `always`: the
    site is never made dormant nor thinned by the daemon (id_tap's, and every site where
    TAPD_DORMANT=0)."""
    jax_compat.require_supported()
    settings = lifecycle.settings()
    if ordered is None:
        ordered = settings.ordered if ordered_taps is None else ordered_taps
    for key, value in static_meta.items():
        if not isinstance(value, _META_TYPES):
            raise TapDefinitionError(
                f"tap {consumer!r}: metadata {key}={value!r} must be str, int, float, bool or "
                "None (it is static; pass arrays as part of the tapped value)"
            )
    tree, leaves = flatten(arg, custom=_describe_custom_node)
    arrays, rewrap = _tappable_leaves(consumer, leaves, static_meta)
    step_operand = None if step is None else jnp.asarray(step).astype(int)
    fields: dict[str, Any] = {"tree": tree, "meta": static_meta}
    # In the site entry (and, without a ring, each tap's header) only when not the default.
    if int(every) != 1:
        fields["every"] = int(every)
    if always or not settings.dormant:
        fields["always"] = True
    check_static_size(consumer, fields)  # what subscribers accept (tapd/protocol/schema.py)
    if sharding.manual_axes():
        tapped = _bind_per_device(
            consumer, fields, arrays, step_operand, [spec] * len(arrays), ordered=ordered
        )
    elif spec is not None:
        raise TapDefinitionError(
            f"tap {consumer!r}: spec= describes a block of a sharded value, so it applies "
            "inside shard_map or pmap only"
        )
    else:
        tapped = _bind_placed(consumer, fields, arrays, step_operand, ordered=ordered)
    return _rebuild(arg, leaves, [wrap(out) for wrap, out in zip(rewrap, tapped, strict=True)])


def _bind_placed(
    consumer: str, fields: dict[str, Any], arrays: list[Any], step: Any, *, ordered: Ordering
) -> list[Any]:
    """A tap outside shard_map/pmap. Over an Explicit mesh each shard is tapped where it
    lives; otherwise the whole value is tapped once (where the compiler partitions the
    jit, on the gathered value, as `jax.debug.callback` does)."""
    placed = sharding.trace_mesh(arrays)
    if placed is None or not any(map(sharding.splits, placed[1])):
        site = _site(consumer, fields, step is not None, has_coords=False, ordered=ordered)
        return primitive.bind(arrays, step, None, site)
    mesh, specs = placed
    operands = (tuple(arrays),) if step is None else (tuple(arrays), step)
    in_specs = (tuple(specs),) if step is None else (tuple(specs), sharding.REPLICATED)

    def per_shard(leaves: tuple[Any, ...], *step_local: Any) -> tuple[Any, ...]:
        step_value = step_local[0] if step_local else None
        return tuple(
            _bind_per_device(consumer, fields, list(leaves), step_value, specs, ordered=ordered)
        )

    out = jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=tuple(specs))(*operands)
    return list(out)


def _bind_per_device(
    consumer: str,
    fields: dict[str, Any],
    arrays: list[Any],
    step: Any,
    specs: Sequence[PartitionSpec | None],
    *,
    ordered: Ordering,
) -> list[Any]:
    """A tap inside pmap/shard_map: each device taps its block with its coordinates."""
    axes = sharding.manual_axes()
    layouts = [
        sharding.layout(consumer, axes, array.shape, spec)
        for array, spec in zip(arrays, specs, strict=True)
    ]
    shard = {
        "axes": [name for name, _ in axes],
        "sizes": [size for _, size in axes],
        "layout": layouts,
    }
    site = _site(
        consumer, {**fields, "shard": shard}, step is not None, has_coords=True, ordered=ordered
    )
    return primitive.bind(arrays, step, sharding.coordinates(axes), site)


def _site(
    consumer: str, fields: dict[str, Any], has_step: bool, *, has_coords: bool, ordered: Ordering
) -> primitive.TapSiteParams:
    return primitive.TapSiteParams(
        consumer=consumer,
        fields=primitive.pack_fields(fields),
        has_step=has_step,
        has_coords=has_coords,
        ordered=bool(ordered),
        strict=ordered == STRICT,
        like_jax_debug=_as_jax_debug.get(),
    )


def _tappable_leaves(
    consumer: str, leaves: Sequence[Any], static_meta: dict[str, Any]
) -> tuple[list[Any], list[Callable[[Any], Any]]]:
    """The leaves as arrays that can travel, and for each a function that turns the
    tap's output back into the leaf's type. A typed PRNG key travels as its key data
    (host_callback did the same, JAX #13949), its implementation in `meta["key_impl"]`."""
    arrays: list[Any] = []
    rewrap: list[Callable[[Any], Any]] = []
    for index, leaf in enumerate(leaves):
        try:
            array = jnp.asarray(leaf)
            if jnp.issubdtype(array.dtype, jax.dtypes.prng_key):
                impl = jax.random.key_impl(array)
                static_meta.setdefault("key_impl", str(impl))
                array = jax.random.key_data(array)
                rewrap.append(functools.partial(jax.random.wrap_key_data, impl=impl))
            else:
                rewrap.append(_unchanged)
            dtype_name(np.dtype(array.dtype))
        except (TypeError, ValueError) as exc:  # strings, object arrays, ...
            raise TapDefinitionError(
                f"tap {consumer!r}, leaf {index} ({type(leaf).__name__}): cannot be tapped: {exc}"
            ) from exc
        arrays.append(array)
    return arrays, rewrap


def _unchanged(value: Any) -> Any:
    return value


def _rebuild(arg: Any, leaves: Sequence[Any], tapped: Sequence[Any]) -> Any:
    """`arg` with each tapped leaf replaced by the tap's output for it."""
    position = {id(leaf): index for index, leaf in enumerate(leaves)}
    flat, treedef = jax.tree_util.tree_flatten(arg)
    if not all(id(leaf) in position for leaf in flat):  # a tree the protocol reads otherwise
        return arg
    return jax.tree_util.tree_unflatten(treedef, [tapped[position[id(leaf)]] for leaf in flat])
