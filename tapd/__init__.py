"""tapd: values tapped in compiled JAX code, delivered to tap functions in other processes.

    import tapd

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        tapd.tap(loss, "loss")          # handled by a subscriber: @sub.on("loss")
        ...

The host_callback API is here too (`import tapd as hcb`): `id_tap`, `id_print`,
`barrier_wait`, `CallbackException` (alias `TapFunctionException`), `CallbackFlavor`;
docs/MIGRATING.md says what differs. Importing tapd does not import JAX; the functions
below do, on first call. Subscribers use the `tapd_client` package.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from tapd import export_hook, hcb_hook
from tapd.emitter import jax_compat
from tapd.errors import (
    BarrierTimeout,
    CallbackException,
    ConfigError,
    ProtocolError,
    TapDefinitionError,
    TapdError,
    TapFunctionException,
)

__version__ = "0.1.0"

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = [
    "BarrierTimeout",
    "CallbackException",
    "CallbackFlavor",
    "ConfigError",
    "ProtocolError",
    "TapDefinitionError",
    "TapFunctionException",
    "TapdError",
    "__version__",
    "after_callbacks",
    "backend",
    "barrier_wait",
    "configure",
    "debug",
    "deserialize",
    "id_print",
    "id_tap",
    "install_debug",
    "install_host_callback",
    "stats",
    "tap",
]


def tap(
    arg: Any,
    name: str,
    *,
    step: Any = None,
    ordered: bool | Literal["strict"] | None = None,
    **static_meta: Any,
) -> Any:
    """Send `arg` to the subscribers of `name`; return `arg` unchanged. The taps of one
    computation keep program order; `ordered="strict"` also orders them between
    computations, at JAX's per-call cost; `ordered=False` (or TAPD_ORDERED=0) keeps no
    order (docs/TAPPING.md, "Ordered, strict and unordered taps")."""
    jax_compat.require_supported()
    from tapd.emitter import tapping

    return tapping.tap(arg, name, step=step, ordered=ordered, **static_meta)


class CallbackFlavor(enum.Enum):
    """host_callback's choice of JAX callback (`callback_flavor=`). Accepted for
    compatibility, with no effect: tapd taps are asynchronous, and ordered unless
    TAPD_ORDERED=0."""

    IO_CALLBACK = 1
    PURE = 2
    DEBUG = 3


def id_tap(
    tap_func: Any,
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    callback_flavor: CallbackFlavor | None = None,
    **kwargs: Any,
) -> Any:
    """host_callback.id_tap: `tap_func(arg, transforms)` runs in a subscriber process that
    takes it, else in this process, on tapd's receiver thread; returns `arg` (or
    `result`). Lambdas, closures and bound methods always run in this process."""
    jax_compat.require_supported()
    from tapd.emitter import host_callback

    return host_callback.id_tap(
        tap_func,
        arg,
        result=result,
        tap_with_device=tap_with_device,
        device_index=device_index,
        callback_flavor=callback_flavor,
        **kwargs,
    )


def id_print(
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    output_stream: Any = None,
    threshold: int | None = None,
    callback_flavor: CallbackFlavor | None = None,
    **kwargs: Any,
) -> Any:
    """host_callback.id_print: prints `kwargs` (`what: ...`) then `arg`, as host_callback
    did: to `output_stream` or stdout in this process, or in `tapd subscribe
    tapd.printing` / `tapd tail` where one runs."""
    jax_compat.require_supported()
    from tapd.emitter import host_callback

    return host_callback.id_print(
        arg,
        result=result,
        tap_with_device=tap_with_device,
        device_index=device_index,
        output_stream=output_stream,
        threshold=threshold,
        callback_flavor=callback_flavor,
        **kwargs,
    )


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = 60.0) -> None:
    """Wait until every tap so far was processed by every subscribed handler, tap
    functions in this process included; raise `CallbackException` if any raised (chained
    to the last exception raised in this process, if one was)."""
    from tapd.emitter import lifecycle

    lifecycle.barrier_wait(logging_name, timeout=timeout)


def after_callbacks(function: _F) -> _F:
    """`function`, which first waits (while tapd's in-process callbacks are in use) until
    the computations dispatched so far have run and this process has run their
    callbacks: `MyBar.close = tapd.after_callbacks(MyBar.close)` for a progress bar that
    callbacks update and the program closes right after the call, as tqdm's, rich's and
    fastprogress's bars already do (docs/MIGRATING.md, "Progress bars"). The wait lasts
    while the callbacks make progress (`TAPD_CELL_TIMEOUT`); never in a tap function."""
    from tapd.emitter.print_order import bars

    return bars.after_callbacks(function)


def install_host_callback() -> None:
    """Make `from jax.experimental import host_callback` (and `import
    jax.experimental.host_callback as hcb`) give tapd's host_callback API, `tapd.hcb`,
    in this process from now on: for libraries that import host_callback themselves.
    `python -m tapd.hcb script.py [args]` does it with no code changed."""
    hcb_hook.install()


def install_debug(*, io_callback: bool = False) -> None:
    """Make `jax.debug.callback`, `jax.debug.print` (and `jax.debug.log`) give
    `tapd.debug`'s, and `jax.effects_barrier()` wait for their callbacks too, in this
    process from now on: for libraries that call them themselves. `io_callback=True`
    also takes `jax.experimental.io_callback` calls whose result is None (progress
    bars). `python -m tapd.debug script.py [args]` does it with no code changed."""
    from tapd.debug import install

    install(io_callback=io_callback)


def deserialize(serialized: bytes | bytearray) -> Any:
    """`jax.export.deserialize`, in a process that may never have traced a tap: first
    registers what a tapped computation exported elsewhere needs here (tapd's effects,
    its XLA FFI handler, and the hook through which the handler registers the
    computation's tap sites in this process's sites file as they first run). Calling
    the result taps to this process's daemon, by the sites' names (docs/TAPPING.md,
    "Exported and cached computations")."""
    from tapd.emitter import exported

    return exported.deserialize(serialized)


def configure(**settings: Any) -> Any:
    """Emitter settings (endpoint, policy, buffer_bytes, exit_timeout, ordered) before
    the first tap."""
    from tapd.emitter import lifecycle

    return lifecycle.configure(**settings)


def backend() -> str:
    """The backend this process's taps use: "native" (XLA FFI + shared-memory ring) or
    "portable" (jax.debug.callback). Decided once, from settings and availability."""
    from tapd.emitter import lifecycle

    return lifecycle.backend()


def stats() -> dict[str, Any]:
    """This process's tap counters: submitted, sent, delivered, dropped, unrouted, errors,
    skipped (taps not copied: their site dormant, no subscriber taking it, or sampled out
    by `every=`), and `skipped_by_consumer`, a dict {consumer: skipped}."""
    from tapd.emitter import lifecycle

    return lifecycle.stats()


_NOT_HERE = {
    "call": "host_callback.call returns the host function's result to the computation, "
    "so the computation must wait for it: it cannot be asynchronous, and tapd does not "
    "offer it. Use jax.experimental.io_callback(f, result_shape, x, ordered=True), which "
    "host_callback.call itself used in its last versions, or jax.pure_callback for a pure "
    "function; see docs/MIGRATING.md",
    "stop_outfeed_receiver": "tapd uses no outfeed, so there is no outfeed receiver to "
    "stop before using lax.outfeed: delete the call; see docs/MIGRATING.md",
}


jax_compat.warn_if_unsupported()
# A tapped jax.export artifact loads in a process that only imported tapd.
export_hook.install()


def __getattr__(name: str) -> Any:
    if name == "debug":  # a subpackage that imports JAX: imported when first used
        import importlib

        return importlib.import_module("tapd.debug")
    if name in _NOT_HERE:
        raise AttributeError(f"module 'tapd' has no attribute {name!r}: {_NOT_HERE[name]}")
    raise AttributeError(f"module 'tapd' has no attribute {name!r}")
