"""The process-wide emitter: its settings, created at the first tap, drained at exit.

One `Sender` per process owns the connection to the daemon (hello, barriers, handler
errors) and, where the native library loads, the shared-memory ring the taps write to;
`tapd.emitter.tapping` builds the taps that feed it. Taps whose function runs in this
process go to its `LocalPath` instead (tapd/emitter/local/): a program that has no
other taps never starts, nor talks to, a daemon.

This module makes each of them, once a process, and wires them in one place; none of
them imports it. It hands the print order (tapd/emitter/print_order/) its waits
(`catch_up`, `drain`, and `settle` for a progress bar's close), the site resolver
(tapd.emitter.entries) the daemon's ring, and JAX's `jax.effects_barrier()` what tapd
adds to it (`after_jax_barrier`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from tapd import hcb_hook
from tapd.autostart import ensure_daemon
from tapd.emitter import entries, jax_compat, taps_as_outputs
from tapd.emitter.local import threads
from tapd.emitter.local.fallback import FallbackReceiver, connect_timeout
from tapd.emitter.local.path import LocalPath
from tapd.emitter.native_backend import NativeEmitter, RingSites, registered_platforms
from tapd.emitter.print_order import bars, ipython, stdout
from tapd.emitter.sender import Sender, SenderStats
from tapd.emitter.settings import EmitterSettings, from_environment
from tapd.errors import ConfigError, DaemonUnreachable, TapDefinitionError, TapFunctionException
from tapd.native import library
from tapd.native.ring import RingError
from tapd.runtime import check_endpoint_dir, ring_dir_for

logger = logging.getLogger("tapd.emitter")

_state_lock = threading.Lock()
_settings: EmitterSettings | None = None
_sender: Sender | None = None
_local: LocalPath | None = None
_fallback: FallbackReceiver | None = None
_fallback_lock = threading.Lock()


def configure(**settings: Any) -> EmitterSettings:
    """Set the emitter's settings (endpoint, policy, buffer_bytes, exit_timeout) before
    the first tap runs. Unset ones come from `TAPD_*` variables, then defaults."""
    global _settings
    with _state_lock:
        if _sender is not None or _local is not None:
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
                try:  # (TAPD_AUTOSTART=0 and no daemon: an error at once, at trace time)
                    ensure_daemon(_settings.endpoint)
                except DaemonUnreachable as exc:
                    raise TapDefinitionError(
                        f"a tap for other processes needs a daemon: {exc}"
                    ) from exc
                _sender = Sender(
                    _settings,
                    process_index=jax.process_index(),
                    native=_native_emitter(_settings),
                )
                _register_exit_drain()
                ipython.attach(_settings.cell_timeout, drain=drain, catch_up=catch_up)
    return _sender


def local_path() -> LocalPath | None:
    """This process's local ring and receiver (created at the first call), for the tap
    functions that run here; None where the native library does not load (they then go
    through the daemon: `fallback_receiver`)."""
    global _local, _settings
    if _local is None:
        with _state_lock:
            if _local is None:
                if _settings is None:
                    _settings = from_environment()
                if library.load() is None:
                    return None
                _local = LocalPath(_settings, process_index=jax.process_index())
                _register_exit_hook(_drain_local_at_exit)
                stdout.order_writes(sys.stdout, _settings.cell_timeout, catch_up)
                bars.attach(_settings.cell_timeout, settle)
                ipython.attach(_settings.cell_timeout, drain=drain, catch_up=catch_up)
    return _local


def local_path_of(consumer: str) -> LocalPath | None:
    """The local path if `consumer` is one of its functions' (its taps go to the local
    ring), else None."""
    local = _local
    return local if local is not None and local.owns(consumer) else None


def fallback_receiver() -> FallbackReceiver:
    """This process's receiver of the taps its daemon feeds back (tapd.emitter.local.
    fallback), connected (started at the first call)."""
    global _fallback
    with _fallback_lock:
        if _fallback is None:
            endpoint = get_sender().settings.endpoint
            emitter = f"{socket.gethostname()}:{os.getpid()}"
            started = FallbackReceiver(endpoint, emitter, connect_timeout())
            started.start()
            # atexit hooks run after threading's, where the emitter's exit drain waits
            # for this receiver to handle everything.
            atexit.register(started.close)
            _fallback = started
        return _fallback


def local_consumer(function: Any, treedef: Any) -> str:
    """The consumer name of a tap site whose function runs in this process: one of the
    local ring's, which needs no daemon; where the native library does not load, one
    the fallback receiver takes through the daemon."""
    local = local_path()
    if local is not None:
        return local.consumer(function, treedef)
    return fallback_receiver().local(function, treedef)


def take_exception() -> BaseException | None:
    """The last exception a tap function raised in this process, if any (for
    `barrier_wait` to chain to the `CallbackException` it raises)."""
    exc = _local.take_exception() if _local is not None else None
    if exc is None and _fallback is not None:
        exc = _fallback.take_exception()
    return exc


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


def handler_platforms(*, local: bool = False) -> frozenset[str]:
    """The JAX platforms ("cpu", "cuda") whose taps run tapd's FFI handler here; taps on
    other platforms, or with TAPD_BACKEND=portable, go through a host callback. `local`:
    for taps of the local ring (which needs no sender, nor its daemon)."""
    has_ring = local_path() is not None if local else get_sender().native is not None
    assert _settings is not None
    if not has_ring or _settings.backend == "portable":
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
    FFI handler writes the ring) or "portable" (a host callback). A process whose taps
    have all stayed in it so far is asked about its local ring: no daemon is started
    for the question."""
    local = _sender is None and _local is not None
    return "native" if default_platform() in handler_platforms(local=local) else "portable"


class _HostCallbacks:
    """How many host callbacks of tapd's have run in this process (a tap's own, a big
    tap's question, a gathered flush): on a TPU each is a transfer of ~1 ms, so this
    is the figure that says what the gathered path saves (bench/tpu.py, issue 50)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()  # (devices run their callbacks on threads at once)

    def ran(self) -> None:
        with self._lock:
            self.count += 1


_host_callbacks = _HostCallbacks()


def host_callback_ran() -> None:
    """Count one host callback of tapd's (its host function calls this first)."""
    _host_callbacks.ran()


def stats() -> dict[str, Any]:
    """This process's tap counters (empty before the first tap): the daemon path's, and
    the local ring's under "local"; `host_callbacks`, the host callbacks tapd's taps
    have run (one a tap on the per-tap path; one a flush, per device, gathered)."""
    if _sender is not None:
        counts: dict[str, Any] = _sender.stats()
    elif _local is not None:
        counts = {**SenderStats().as_dict(), "skipped_by_consumer": {}}
    else:
        return {}
    if _local is not None:  # (its taps counted in the totals too: run = delivered)
        local = counts["local"] = _local.stats()
        counts["submitted"] += local["sent"] + local["dropped"]
        counts["delivered"] += local["ran"]
        for name in ("sent", "dropped", "errors", "skipped", "blocked_ns"):
            counts[name] = counts.get(name, 0) + local[name]
    counts["host_callbacks"] = _host_callbacks.count
    return counts


def flush_devices(*, cpu_arrays: bool = True) -> None:
    """Return once every computation dispatched before the call has run its taps.

    A tapped computation takes JAX's C++ dispatch path, which keeps no runtime token for
    `jax.effects_barrier()` to wait on (`jax_compat.dispatch_ignores`). A GPU or TPU
    runs the computations dispatched to it in order (its stream), so one tiny
    computation on each local device, waited for, comes after them all. The CPU client
    does not: it runs a computation as soon as its inputs are ready, on a thread pool,
    so a cheap one overtakes a chain still running (measured: 1-5 runs in 20). There,
    the live CPU arrays are waited for too (`cpu_arrays`, ~0.5-2 ms for 2000 arrays):
    a computation still running has outputs the program holds, unless it dropped every
    one of them (docs/TAPPING.md says so). A computation over several CPU devices keeps
    JAX's runtime token (`_on_several_cpus`, tapd/emitter/jax_compat/dispatch.py). JAX's
    own barrier, first, covers those, strict taps and host callbacks
    (`jax.effects_barrier()` calls this after it, once tapd is loaded)."""
    jax_compat.jax_effects_barrier()
    if cpu_arrays:
        _wait_for_live_cpu_arrays()
    increment = _increment()
    with jax_compat.outside_any_mesh():  # (a caller's mesh would refuse one device)
        markers = [increment(jax.device_put(np.uint8(0), device)) for device in jax.local_devices()]
    jax.block_until_ready(markers)  # type: ignore[no-untyped-call]
    taps_as_outputs.drain()  # (gathered computations' taps that came out as outputs)


def _wait_for_live_cpu_arrays() -> None:
    try:
        arrays = jax.live_arrays("cpu")  # type: ignore[no-untyped-call]
    except Exception:  # no CPU backend here (JAX_PLATFORMS=cuda): nothing to wait for
        return
    try:
        jax.block_until_ready(arrays)  # type: ignore[no-untyped-call]
    except Exception:  # one deleted or donated meanwhile, or a failed computation's
        for array in arrays:  # (a failure says so where its results are read)
            try:
                array.block_until_ready()
            except Exception:
                pass


@functools.cache
def _increment() -> Any:
    return jax.jit(lambda value: value + 1)


def barrier_wait(logging_name: str | None = None, *, timeout: float | None = 60.0) -> None:
    """Block until every tap emitted so far has been processed by every subscribed
    handler. Raises `TapFunctionException` if handlers raised (chained to the last
    exception a tap function of this process raised, if one did), `BarrierTimeout` if
    not done within `timeout` seconds; refuses to run in a tap function."""
    if threads.on_receiver_thread():
        raise RuntimeError("barrier_wait() called from a tap function would wait for itself")
    flush_devices()
    started = time.monotonic()
    failed: list[TapFunctionException] = []  # (both paths waited for, whatever raised)
    reply = None
    try:
        reply = _sender.barrier(timeout) if _sender is not None else None
    except TapFunctionException as exc:
        failed.append(exc)
    if _local is not None:
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - started))
        try:
            _local.barrier(left, asked=timeout)
        except TapFunctionException as exc:
            failed.append(exc)
    if failed:
        raise _with_cause(failed)
    if logging_name:
        logger.info("barrier %s passed: %s", logging_name, reply)


def _with_cause(failed: list[TapFunctionException]) -> TapFunctionException:
    """What `barrier_wait` raises for the failures of its paths: the one, or one of them
    all chained to the last; chained to the last exception of a tap function of this
    process where that says nothing else."""
    if len(failed) == 1:
        exc = failed[0]
    else:
        exc = TapFunctionException([t for each in failed for t in each.texts])
        exc.__cause__ = failed[-1]
    cause = take_exception()
    if cause is not None and exc.__cause__ is None:
        exc.__cause__ = cause
    return exc


def drain(timeout: float) -> None:
    """What `barrier_wait` waits for, leaving what the tap functions raised for the next
    barrier_wait: for the end of a notebook cell (tapd.emitter.print_order.ipython)."""
    flush_devices()
    started = time.monotonic()
    if _sender is not None:
        _sender.barrier(timeout, keep_errors=True)
    if _local is not None:
        left = max(0.0, timeout - (time.monotonic() - started))
        _local.barrier(left, asked=timeout, keep_errors=True)


def after_jax_barrier() -> None:
    """What `jax.effects_barrier()` adds once tapd is loaded (jax_compat.dispatch_ignores),
    after JAX's own barrier: the computations JAX's C++ dispatch path served (no runtime
    token for JAX to wait on) have run their taps, and this process's own tap functions
    (id_tap closures, output_stream, tapd.debug) have run them, as JAX's synchronous
    callbacks and host_callback's would have by then. What they raised is left for the
    next `barrier_wait`, or raised here once `install_host_callback()` has run, as
    host_callback's `jax.effects_barrier()` raised it. Nothing on the receiver thread,
    which would wait for itself."""
    local = _local
    if threads.on_receiver_thread():
        return
    if jax_compat.served_without_tokens():
        flush_devices()
    else:
        taps_as_outputs.drain()
    if local is not None and local.has_sites():
        local.barrier(_EFFECTS_BARRIER_TIMEOUT, keep_errors=not hcb_hook.installed())


# (as long as barrier_wait's default: a wait past it says what it waits for)
_EFFECTS_BARRIER_TIMEOUT = 60.0


def catch_up(timeout: float) -> None:
    """Wait (up to `timeout` s) until the computations dispatched so far have run, and
    the local receiver has run their taps: what JAX's synchronous callbacks would have
    done by now (tapd.emitter.print_order, before a write to stdout). Nothing while JAX
    traces."""
    local = _local
    if local is None or local.on_receiver_thread() or not local.has_sites():
        return
    if jax_compat.tracing():
        return
    try:
        flush_devices(cpu_arrays=False)  # (cheap: a print may wait here each time)
    except Exception:  # (a device that fails says so where its results are read)
        pass
    local.catch_up(timeout)


def settle(stalled_after: float) -> bool | None:
    """Wait until the computations dispatched so far have run and the local receiver
    has run their taps, while it makes progress (`LocalPath.settle`): before a progress
    bar closes (tapd.emitter.print_order.bars). Whether it got there; None where there
    was nothing to wait for. Never from a tap function, while JAX traces, or once the
    exit drain has run."""
    local = _local
    if local is None or threads.on_receiver_thread() or not local.has_sites():
        return None
    if local.closing() or jax_compat.tracing():  # (closing: exit drained it; JAX goes)
        return None
    try:
        flush_devices()  # (the CPU's live arrays too: the bar's loop may still run)
    except Exception:  # (a device that fails says so where its results are read)
        pass
    return local.settle(stalled_after)


def _register_exit_drain() -> None:
    _register_exit_hook(_drain_at_exit)


def _register_exit_hook(hook: Any) -> None:
    # threading's exit hooks run when the main thread ends, before `atexit` handlers:
    # pyzmq's zero-copy machinery and JAX's backends are both still alive then.
    # (concurrent.futures relies on the same hook.)
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(hook)
    else:
        atexit.register(hook)


def _drain_local_at_exit() -> None:
    """Run the local ring's taps committed before exit (for up to exit_timeout s)."""
    local = _local
    if local is None or _settings is None:
        return
    try:
        flush_devices()
    except Exception:  # JAX may be half torn down at exit; drain what we have
        pass
    not_run = local.close(_settings.exit_timeout)
    counts = local.stats()
    if not_run or counts["dropped"]:
        logger.error(
            "tapd at exit: not every tap of this process's own tap functions ran: %d not "
            "run, %d dropped under drop_newest (no room in the ring, or a tap larger "
            "than it): %s",
            not_run,
            counts["dropped"],
            counts,
        )


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
            sender.barrier(_settings.exit_timeout, name="the exit drain")
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


def _daemon_ring() -> RingSites | None:
    """This process's ring to the daemon (the sender's, made on demand), where the site
    of a computation compiled elsewhere is registered (tapd.emitter.entries.resolve)."""
    return get_sender().native


entries.resolve_into(_daemon_ring)
