"""Taps inside JAX programs, on the portable backend (`jax.debug.callback`).

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

import atexit
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from tapd.emitter import sharding
from tapd.emitter.native_backend import FFI_TARGET, NativeEmitter, register_ffi_target
from tapd.emitter.sender import Sender, TapSite
from tapd.emitter.settings import EmitterSettings, from_environment
from tapd.errors import ConfigError, TapDefinitionError
from tapd.native import library
from tapd.native.ring import RingError
from tapd.protocol import flatten
from tapd.protocol.dtypes import dtype_name
from tapd.runtime import ring_dir_for

logger = logging.getLogger("tapd.emitter")

PRINT_CONSUMER = "tapd.printing:print_tap"
_META_TYPES = (str, int, float, bool, type(None))
_MAX_CONSUMER_LENGTH = 256

_state_lock = threading.Lock()
_settings: EmitterSettings | None = None
_sender: Sender | None = None


# ---- configuration and the process-wide sender ---------------------------------------


def configure(**settings: Any) -> EmitterSettings:
    """Set the emitter's settings (endpoint, policy, buffer_bytes, exit_timeout) before
    the first tap runs. Unset ones come from `TAPD_*` variables, then defaults."""
    global _settings
    with _state_lock:
        if _sender is not None:
            raise RuntimeError("tapd.configure() must be called before the first tap runs")
        _settings = from_environment(**settings)
        return _settings


def _get_sender() -> Sender:
    global _sender, _settings
    if _sender is None:
        with _state_lock:
            if _sender is None:
                if _settings is None:
                    _settings = from_environment()
                _sender = Sender(
                    _settings,
                    process_index=jax.process_index(),
                    native=_native_emitter(_settings),
                )
                _register_exit_drain()
    return _sender


def _native_emitter(settings: EmitterSettings) -> NativeEmitter | None:
    """The native backend if settings allow and this process can use it, else None
    (saying why, once)."""
    if settings.backend == "portable":
        return None
    directory = ring_dir_for(settings.endpoint)
    reason = None
    if directory is None:
        reason = f"the daemon endpoint {settings.endpoint} is not a local ipc:// socket"
    elif jax.default_backend() != "cpu":
        reason = f"the native handler is CPU-only so far (JAX backend {jax.default_backend()})"
    elif not register_ffi_target():
        reason = library.unavailable_reason()
    if reason is None and directory is not None:
        try:
            return NativeEmitter(directory, settings.buffer_bytes, settings.policy)
        except (RingError, OSError) as exc:
            reason = str(exc)
    if settings.backend == "native":
        raise ConfigError(f"backend 'native' was asked for but cannot be used: {reason}")
    logger.warning(
        "tapd: using the portable backend (jax.debug.callback, ~100+ us per tap); "
        "the native one is unavailable: %s",
        reason,
    )
    return None


def backend() -> str:
    """The backend this process's taps use ("native" or "portable")."""
    return "native" if _get_sender().native is not None else "portable"


def stats() -> dict[str, int]:
    """This process's tap counters (zeros before the first tap)."""
    return _sender.stats() if _sender is not None else {}


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = 60.0) -> None:
    """Block until every tap emitted so far has been processed by every subscribed
    handler. Raises `TapFunctionException` if handlers raised, `BarrierTimeout` if not
    done within `timeout` seconds."""
    jax.effects_barrier()  # type: ignore[no-untyped-call]  # callbacks of dispatched computations have run
    if _sender is None:
        return
    reply = _sender.barrier(timeout)
    if logging_name:
        logger.info("barrier %s passed: %s", logging_name, reply)


def _register_exit_drain() -> None:
    # threading's exit hooks run when the main thread ends, before `atexit` handlers:
    # pyzmq's zero-copy machinery and JAX's backends are both still alive then.
    # (concurrent.futures relies on the same hook.)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_drain_at_exit)
    else:
        atexit.register(_drain_at_exit)


def _drain_at_exit() -> None:
    sender = _sender
    if sender is None or _settings is None:
        return
    try:
        jax.effects_barrier()  # type: ignore[no-untyped-call]
    except Exception:  # JAX may be half torn down at exit; drain what we have
        pass
    try:
        if not sender.all_confirmed():
            sender.barrier(_settings.exit_timeout)
    except Exception as exc:
        logger.error("tapd: at exit, not every tap was delivered: %s", exc)
    counts = sender.stats()
    sender.close(timeout=2.0)
    if sender.native is not None and sender.all_confirmed():
        sender.native.remove_files()  # all delivered; otherwise a daemon drains it later
    undelivered = counts["sent"] - counts["delivered"] - counts["unrouted"]
    if counts["dropped"] or counts["daemon_dropped"] or undelivered > 0:
        logger.error("tapd at exit: %s", counts)


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
    _emit(name, arg, step, static_meta, spec)
    return arg


def id_tap(
    tap_func: Callable[..., Any],
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
) -> Any:
    """host_callback's `id_tap`: `tap_func(arg, transforms)` runs in a subscriber
    (`tapd subscribe MODULE`); returns `result` if given, else `arg`."""
    consumer = consumer_name(tap_func)
    _emit(consumer, arg, None, {"tap_with_device": True} if tap_with_device else {})
    return arg if result is None else result


def id_print(arg: Any, *, result: Any = None, what: str | None = None, **kwargs: Any) -> Any:
    """host_callback's `id_print`: printed by a subscriber of `tapd.printing`
    (`tapd subscribe tapd.printing`, or `tapd tail`)."""
    _emit(PRINT_CONSUMER, arg, None, {"what": what, **kwargs})
    return arg if result is None else result


def consumer_name(tap_func: Callable[..., Any]) -> str:
    """`module:qualname` of an importable function; TapDefinitionError otherwise."""
    module = getattr(tap_func, "__module__", None)
    qualname = getattr(tap_func, "__qualname__", None)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
        shown = qualname or repr(tap_func)
        raise TapDefinitionError(
            f"id_tap({shown}): tapd runs tap functions in a subscriber process, which finds "
            "them by their import path 'module:qualname'; a lambda, closure or callable "
            "object has none. Define the function at the top level of a module "
            "(`def log_loss(arg, transforms): ...`, then `tapd subscribe mymodule`), or use "
            "`tapd.tap(x, 'name')` with a `@subscriber.on('name')` handler."
        )
    return f"{module}:{qualname}"


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


def _emit(
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
    native = _get_sender().native is not None
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
        _get_sender().submit(site, copies, step=step_value, device=None, coords=shard_coords)

    @jax.custom_batching.custom_vmap
    def batched(leaves: tuple[Any, ...], step: Any, coords: Any) -> tuple[Any, ...]:
        native = _get_sender().native
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
