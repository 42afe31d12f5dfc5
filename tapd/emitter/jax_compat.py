"""Every JAX version difference tapd deals with, in one place.

tapd lowers its tap with JAX internals (`jax._src`), whose signatures change between
releases. Each call whose signature changed within tapd's range goes through a function
here, which tells the versions apart by the signature itself (`inspect`), not by a
version number:

| internal                         | change                                    | since  |
|----------------------------------|-------------------------------------------|--------|
| `mlir.register_lowering`         | `cacheable=` keyword                      | 0.7.0  |
| `callback.emit_python_callback`  | `returns_token=` keyword                  | 0.8.2  |
| `mlir.set_sharding`              | takes the module context first (3 args)   | 0.10.1 |

One difference is in C++ instead: jaxlib 0.8 passes an ordered tap's token result to
the FFI handler, where 0.10 does not, so the handlers bind `RemainingRets()`
(tapd/native/ffi_cpu.cc, ffi_cuda.cc).

It also holds the workaround for one JAX bug (docs/UPSTREAM.md): an executable
compiled ahead of time (`jax.jit(f).lower(x).compile()`) takes a C++ fast path from its
second call on, which is turned off for host callbacks and unordered effects but not
for ordered ones, and then runs without the ordering token (`MeshExecutable.
create_cpp_call` in `jax/_src/interpreters/pxla.py`). `tap_effects` gives every ordered
tap an unordered effect as well, which turns that fast path off; the regular `jit` path
already keeps ordered effects off its own fast path, so nothing else changes. (A strict
tap's; the default tap has no ordered effect.)

`jax.export` serializes only custom calls whose targets keep a compatibility promise,
listed in `export._export._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE`: `export_targets_stable`
adds tapd's two, whose attributes are a versioned format (docs/PROTOCOL.md, "The tap's
custom call"). Without the set, export refuses a tapped function, as JAX would.

Two internals are wrapped rather than called, for the default tap to keep JAX's C++
dispatch path (issue 26): `pxla.ExecuteReplicated.__init__` (`dispatch_ignores`: an
executable whose only effect is tapd's unordered one is served from C++) and
`mlir.lower_jaxpr_to_module` (`wrap_module_lowering`: tapd orders the lowered module's
taps, tapd/emitter/order.py). Both are seams too: their keywords are checked.

tapd asks for `SUPPORTED` (jax>=0.8.0, no upper bound: pip must not refuse tapd beside
a jax released after it). CI tests both ends of `TESTED` (.ci/run): the floor on Python
3.11, the newest jax pip gives on Python 3.12. Below the floor `import tapd` warns once
and taps fail at trace time, with the same words. Past the newest tested minor
`import tapd` warns once, naming the tested range, and taps run where the seams fit:
the first tap traced checks that every call above still binds to this jax's signature
(`SEAMS`), and one that does not fails it with a TapDefinitionError naming the seam;
tapd's native handler is registered only where this jaxlib's XLA FFI API accepts it
(tapd/native/library.py). Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from tapd.errors import TapDefinitionError

# 0.8.0 is where JAX removed host_callback (keep it in step with pyproject.toml's [jax]);
# TESTED_THROUGH is the newest minor CI has run: raise it when CI passes on a newer one.
FLOOR = (0, 8, 0)
TESTED_THROUGH = (0, 12)
SUPPORTED = "jax>=0.8.0"
TESTED = "jax 0.8.0 to 0.12"


def _parse(version: str) -> tuple[int, ...]:
    """(0, 12, 0, 1) for "0.12.0.1", (0, 9, 0) for "0.9.0.dev20250101"."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in numbers.group(0).split(".")) if numbers else ()


def installed_jax() -> str | None:
    """The jax version of this process (without importing JAX), or None if none."""
    module = sys.modules.get("jax")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    # jax/version.py's `_version`: read, not imported (importlib.metadata alone would
    # triple the time `import tapd` takes).
    try:
        spec = importlib.util.find_spec("jax")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            with open(os.path.join(location, "version.py"), errors="replace") as file:
                text = file.read()
        except OSError:
            continue
        found = re.search(r"^_version\s*(?::\s*str\s*)?=\s*[\"']([^\"']+)[\"']", text, re.M)
        if found:
            return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return None


_PAST_TESTED = f"{TESTED_THROUGH[0]}.{TESTED_THROUGH[1] + 1}"
_TESTED_PIN = f"'jax<{_PAST_TESTED}' 'jaxlib<{_PAST_TESTED}'"  # for the messages


def unsupported_reason(version: str | None = None) -> str | None:
    """One line saying why taps cannot run with this jax (it is below the floor), or
    None (also if there is no jax: subscriber-only machines need none)."""
    version = version if version is not None else installed_jax()
    if version is None or _parse(version) >= FLOOR:
        return None
    return (
        f"tapd supports {SUPPORTED}, and this is jax {version}: taps will fail until "
        f"you install a jax in that range (pip install '{SUPPORTED}' "
        f"'jaxlib{SUPPORTED.removeprefix('jax')}')"
    )


def untested_reason(version: str | None = None) -> str | None:
    """One line saying that this jax is newer than any CI has run, or None."""
    version = version if version is not None else installed_jax()
    if version is None or tuple(_parse(version)[:2]) <= TESTED_THROUGH:
        return None
    return (
        f"tapd is tested with {TESTED}, and this is jax {version}: taps run where the JAX "
        f"internals tapd calls still fit, and a tap that needs one that does not fails "
        f"when traced, naming it (pip install {_TESTED_PIN} for a tested one)"
    )


def warn_if_unsupported() -> None:
    """At `import tapd`: one warning line (logging's, which Python shows on stderr when
    nothing configured logging) if the installed jax is below the floor or newer than
    the tested range."""
    reason = unsupported_reason() or untested_reason()
    if reason is not None:
        import logging  # (only then: `import tapd` stays quick)

        logging.getLogger("tapd").warning("%s", reason)


# ---- the seams' own check ------------------------------------------------------------


class Seam(NamedTuple):
    """A JAX internal whose signature changed between versions: where JAX has it, and
    the call tapd makes with this jax (positional arguments, keywords), chosen from its
    parameters as the function below that wraps it chooses."""

    module: str
    attribute: str
    call: Callable[[Mapping[str, Any]], tuple[int, tuple[str, ...]]]


SEAMS = {  # keep in step with the functions below
    "mlir.register_lowering": Seam(
        "jax._src.interpreters.mlir",
        "register_lowering",
        lambda parameters: (2, ("cacheable",) if "cacheable" in parameters else ()),
    ),
    "callback.emit_python_callback": Seam(
        "jax._src.callback",
        "emit_python_callback",
        lambda parameters: (
            6,
            ("has_side_effect", "sharding", *(["returns_token"] * ("returns_token" in parameters))),
        ),
    ),
    "callback._callback_op_sharding": Seam(
        "jax._src.callback", "_callback_op_sharding", lambda parameters: (3, ())
    ),
    "mlir.set_sharding": Seam(
        "jax._src.interpreters.mlir",
        "set_sharding",
        lambda parameters: (3 if len(parameters) >= 3 else 2, ()),
    ),
    # (these two: tapd needs the keywords named, whatever else the call takes)
    "pxla.ExecuteReplicated": Seam(
        "jax._src.interpreters.pxla",
        "ExecuteReplicated",
        lambda parameters: (0, _naming(parameters, "unordered_effects", "ordered_effects")),
    ),
    "mlir.lower_jaxpr_to_module": Seam(
        "jax._src.interpreters.mlir",
        "lower_jaxpr_to_module",
        lambda parameters: (0, _naming(parameters, "platforms")),
    ),
}


def _naming(parameters: Mapping[str, Any], *needed: str) -> tuple[str, ...]:
    """Every parameter by keyword, if `needed` are among them; else just `needed` (which
    then do not bind)."""
    return tuple(parameters) if set(needed) <= set(parameters) else needed


def seam_misfit(seams: Mapping[str, Seam] = SEAMS) -> str | None:
    """One line naming the first seam that this jax no longer has, or whose call would
    not bind to its signature; None when they all fit."""
    import importlib
    import inspect

    for name, seam in seams.items():
        try:
            function = getattr(importlib.import_module(seam.module), seam.attribute)
            signature = inspect.signature(function)
            positional, keywords = seam.call(signature.parameters)
            signature.bind(*[None] * positional, **dict.fromkeys(keywords))
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            return (
                f"tapd cannot tap with jax {installed_jax()}: JAX's internal {name} "
                f"({seam.module}.{seam.attribute}) does not fit the call tapd makes ({exc}); "
                f"tapd is tested with {TESTED} (pip install {_TESTED_PIN})"
            )
    return None


@functools.cache
def _checked() -> str | None:
    return unsupported_reason() or seam_misfit()


def require_supported() -> None:
    """At trace time, before tapd touches JAX internals: TapDefinitionError below the
    floor, or naming a seam that does not fit this jax (never a TypeError from inside
    JAX)."""
    reason = _checked()
    if reason is not None:
        raise TapDefinitionError(reason)


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


# ---- the AOT fast path (docs/UPSTREAM.md) -------------------------------------------


def tap_effects(effect: Any, unordered: Any) -> set[Any]:
    """The effects of a tap whose own effect is `effect`: an ordered tap also carries
    the unordered `unordered`, so that an AOT executable never takes the C++ fast path
    that drops its token (see the module docstring)."""
    return {effect, unordered}


# ---- the C++ dispatch path ----------------------------------------------------------


def dispatch_ignores(effect_type: type, flush: Callable[[], None]) -> None:
    """Let JAX's C++ dispatch path serve executables whose only effects are of
    `effect_type` (tapd's unordered tap effect).

    JAX turns that path off for any executable with an effect (`has_unordered_effects`
    of `pxla.ExecuteReplicated`, read by `pjit._get_fastpath_data` and by
    `MeshExecutable.create_cpp_call`), and runs every call through Python instead, about
    55 µs a call. The effect only has to keep the tap in the program: the tap needs no
    runtime token, and tapd's barrier waits for dispatched computations itself. An
    executable with ordered effects, or with any other effect, is left as JAX made it.

    JAX's `effects_barrier()` waits for the runtime tokens of effectful computations,
    and an executable served so has none: `jax.effects_barrier()` calls `flush` after
    JAX's own barrier (`jax_effects_barrier`), which waits for every computation with an
    effect dispatched before it once one was served so (`served_without_tokens`), and
    for what else tapd adds to the barrier."""
    from jax._src.interpreters import pxla

    _flush_after_barrier(flush)

    init = pxla.ExecuteReplicated.__init__
    if getattr(init, "tapd_ignores", None) is not None:
        return
    import inspect

    signature = inspect.signature(init)
    if not {"unordered_effects", "ordered_effects"} <= set(signature.parameters):
        return  # (SEAMS names it: a tap fails at trace time)

    @functools.wraps(init)
    def init_ignoring_taps(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        unordered, ordered = bound["unordered_effects"], bound["ordered_effects"]
        if (
            not ordered
            and all(isinstance(effect, effect_type) for effect in unordered)
            and not _on_several_cpus(bound["xla_executable"])
        ):
            self.has_unordered_effects = False
            _served_without_tokens.set()

    init_ignoring_taps.tapd_ignores = effect_type  # type: ignore[attr-defined]
    pxla.ExecuteReplicated.__init__ = init_ignoring_taps  # type: ignore[method-assign]


def _on_several_cpus(executable: Any) -> bool:
    """Whether `executable` runs on more than one CPU device (pmap, shard_map, a
    partitioned jit over `--xla_force_host_platform_device_count` devices). Those keep
    JAX's runtime token: the CPU client runs each device's part once its inputs are
    ready, and a barrier's per-device marker could overtake a part still running, whose
    outputs the program may have dropped (`lifecycle.flush_devices`). A GPU's or TPU's
    stream keeps dispatch order; on one CPU device the barrier waits for the live arrays
    (what escapes that: flush_devices)."""
    try:
        devices = executable.local_devices()
        return len(devices) > 1 and devices[0].platform == "cpu"
    except Exception:  # (this JAX's executable says otherwise: as before)
        return False


_served_without_tokens = threading.Event()  # an executable took the path dispatch_ignores opens
_jax_own_barrier: list[Callable[[], None]] = []  # JAX's effects_barrier, before tapd's


def served_without_tokens() -> bool:
    """Whether any executable has taken the path `dispatch_ignores` opens."""
    return _served_without_tokens.is_set()


def jax_effects_barrier() -> None:
    """JAX's own `jax.effects_barrier()`, whatever tapd (or `tapd.install_debug()`) has
    made of `jax.effects_barrier` since."""
    if _jax_own_barrier:
        _jax_own_barrier[0]()
        return
    from jax._src import api

    api.effects_barrier()


def _flush_after_barrier(flush: Callable[[], None]) -> None:
    import jax
    from jax._src import api

    if _jax_own_barrier:
        return
    own = api.effects_barrier
    _jax_own_barrier.append(own)

    @functools.wraps(own)
    def effects_barrier() -> None:
        own()
        flush()

    jax.effects_barrier = api.effects_barrier = effects_barrier


def wrap_module_lowering(wrapper: Any) -> None:
    """Lower every module through `wrapper(lower, *args, **kwargs)`, where `lower` is
    `mlir.lower_jaxpr_to_module` (which jit, pmap and AOT lowering call through the
    module's attribute): tapd orders a lowered module's tapping operations there
    (`tapd.emitter.order`)."""
    from jax._src.interpreters import mlir

    lower = mlir.lower_jaxpr_to_module
    if getattr(lower, "tapd_wrapped", False):
        return

    @functools.wraps(lower)
    def lower_module(*args: Any, **kwargs: Any) -> Any:
        return wrapper(lower, *args, **kwargs)

    lower_module.tapd_wrapped = True  # type: ignore[attr-defined]
    mlir.lower_jaxpr_to_module = lower_module


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


def cpu_putter(device: Any) -> Callable[[list[Any], frozenset[int]], list[Any]]:
    """A function of (leaves, weak) that makes `leaves` (numpy arrays) committed
    jax.Arrays on CPU `device`, those at the indices `weak` weakly typed, as
    `jax.debug.callback` hands its arguments. Made once for a run of calls.

    `jax.device_put` costs ~27-45 µs a leaf here, most of it Python around one C++
    call; that call (~3 µs, twice that beside a dispatching thread) is what a
    `tapd.debug` call per step pays on the receiver thread, beside the step, under one
    GIL. Where this JAX's internals differ: `jax.device_put`, then the weak type where
    it can be given."""
    try:
        put = _device_putter()
        sharding = _single_device_sharding(device)
    except Exception:
        return functools.partial(_put_by_jax, device)
    devices = [device]

    def put_leaves(leaves: list[Any], weak: frozenset[int]) -> list[Any]:
        try:
            return [
                put(_aval(leaf.shape, leaf.dtype, index in weak), sharding, [leaf], devices, True)
                for index, leaf in enumerate(leaves)
            ]
        except Exception:
            return _put_by_jax(device, leaves, weak)

    return put_leaves


def cpu_putter_like(
    device: Any, like: list[Any], weak: frozenset[int]
) -> Callable[[list[Any]], list[Any]]:
    """`cpu_putter(device)` for leaves of the shapes and dtypes of `like` (numpy arrays),
    as every tap of a run of one site has them: their avals made once, and no Python
    between a leaf and its put but a list's (~1 µs a call of a one-leaf site: a fifth of
    the receiver's work for a `tapd.debug.callback`, bench/RESULTS.md §10 (b)). The put
    does not check the leaves against the avals: they must be of `like`'s types."""
    import numpy as np

    if not all(type(leaf) is np.ndarray for leaf in like):
        general = cpu_putter(device)
        return lambda leaves: general([np.asarray(leaf) for leaf in leaves], weak)
    try:
        put = _device_putter()
        sharding = _single_device_sharding(device)
        avals = [_aval(leaf.shape, leaf.dtype, index in weak) for index, leaf in enumerate(like)]
    except Exception:
        return lambda leaves: _put_by_jax(device, leaves, weak)
    devices = [device]
    if len(avals) == 1:
        (aval,) = avals

        def put_one(leaves: list[Any]) -> list[Any]:
            try:
                return [put(aval, sharding, leaves, devices, True)]
            except Exception:
                return _put_by_jax(device, leaves, weak)

        return put_one

    def put_each(leaves: list[Any]) -> list[Any]:
        try:
            return [
                put(aval, sharding, [leaf], devices, True)
                for aval, leaf in zip(avals, leaves, strict=True)
            ]
        except Exception:
            return _put_by_jax(device, leaves, weak)

    return put_each


def _put_by_jax(device: Any, leaves: list[Any], weak: frozenset[int]) -> list[Any]:
    import jax

    arrays = list(jax.device_put(leaves, device))
    for index in weak:
        arrays[index] = _weakly_typed(arrays[index])
    return arrays


@functools.cache
def _device_putter() -> Callable[..., Any]:
    """jaxlib's call under `pxla.batched_device_put` (0.8.0 to 0.12): (aval, sharding,
    shards, devices, committed). The Python around it only looks for jax.Arrays among
    the shards, and ours are numpy arrays (~0.8 µs a leaf saved)."""
    from jaxlib import xla_client

    put: Callable[..., Any] = xla_client.batched_device_put
    return put


@functools.cache
def _single_device_sharding(device: Any) -> Any:
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(device)


@functools.lru_cache(maxsize=1024)
def _aval(shape: tuple[int, ...], dtype: Any, weak_type: bool) -> Any:
    from jax._src import core

    return core.ShapedArray(shape, dtype, weak_type=weak_type)


def _weakly_typed(array: Any) -> Any:
    """`array` as the weakly typed jax.Array JAX gives for a Python scalar (the same
    buffer); `array` itself if this JAX's internals differ."""
    try:
        from jax._src import array as jax_array
        from jax._src import core

        aval = core.ShapedArray(array.shape, array.dtype, weak_type=True)
        return jax_array.ArrayImpl(aval, array.sharding, array._arrays, committed=array._committed)
    except Exception:
        return array
