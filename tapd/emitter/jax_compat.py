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
already keeps ordered effects off its own fast path, so nothing else changes.

The range (`SUPPORTED`) is what CI tests (.ci/run): its oldest end on Python 3.11,
the newest jax pip gives on Python 3.12. Outside it, `import tapd` warns once and taps
fail at trace time, with the same words. Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from typing import Any

from tapd.errors import TapDefinitionError

# [floor, ceiling): 0.8.0 is where JAX removed host_callback; the ceiling is the minor
# after the newest release CI has run (keep it in step with pyproject.toml's [jax]).
FLOOR = (0, 8, 0)
CEILING = (0, 13, 0)
SUPPORTED = "jax>=0.8.0,<0.13"


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


def unsupported_reason(version: str | None = None) -> str | None:
    """One line saying why this jax is outside tapd's range, or None if it is inside
    (or if there is no jax: subscriber-only machines need none)."""
    version = version if version is not None else installed_jax()
    if version is None:
        return None
    if FLOOR <= _parse(version) < CEILING:
        return None
    return (
        f"tapd supports {SUPPORTED}, and this is jax {version}: taps will fail until "
        f"you install a jax in that range (pip install '{SUPPORTED}' "
        f"'jaxlib{SUPPORTED.removeprefix('jax')}')"
    )


def warn_if_unsupported() -> None:
    """At `import tapd`: one warning line (logging's, which Python shows on stderr when
    nothing configured logging) if the installed jax is outside the range."""
    reason = unsupported_reason()
    if reason is not None:
        import logging  # (only then: `import tapd` stays quick)

        logging.getLogger("tapd").warning("%s", reason)


@functools.cache
def _checked() -> str | None:
    return unsupported_reason()


def require_supported() -> None:
    """At trace time, before tapd touches JAX internals: TapDefinitionError outside the
    range (never a TypeError from inside JAX)."""
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
    from jax._src import callback as jax_callback

    emit = jax_callback.emit_python_callback
    extra = {"returns_token": returns_token} if _accepts(emit, "returns_token") else {}
    _, new_token, _ = emit(
        ctx,
        callback,
        token,
        operands,
        operand_avals,
        [],
        has_side_effect=True,
        sharding=sharding,
        **extra,
    )
    return new_token


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
