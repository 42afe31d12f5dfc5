"""tapd: values tapped in compiled JAX code, delivered to tap functions in other processes.

    import tapd

    @jax.jit
    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        tapd.tap(loss, "loss")          # handled by a subscriber: @sub.on("loss")
        ...

The host_callback API is here too: `id_tap`, `id_print`, `barrier_wait`,
`TapFunctionException`. Importing tapd does not import JAX; the functions below do, on
first call. Subscribers use the `tapd_client` package.
"""

from __future__ import annotations

from typing import Any

from tapd.errors import (
    BarrierTimeout,
    ConfigError,
    ProtocolError,
    TapDefinitionError,
    TapdError,
    TapFunctionException,
)

__version__ = "0.1.0"

__all__ = [
    "BarrierTimeout",
    "ConfigError",
    "ProtocolError",
    "TapDefinitionError",
    "TapFunctionException",
    "TapdError",
    "__version__",
    "backend",
    "barrier_wait",
    "configure",
    "id_print",
    "id_tap",
    "stats",
    "tap",
]


def tap(arg: Any, name: str, *, step: Any = None, **static_meta: Any) -> Any:
    """Send `arg` to the subscribers of `name`; return `arg` unchanged."""
    from tapd.emitter import tapping

    return tapping.tap(arg, name, step=step, **static_meta)


def id_tap(tap_func: Any, arg: Any, *, result: Any = None, tap_with_device: bool = False) -> Any:
    """host_callback.id_tap: `tap_func(arg, transforms)` runs in a subscriber process."""
    from tapd.emitter import host_callback

    return host_callback.id_tap(tap_func, arg, result=result, tap_with_device=tap_with_device)


def id_print(arg: Any, *, result: Any = None, what: str | None = None, **kwargs: Any) -> Any:
    """host_callback.id_print: printed by `tapd subscribe tapd.printing` or `tapd tail`."""
    from tapd.emitter import host_callback

    return host_callback.id_print(arg, result=result, what=what, **kwargs)


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = 60.0) -> None:
    """Wait until every tap so far was processed by every subscribed handler."""
    from tapd.emitter import lifecycle

    lifecycle.barrier_wait(logging_name, timeout=timeout)


def configure(**settings: Any) -> Any:
    """Emitter settings (endpoint, policy, buffer_bytes, exit_timeout) before the first tap."""
    from tapd.emitter import lifecycle

    return lifecycle.configure(**settings)


def backend() -> str:
    """The backend this process's taps use: "native" (XLA FFI + shared-memory ring) or
    "portable" (jax.debug.callback). Decided once, from settings and availability."""
    from tapd.emitter import lifecycle

    return lifecycle.backend()


def stats() -> dict[str, int]:
    """This process's tap counters: submitted, sent, delivered, dropped, unrouted, errors."""
    from tapd.emitter import lifecycle

    return lifecycle.stats()
