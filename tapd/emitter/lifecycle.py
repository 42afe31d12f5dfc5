"""The process-wide emitter: its settings, created at the first tap, drained at exit.

One `Sender` per process owns the connection to the daemon (hello, barriers, handler
errors) and, where the native library loads, the shared-memory ring the taps write to;
`tapd.emitter.tapping` builds the taps that feed it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from typing import Any

import jax
import numpy as np

from tapd.autostart import ensure_daemon
from tapd.emitter import jax_compat
from tapd.emitter.native_backend import NativeEmitter, registered_platforms
from tapd.emitter.sender import Sender
from tapd.emitter.settings import EmitterSettings, from_environment
from tapd.errors import ConfigError
from tapd.native import library
from tapd.native.ring import RingError
from tapd.runtime import check_endpoint_dir, ring_dir_for

logger = logging.getLogger("tapd.emitter")

_state_lock = threading.Lock()
_settings: EmitterSettings | None = None
_sender: Sender | None = None


def configure(**settings: Any) -> EmitterSettings:
    """Set the emitter's settings (endpoint, policy, buffer_bytes, exit_timeout) before
    the first tap runs. Unset ones come from `TAPD_*` variables, then defaults."""
    global _settings
    with _state_lock:
        if _sender is not None:
            raise RuntimeError("tapd.configure() must be called before the first tap runs")
        _settings = from_environment(**settings)
        return _settings


def settings() -> EmitterSettings:
    """The emitter's settings: `configure`'s, else from the environment."""
    global _settings
    with _state_lock:
        if _settings is None:
            _settings = from_environment()
        return _settings


def get_sender() -> Sender:
    global _sender, _settings
    if _sender is None:
        with _state_lock:
            if _sender is None:
                if _settings is None:
                    _settings = from_environment()
                check_endpoint_dir(_settings.endpoint)  # no squatter's daemon gets our taps
                ensure_daemon(_settings.endpoint, required=False)
                _sender = Sender(
                    _settings,
                    process_index=jax.process_index(),
                    native=_native_emitter(_settings),
                )
                _register_exit_drain()
    return _sender


def _native_emitter(settings: EmitterSettings) -> NativeEmitter | None:
    """This process's shared-memory ring, which both backends write to, or None (saying
    why, once): then taps go to the daemon through the sender thread."""
    directory = ring_dir_for(settings.endpoint)
    reason = None
    if directory is None:
        reason = f"the daemon endpoint {settings.endpoint} is not a local ipc:// socket"
    elif library.load() is None:
        reason = library.unavailable_reason() or "the native library did not load"
    else:
        try:
            return NativeEmitter(directory, settings.buffer_bytes, settings.policy)
        except (RingError, OSError) as exc:
            reason = str(exc)
    if settings.backend == "native":
        raise ConfigError(f"backend 'native' was asked for but cannot be used: {reason}")
    logger.warning(
        "tapd: using the portable backend through a sender thread (msgpack over ZeroMQ, "
        "the slowest path): no shared-memory ring here: %s",
        reason,
    )
    return None


def handler_platforms() -> frozenset[str]:
    """The JAX platforms ("cpu", "cuda") whose taps run tapd's FFI handler here; taps on
    other platforms, or with TAPD_BACKEND=portable, go through a host callback."""
    sender = get_sender()
    assert _settings is not None
    if sender.native is None or _settings.backend == "portable":
        return frozenset()
    platforms = registered_platforms()
    if _settings.backend == "native" and default_platform() not in platforms:
        reason = library.handler_reason(default_platform()) or library.unavailable_reason()
        raise ConfigError(
            f"backend 'native' was asked for, but JAX's {jax.default_backend()} backend has "
            f"no tapd handler here ({reason or 'not built for it'})"
        )
    return platforms


def default_platform() -> str:
    """JAX's default backend as lowering names it: "gpu" is "cuda" (or "rocm")."""
    name = jax.default_backend()
    if name != "gpu":
        return name
    try:
        return "cuda" if jax.devices("cuda") else "rocm"
    except RuntimeError:  # no CUDA backend: a ROCm one
        return "rocm"


def backend() -> str:
    """The backend this process's taps use on JAX's default platform: "native" (tapd's
    FFI handler writes the ring) or "portable" (a host callback)."""
    return "native" if default_platform() in handler_platforms() else "portable"


def stats() -> dict[str, Any]:
    """This process's tap counters (zeros before the first tap)."""
    return _sender.stats() if _sender is not None else {}


def flush_devices() -> None:
    """Return once every computation dispatched before the call has run its taps.

    A tapped computation takes JAX's C++ dispatch path, which keeps no runtime token for
    `jax.effects_barrier()` to wait on (`jax_compat.dispatch_ignores`). A device runs
    the computations dispatched to it in order (a GPU's stream, the CPU client's
    last-enqueued event), so one tiny computation on each local device, waited for,
    comes after them all. JAX's own barrier still covers strict taps and host
    callbacks (`jax.effects_barrier()` calls this after it, once tapd is loaded)."""
    jax_compat.jax_effects_barrier()
    increment = _increment()
    with jax_compat.outside_any_mesh():  # (a caller's mesh would refuse one device)
        markers = [increment(jax.device_put(np.uint8(0), device)) for device in jax.local_devices()]
    jax.block_until_ready(markers)  # type: ignore[no-untyped-call]


@functools.cache
def _increment() -> Any:
    return jax.jit(lambda value: value + 1)


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = 60.0) -> None:
    """Block until every tap emitted so far has been processed by every subscribed
    handler. Raises `TapFunctionException` if handlers raised, `BarrierTimeout` if not
    done within `timeout` seconds."""
    flush_devices()
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
        flush_devices()
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
    # What no daemon confirmed delivered or unrouted: dropped (here or by a daemon), never
    # confirmed (the barrier did not pass), or with a daemon that stopped before saying.
    undelivered = counts["sent"] - counts["delivered"] - counts["unrouted"] - counts["unknown"]
    if counts["dropped"] or counts["daemon_dropped"] or undelivered > 0:
        logger.error("tapd at exit: not every tap was delivered: %s", counts)
    elif counts["unknown"]:
        logger.warning(
            "tapd: at exit, %d taps went to a tapd daemon that stopped (killed?) before it "
            "said whether they were delivered; its subscribers may have handled them: %s",
            counts["unknown"],
            counts,
        )
