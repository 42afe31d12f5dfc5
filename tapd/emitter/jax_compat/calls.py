"""The JAX internals tapd calls whose signatures changed within its range, each behind a
function that tells the versions apart by the signature itself (`inspect`), not by a
version number:

| internal                            | change                                    | since  |
|-------------------------------------|-------------------------------------------|--------|
| `mlir.register_lowering`            | `cacheable=` keyword                      | 0.7.0  |
| `callback.emit_python_callback`     | `returns_token=` keyword                  | 0.8.2  |
| `mlir.set_sharding`                 | takes the module context first (3 args)   | 0.10.1 |
| `jax.sharding.SingleDeviceSharding` | deprecated: `make_single_device_sharding` | 0.12.1 |

and the other questions tapd asks of JAX's internals: whether this thread traces or runs
inside one of JAX's host callbacks, the meshes a trace runs under, `jax.export`'s set of
stable custom-call targets (`export_targets_stable`), and the workaround for one JAX bug
(`tap_effects`, docs/UPSTREAM.md). `SEAMS` (tapd.emitter.jax_compat.versions) checks
these calls' signatures. Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
import sys
from typing import Any


@functools.cache
def _accepts(function: Any, keyword: str) -> bool:
    import inspect

    return keyword in inspect.signature(function).parameters


@functools.cache
def _arity(function: Any) -> int:
    import inspect

    return len(inspect.signature(function).parameters)


# ---- the calls whose signatures changed ----------------------------------------------


def register_lowering(primitive: Any, rule: Any) -> None:
    """`mlir.register_lowering`, not cacheable: a tap's lowering registers its site
    (and reads this process's backend), so it must run for every lowering."""
    from jax._src.interpreters import mlir

    if _accepts(mlir.register_lowering, "cacheable"):
        mlir.register_lowering(primitive, rule, cacheable=False)
    else:  # before 0.7.0 every lowering ran afresh
        mlir.register_lowering(primitive, rule)


def emit_python_callback(
    ctx: Any,
    callback: Any,
    token: Any,
    operands: list[Any],
    operand_avals: list[Any],
    *,
    returns_token: bool,
    sharding: Any,
) -> Any:
    """A side-effecting host callback with no results, threading `token` (if not None);
    returns the new token (None without one). `returns_token=False` (an unordered tap)
    lets a TPU go on without waiting for the host; JAX before 0.8.2 always waited."""
    _, new_token = _emit_callback(
        ctx, callback, token, operands, operand_avals, [], returns_token, sharding
    )
    return new_token


def emit_python_callback_with_result(
    ctx: Any,
    callback: Any,
    token: Any,
    operands: list[Any],
    operand_avals: list[Any],
    result_aval: Any,
    *,
    sharding: Any,
) -> tuple[Any, Any]:
    """A side-effecting host callback with one result, threading `token` (if not None);
    returns (the result, the new token). The computation waits for it (a result), so
    the token is returned where this JAX can say so."""
    results, new_token = _emit_callback(
        ctx, callback, token, operands, operand_avals, [result_aval], True, sharding
    )
    return results[0], new_token


def _emit_callback(
    ctx: Any,
    callback: Any,
    token: Any,
    operands: list[Any],
    operand_avals: list[Any],
    result_avals: list[Any],
    returns_token: bool,
    sharding: Any,
) -> tuple[Any, Any]:
    from jax._src import callback as jax_callback

    emit = jax_callback.emit_python_callback
    extra = {"returns_token": returns_token} if _accepts(emit, "returns_token") else {}
    results, new_token, _ = emit(
        ctx,
        callback,
        token,
        operands,
        operand_avals,
        result_avals,
        has_side_effect=True,
        sharding=sharding,
        **extra,
    )
    return results, new_token


def callback_op_sharding(axis_context: Any, device_sharding: Any) -> Any:
    """The op sharding JAX gives a callback with no results in `axis_context`."""
    from jax._src import callback as jax_callback

    return jax_callback._callback_op_sharding(axis_context, device_sharding, [])


def set_sharding(module_context: Any, op: Any, sharding: Any) -> None:
    """`mlir.set_sharding`: (ctx, op, sharding) since 0.10.1, (op, sharding) before."""
    from jax._src.interpreters import mlir

    if _arity(mlir.set_sharding) >= 3:
        mlir.set_sharding(module_context, op, sharding)
    else:
        mlir.set_sharding(op, sharding)  # type: ignore[call-arg]


def single_device_sharding(device: Any) -> Any:
    """The sharding that places a value on `device`: `make_single_device_sharding` where
    this jax has it (0.10 does; 0.12.1 deprecates the class, a warning that is an error
    under `-W error`), else the `SingleDeviceSharding` class (0.8.0 has only that)."""
    import jax.sharding

    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is not None:
        return make(device)
    return jax.sharding.SingleDeviceSharding(device)


# ---- the AOT fast path (docs/UPSTREAM.md) -------------------------------------------


def tap_effects(effect: Any, unordered: Any) -> set[Any]:
    """The effects of a tap whose own effect is `effect`: an ordered tap also carries
    the unordered `unordered`, so that an AOT executable never takes the C++ fast path
    that drops its token (see the module docstring)."""
    return {effect, unordered}


# ---- what JAX is doing now, and its other internals ---------------------------------


def tracing() -> bool:
    """Whether JAX is tracing on this thread (a `print` in a jitted function's body):
    nothing may be dispatched, nor waited for, from there."""
    from jax._src import core

    clean = getattr(core, "trace_state_clean", None)
    return clean is not None and not clean()


# The frames of JAX's own host callbacks: the trampoline XLA calls (jax/_src/callback.py
# since jax 0.4.3x), and jax.debug's implementation it calls.
_HOST_CALLBACK_FRAMES = frozenset({"_wrapped_callback", "debug_callback_impl"})


def in_host_callback() -> bool:
    """Whether the caller runs inside one of JAX's own host callbacks (a computation
    waits for it to return: nothing there may wait for the devices)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _HOST_CALLBACK_FRAMES and "jax" in frame.f_code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def export_targets_stable(*targets: str) -> None:
    """Let `jax.export` serialize custom calls of `targets` (see the module docstring)."""
    try:
        from jax._src.export import _export
    except ImportError:  # pragma: no cover (every supported JAX has it)
        return
    stable = getattr(_export, "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE", None)
    if isinstance(stable, set):
        stable.update(targets)


def lowering_for_export(ctx: Any) -> bool:
    """Whether this lowering is `jax.export`'s (its `lowering_parameters.for_export`)."""
    parameters = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(parameters, "for_export", False))


def ambient_meshes() -> list[Any]:
    """The meshes a trace runs under: the abstract one (the manual axes of pmap and
    shard_map, `jax.set_mesh`) and the concrete ones (`jax.set_mesh`, `with mesh:`);
    any of them may be empty or None."""
    found: list[Any] = []
    from jax._src import mesh as mesh_lib

    for get in ("get_abstract_mesh", "get_concrete_mesh"):
        try:
            found.append(getattr(mesh_lib, get)())
        except (AttributeError, TypeError):
            continue
    resources = getattr(getattr(mesh_lib, "thread_resources", None), "env", None)
    found.append(getattr(resources, "physical_mesh", None))
    return found


def outside_any_mesh() -> Any:
    """A context in which no mesh is set (`jax.set_mesh` of JAX's empty mesh): a
    single-device computation of tapd's own runs there whatever mesh the caller set."""
    import contextlib

    import jax
    from jax._src import mesh as mesh_lib

    empty = getattr(mesh_lib, "empty_concrete_mesh", None)
    set_mesh = getattr(jax, "set_mesh", None)
    if empty is None or set_mesh is None:
        return contextlib.nullcontext()
    return set_mesh(empty)
