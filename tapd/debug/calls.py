"""`tapd.debug.callback` and `tapd.debug.print`: `jax.debug`'s calls, made off the step.

Each call is checked as `jax.debug` checks it (JAX's own checks where JAX has them as
functions: the format check, the split into static and dynamic arguments), then its
dynamic arguments are tapped (`tapd.emitter.tapping.emit`) for a local tap function of
its own, a `tapd.debug.delivery.Delivery`, which makes `jax.debug`'s calls on tapd's
receiver thread in this process. The step does not wait for them; `tapd.barrier_wait()`
(or `jax.effects_barrier()` after `install_debug()`) does.

Where the tap cannot give what `jax.debug` gives, the call goes to JAX's own function
(synchronously, as JAX runs it):

- `blocking=True`, asked for: a callback that must have run before the step goes on;
- `partitioned=True` where the compiler decides the sharding (a `jit` over several
  devices whose mesh axes are not Explicit): `jax.debug` then runs the callback on each
  device's shard, which only the compiler knows; a tap cannot know it while tracing.

Elsewhere `partitioned=True` is served by the tap: inside `pmap`/`shard_map` every device
taps its own block either way, and over an Explicit mesh each shard is tapped where it
lives. `partitioned=False` over an Explicit mesh gathers the value first, as JAX does,
so the callback runs once, on the whole value.

A call run eagerly (outside `jit`, through `grad` or `vmap` too) is one JAX makes at
once, and its caller gets what the callback raised; there is no step to keep going. It
is tapped too, so that it keeps its place after the calls of computations still
running, and then waited for (what it raised is raised here). Such a call travels as a
ticket, so that they share one compiled tap instead of compiling one each.
"""

from __future__ import annotations

import logging
import os
import string
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import callback as _jax_callback_module
from jax._src import core, source_info_util
from jax._src import debugging as _jax_debugging
from jax._src.interpreters import ad, batching

from tapd.debug import delivery
from tapd.emitter import jax_compat, lifecycle, sharding, tapping
from tapd.emitter.local.threads import on_receiver_thread
from tapd.errors import TapDefinitionError

# JAX's own functions, as they were when tapd.debug was first imported (before
# `install_debug()` replaced them): what `blocking=True` calls.
jax_callback: Callable[..., Any] = _jax_debugging.debug_callback
jax_print: Callable[..., Any] = _jax_debugging.debug_print
jax_log: Callable[..., Any] | None = getattr(_jax_debugging, "debug_log", None)
jax_io_callback: Callable[..., Any] = _jax_callback_module.io_callback

# JAX's own checks, as jax.debug makes them (untyped internals, given types here).
split_arguments: Callable[..., tuple[Any, list[Any], dict[int, Any]]] = (
    _jax_debugging._split_callback_args
)
_abstractify: Callable[[Any], Any] = core.shaped_abstractify
_reshard: Callable[[Any, Any], Any] = jax.sharding.reshard

_eager = delivery.EagerDeliveries()
EAGER_TIMEOUT = 60.0  # s a call outside jit waits for tapd's receiver to have run it

# The caller of jax.debug.log is the user's frame that its record names, not tapd.debug's.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)) + os.sep)


def debug_callback(
    callback: Callable[..., None] | None = None,
    *args: Any,
    ordered: bool = False,
    partitioned: bool = False,
    blocking: bool = False,
    **kwargs: Any,
) -> Callable[..., None] | None:
    """`jax.debug.callback`, run off the step on tapd's receiver thread in this process.

    Same calls, values and counts as `jax.debug.callback` under `jit`, `vmap`, `grad`,
    `scan`, `cond`, `while_loop`, `pmap`, `shard_map` and sharded `jit`; both call forms
    (`callback(f, *args, ordered=...)` and `callback(ordered=...)(f, *args)`).
    `blocking=True` calls `jax.debug.callback` itself, which runs `f` before the step
    goes on."""

    def call(function: Callable[..., None], *c_args: Any, **c_kwargs: Any) -> None:
        def synchronous() -> None:
            jax_callback(function, *c_args, ordered=ordered, partitioned=partitioned, **c_kwargs)

        if blocking:
            synchronous()
            return
        if not callable(function):
            raise TypeError(
                "first argument to jax.debug.callback must be callable, "
                f"but got an object of type {type(function)}"
            )
        in_tree, dynamic, static = split_arguments(c_args, c_kwargs)
        site = delivery.CallbackSite(function, in_tree, static)
        dispatch(site, dynamic, ordered=ordered, partitioned=partitioned, synchronous=synchronous)

    return _now_or_later("debug_callback", call, callback, args, kwargs)


def debug_print(
    fmt: str | None = None,
    *args: Any,
    ordered: bool = False,
    partitioned: bool = False,
    skip_format_check: bool = False,
    blocking: bool = False,
    _use_logging: bool = False,
    **kwargs: Any,
) -> Callable[..., None] | None:
    """`jax.debug.print`, printed off the step by tapd's receiver thread, to this
    process's `sys.stdout`, in program order; the same text as `jax.debug.print`.
    `blocking=True` calls `jax.debug.print` itself."""

    def call(c_fmt: str, *c_args: Any, **c_kwargs: Any) -> None:
        options: dict[str, Any] = {"_use_logging": True} if _use_logging else {}

        def synchronous() -> None:
            jax_print(
                c_fmt,
                *c_args,
                ordered=ordered,
                partitioned=partitioned,
                skip_format_check=skip_format_check,
                **options,
                **c_kwargs,
            )

        if blocking:
            synchronous()
            return
        if not skip_format_check:
            _jax_debugging.formatter.format(c_fmt, *c_args, **c_kwargs)
        has_placeholders = False
        if c_fmt:
            _, field_name, *_ = next(iter(string.Formatter().parse(c_fmt)))
            has_placeholders = field_name is not None
        in_tree, dynamic, static = split_arguments(c_args, c_kwargs)
        site = delivery.PrintSite(
            c_fmt,
            dict(np.get_printoptions()),
            has_placeholders,
            _logging_record() if _use_logging else None,
            in_tree,
            static,
        )
        dispatch(site, dynamic, ordered=ordered, partitioned=partitioned, synchronous=synchronous)

    return _now_or_later("debug_print", call, fmt, args, kwargs)


def debug_log(fmt: str | None = None, *args: Any, **kwargs: Any) -> Callable[..., None] | None:
    """`jax.debug.log` (jax 0.9 and later): `debug_print` to the `jax._src.debugging`
    logger, at INFO, with the caller's file and line, off the step."""
    return debug_print(fmt, *args, _use_logging=True, **kwargs)


def _now_or_later(
    name: str,
    call: Callable[..., None],
    first: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Callable[..., None] | None:
    """JAX's two call forms: with its first argument, the call is made now; without,
    (options only) the call is returned, to be made with the arguments."""
    if first is not None:
        call(first, *args, **kwargs)
        return None
    if args or kwargs:
        raise TypeError(
            f"{name} received unexpected arguments in the two-call form: {args=} {kwargs=}"
        )
    return call


def _logging_record() -> logging.LogRecord:
    make = getattr(_jax_debugging, "_make_logging_record", None)
    if make is not None:
        record: logging.LogRecord = make(logging.INFO)
        return record
    logger = logging.getLogger("jax._src.debugging")  # a JAX before jax.debug.log
    return logger.makeRecord(logger.name, logging.INFO, "(unknown file)", 0, "", (), None)


# ---- from a call to a tap ----------------------------------------------------------------


def dispatch(
    site: delivery.Site,
    dynamic: list[Any],
    *,
    ordered: bool,
    partitioned: bool,
    synchronous: Callable[[], None],
) -> None:
    """Tap `dynamic` for `site`, or call `synchronous` where only JAX can do what it does
    (see the module docstring)."""
    jax_compat.require_supported()
    if not _receiver_here():
        synchronous()
        return
    if not _staged(dynamic):  # JAX runs it now, and raises what it raised
        if on_receiver_thread():
            synchronous()  # a callback's own call: the receiver cannot wait for itself
            return
        leaves, types = _travelling(dynamic, eager=True)
        call = delivery.EagerCall(site, types)
        ticket = jnp.asarray(_eager.ticket(call), dtype=jnp.int32)
        _tap(_eager, [ticket, *leaves], ordered=ordered)
        call.wait(EAGER_TIMEOUT)
        return
    if partitioned and _compiler_decides_shards(dynamic):
        synchronous()
        return
    if ordered:
        _refuse_ordered_on_devices()
    leaves, types = _travelling(dynamic, eager=False)
    if not partitioned:
        leaves = _gathered(leaves)
    _tap(delivery.Delivery(site, types), leaves, ordered=ordered)


def _refuse_ordered_on_devices() -> None:
    """JAX's refusal of an ordered callback that runs per device (pmap, shard_map), with
    its type and words (JAX says it when compiling; the caller sees it at the same call)."""
    devices = 1
    for _, size in sharding.manual_axes():
        devices *= size
    if devices > 1:
        effect = getattr(_jax_debugging, "ordered_debug_effect", "OrderedDebugEffect")
        raise ValueError(
            f"The following ordered effects are not supported for more than 1 device: {[effect]}"
        )


def _receiver_here() -> bool:
    """Whether tapd's receiver runs callbacks in this process. Without a daemon to feed
    it (none answers, and none could be started), tapd.debug makes jax.debug's own calls
    instead, saying so once, rather than fail the programs and libraries that call it."""
    if _unavailable:
        return False
    if lifecycle.local_path() is not None:
        return True  # the local ring's receiver: no daemon needed
    try:
        lifecycle.fallback_receiver()
    except TapDefinitionError as exc:
        _unavailable.append(str(exc))
        logger.warning("tapd.debug makes jax.debug's own (synchronous) calls: %s", exc)
        return False
    return True


_unavailable: list[str] = []  # why not, once known
logger = logging.getLogger("tapd.debug")


def _tap(function: Callable[..., None], leaves: list[Any], *, ordered: bool) -> None:
    value = tuple(leaves)
    treedef = jax.tree_util.tree_structure(value)
    consumer = lifecycle.local_consumer(function, treedef)
    with tapping.as_jax_debug():
        tapping.emit(consumer, value, None, {}, ordered=ordered, always=True)


def _travelling(dynamic: list[Any], *, eager: bool) -> tuple[list[Any], delivery.LeafTypes]:
    """The leaves as the tap carries them (a typed PRNG key as its key data), and what
    of their types the receiver gives back. A call run eagerly gets the values as they
    were (typed keys, weak types), as `jax.debug` hands them on; a staged one gets what
    the computation's buffers hold (key data, no weak type), as JAX's does."""
    leaves: list[Any] = []
    key_impls: dict[int, Any] = {}
    weak: set[int] = set()
    for index, leaf in enumerate(dynamic):
        aval = _abstractify(leaf)
        if jnp.issubdtype(aval.dtype, jax.dtypes.prng_key):
            key_impls[index] = jax.random.key_impl(leaf)
            leaf = jax.random.key_data(leaf)
        elif getattr(aval, "weak_type", False):
            weak.add(index)
        leaves.append(leaf)
    if not eager:
        return leaves, delivery.LeafTypes()
    return leaves, delivery.LeafTypes(key_impls, frozenset(weak))


def _staged(dynamic: list[Any]) -> bool:
    """Whether this call is staged into a computation (jit, scan, a linear function...),
    rather than run eagerly, at the top level or through `grad`, `jvp` or `vmap` outside
    `jit`: whether the traces it runs under (or its arguments come from) are anything but
    those. (An eager call is waited for: a trace not known to run it now counts as
    staged, so that nothing waits for a call that may never come.)"""
    traces = [core.trace_ctx.trace]
    traces += [leaf._trace for leaf in dynamic if isinstance(leaf, core.Tracer)]
    for trace in traces:
        while trace is not None:
            if not isinstance(trace, _EAGER_TRACES):
                return True
            trace = getattr(trace, "parent_trace", None)
    return False


_EAGER_TRACES = tuple(
    kind
    for kind in (
        core.EvalTrace,
        getattr(ad, "JVPTrace", None),
        getattr(ad, "LinearizeTrace", None),
        getattr(batching, "BatchTrace", None),
    )
    if isinstance(kind, type)
)


def _compiler_decides_shards(leaves: list[Any]) -> bool:
    """Whether a `partitioned=True` callback here runs per shard of a sharding only the
    compiler knows: in a trace over several devices, outside pmap/shard_map, without an
    Explicit mesh that splits the leaves."""
    if sharding.manual_axes() or jax.device_count() == 1:
        return False
    placed = sharding.trace_mesh(leaves)
    return placed is None or not any(map(sharding.splits, placed[1]))


def _gathered(leaves: list[Any]) -> list[Any]:
    """Leaves split over an Explicit mesh, made whole (replicated) as JAX gathers them for
    a callback that is not partitioned; others as they are."""
    if sharding.manual_axes():
        return leaves
    placed = sharding.trace_mesh(leaves)
    if placed is None:
        return leaves
    mesh, specs = placed
    return [
        _reshard(leaf, jax.sharding.NamedSharding(mesh, sharding.REPLICATED))
        if sharding.splits(spec)
        else leaf
        for leaf, spec in zip(leaves, specs, strict=True)
    ]
