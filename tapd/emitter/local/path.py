"""The local ring: tap functions that live in this process, fed without a daemon.

A tap whose function runs in this process (a `tapd.debug` site; an `id_tap` of a
lambda, closure, bound method or callable object) has no reason to leave it. Its
records go to this process's *local ring*, which the FFI handler (or the portable
backend's host callback) writes exactly as it writes the daemon's ring (the handler's
`ring` attribute says which: tapd/native/ring.h, kRingLocal), and which a receiver
thread of this process drains itself. No daemon is involved and none is started; the
step never waits for a tap function. Taps of named sites and of importable tap
functions keep the daemon's ring (tapd/emitter/local/fallback.py runs the importable
ones here where no subscriber takes them).

What holds on the daemon's path holds here:

- order: the receiver runs records in ring order, which is program order within a
  computation (tapd's order token) and JAX's order for `ordered="strict"` taps; a
  site's `seq` counts every execution per device;
- the bounded ring and its policy: `block` pauses a writer until the receiver has run
  enough, `drop_newest` drops and counts;
- `barrier_wait` (tapd.emitter.lifecycle) returns once the receiver has run every
  record committed before it; what a function raised is raised there, as
  `CallbackException`, with its name and traceback; a barrier that times out says what
  it waits for: which sites' taps, and what the receiver thread is doing;
- the exit drain: at interpreter exit the receiver runs what was committed, as long as
  it makes progress (it gives up after `exit_timeout` seconds without one tap run, and
  then runs no function while JAX and the interpreter shut down); an exact count of
  what it did not run is logged;
- the counters, in `tapd.stats()["local"]`.

Here: the ring, the receiver thread that reads it, and the waits on it (barrier, a
print's catch-up, the exit drain). The consumer names and site ids of its functions are
tapd/emitter/local/sites.py's; the running of what the receiver reads,
tapd/emitter/local/runner.py's (as a subscriber runs a daemon's taps, from a copy of the
ring's bytes). No daemon sees these taps, so `tapd tail '*'` does not either
(docs/TAPPING.md, "Taps that stay in the process").
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tapd.emitter.local import threads
from tapd.emitter.local.functions import LOCAL_PREFIX
from tapd.emitter.local.runner import Runner
from tapd.emitter.local.sites import LocalSites
from tapd.emitter.settings import EmitterSettings
from tapd.errors import BarrierTimeout, TapFunctionException
from tapd.native.ring import Records, Ring
from tapd.native.wake import WakeSocket
from tapd.runtime import SHM_DIR, ensure_private_dir, local_ring_dir_name

logger = logging.getLogger("tapd.emitter")

_RECORDS_PER_READ = 4096
# The receiver sleeps until a writer's wake-up, or this long: a wake-up lost (none is
# known to be) would cost this much delay, never a hang.
_IDLE_LOOK = 0.5  # s
# After a read that did not take every tap there was room for (nor a MiB), the receiver
# lets taps gather this long before it reads again, unless a barrier, a print or exit hurries it,
# or half the ring waits (its writers wake it then: no writer finds it full meanwhile).
# Woken for each tap of a loop that dispatches small steps one by one, it took the GIL
# from the dispatching thread at every step (bench/RESULTS.md §10 (b): 65 µs a call of
# a 4.5 µs step). Each time it wakes costs the step too (the GIL passed back and forth
# between two cores, a core taken from the step's own threads): 10 ms rather than 2
# took (b) from 0.136 to 0.11 of JAX's cost, (b2) from ~25 µs added a step to ~13. The
# daemon coalesces the same way (--coalesce).
_GATHER = 0.010  # s
# Reads of this many bytes or more do not wait: what gathering saves is per read, small
# beside such taps, and their bytes go cold meanwhile (a 1 MiB id_tap a step: ~2x the
# time, gathered 10 ms).
_GATHER_BELOW = 1 << 20


class LocalPath:
    """This process's local ring, its sites and functions (`sites`), and the receiver
    thread that drains it, running the taps through `Runner`."""

    def __init__(self, settings: EmitterSettings, process_index: int) -> None:
        self.settings = settings
        self.emitter = f"{socket.gethostname()}:{os.getpid()}"
        self.prefix = f"{LOCAL_PREFIX}{self.emitter}/{secrets.token_hex(4)}/"
        self.directory = _private_directory()
        try:
            self.ring = Ring.create(
                self.directory / f"{os.getpid()}-{secrets.token_hex(4)}.ring",
                settings.buffer_bytes,
                settings.policy,
            )
            self.ring.path.unlink()  # mapped by this process alone: nothing to find
            self._wake = WakeSocket(self.directory)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.ring.set_reader(os.getpid())
        self.ring.install("local")
        identity = {"process": process_index, "host": socket.gethostname(),
                    "pid": os.getpid(), "emitter": self.emitter}  # fmt: skip
        self.sites = LocalSites(self.prefix, identity)
        self._runner = Runner(self.ring, self.sites, settings.print_worker)
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # `handled` moved on
        self._errors_seen = 0  # failures already raised by a barrier
        self.handled = 0  # ring position up to which every record was run (and released)
        self.ran = 0  # taps run (whatever they raised)
        self._closing = False
        self._hurry = _Hurry()  # someone waits for the receiver: read at once
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="tapd-receiver", daemon=True)
        threads.add(self._thread)
        self._thread.start()

    # ---- trace time: the ring's sites (RingSites, for lowering) -----------------------

    def consumer(self, function: Callable[..., Any], treedef: Any) -> str:
        return self.sites.consumer(function, treedef)

    def entry_name(self, consumer: str) -> str:
        return self.sites.entry_name(consumer)

    def owns(self, consumer: str) -> bool:
        return consumer.startswith(self.prefix)

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int:
        return self.sites.register_site(consumer, fields, leaves)

    def consumer_id(self, consumer: str) -> int:
        return self.sites.consumer_id(consumer)

    def has_sites(self) -> bool:
        """Whether any tap site writes the local ring (else there is nothing to wait for)."""
        return bool(self.sites.entries)

    # ---- the receiver thread -----------------------------------------------------------

    def on_receiver_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        ring = self.ring
        position = self.handled
        try:
            while True:
                span, records = ring.read_span(position, _RECORDS_PER_READ)
                if len(records):
                    start, position = position, self._run_records(span, records, position)
                    if len(records) < _RECORDS_PER_READ and position - start < _GATHER_BELOW:
                        self._gather()
                    continue
                if self._closing:
                    return
                if ring.sleep(position):
                    waits = [self._wake.fileno(), self._stop_read]
                    ready, _, _ = select.select(waits, [], [], _IDLE_LOOK)
                    if waits[0] in ready:
                        self._wake.drain()
        except Exception:
            logger.exception(
                "tapd's local receiver failed; this process's tap functions no longer run"
            )
        finally:
            with self._lock:
                self._closing = True
                self._progress.notify_all()

    def _gather(self) -> None:
        """Let taps gather before the next read (see _GATHER): wait until _GATHER has
        passed, someone waits for the receiver (a barrier, a print, exit), or half the
        ring waits (its writers say so: `Ring.gather`)."""
        hurry = self._hurry
        if hurry.is_set() or not self.ring.gather():
            hurry.clear()
            return
        waits = [self._wake.fileno(), self._stop_read, hurry.fileno()]
        ready, _, _ = select.select(waits, [], [], _GATHER)
        self.ring.gather(False)
        if waits[0] in ready:
            self._wake.drain()
        hurry.clear()

    def _run_records(self, span: memoryview, records: Records, position: int) -> int:
        """Run the tap functions of `records` (read from `position` on, viewed by
        `span`), in order; release their ring space; the position after them."""
        end_position = self._runner.run(span, records, position)
        self.ring.release(end_position)
        with self._lock:
            self.handled = end_position
            self.ran += len(records)
            self._progress.notify_all()
        return end_position

    # ---- barriers, exit, counters ---------------------------------------------------------

    def barrier(
        self, timeout: float | None, *, asked: float | None = None, keep_errors: bool = False
    ) -> None:
        """Return once every tap committed so far has been run (the devices flushed
        first: lifecycle.barrier_wait); raise what the functions raised meanwhile
        (`keep_errors`: leave them for the next barrier). `asked`: the caller's whole
        timeout, of which `timeout` is what is left."""
        target = self.ring.settled()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.handled < target and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    shown = asked if asked is not None else (timeout or 0.0)
                    raise BarrierTimeout(self._waiting_for(target, shown))
                self._hurry.set()  # (each time: the receiver clears it as it goes)
                self._progress.wait(left)
            failures = self._runner.failures
            errors = failures.errors[:] if failures.count > self._errors_seen else []
            if not keep_errors:
                self._errors_seen = failures.count
                failures.errors.clear()
        if self.handled < target:
            raise BarrierTimeout(
                "tapd's local receiver stopped before it ran every tap (see the log)"
            )
        if errors and not keep_errors:
            exc = TapFunctionException(errors)
            exc.__cause__ = self._runner.last_exception
            raise exc

    def catch_up(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) until every record committed so far has been run:
        the taps of computations that have finished. Whether it was; never raises."""
        target = self.ring.counters().committed
        if self.handled >= target:  # (most prints from the main thread: cheaply)
            return True
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.handled < target and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._hurry.set()
                self._progress.wait(left)
        return True

    def closing(self) -> bool:
        """Whether the exit drain has closed it (or the receiver stopped)."""
        return self._closing

    def settle(self, stalled_after: float) -> bool:
        """Wait until every record committed so far has been run, for as long as the
        receiver runs one at least every `stalled_after` s (a long queue of slow
        callbacks is waited for; one stuck callback is not). Whether it was; never
        raises: for a progress bar's close (tapd.emitter.print_order.bars)."""
        target = self.ring.settled()
        with self._lock:
            progress = (self._runner.calls, time.monotonic())
            while self.handled < target and not self._closing:
                if self._runner.calls != progress[0]:
                    progress = (self._runner.calls, time.monotonic())
                left = stalled_after - (time.monotonic() - progress[1])
                if left <= 0:
                    return False
                self._hurry.set()
                self._progress.wait(min(left, 0.1))  # (a call that ends wakes no one)
        return self.handled >= target

    def _waiting_for(self, target: int, timeout: float) -> str:
        """A timed-out barrier's message: which sites' taps wait, and what the receiver
        thread does (its stack), so that a wait never goes unexplained."""
        waiting: dict[str, int] = {}
        try:
            _, records = self.ring.read_span(self.handled, _RECORDS_PER_READ)
            for site_id in records.sites:
                consumer = self.sites.entries[site_id][0].consumer
                waiting[consumer] = waiting.get(consumer, 0) + 1
        except Exception as exc:  # (what it says is a hint: never fail the report)
            waiting[f"(could not read: {exc})"] = 0
        sites = ", ".join(f"{name} ({n} taps)" for name, n in waiting.items()) or "none read yet"
        running = self._runner.running
        doing = (
            f"running {running[0]} for {time.monotonic() - running[1]:.1f} s"
            if running is not None
            else "not running a tap function"
        )
        frame = sys._current_frames().get(self._thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        return (
            f"barrier_wait timed out after {timeout:g} s: tapd's local receiver has run the "
            f"taps of this process's own tap functions up to ring position {self.handled} of "
            f"{target}; waiting: {sites}. The receiver thread is {doing}; its stack:\n{stack}"
        )

    def take_exception(self) -> BaseException | None:
        runner = self._runner
        exc, runner.last_exception = runner.last_exception, None
        return exc

    def stats(self) -> dict[str, int]:
        """sent (written to the ring), ran, dropped (ring full, drop_newest), skipped
        (sampled out), errors (functions that raised), pending (sent, not yet read),
        not_run (read after the exit drain gave up), blocked_ns (writers' wait for room),
        printed_by_worker (id_print taps whose text the print worker rendered)."""
        counters = self.ring.counters()
        return {
            "sent": counters.taps,
            "ran": self.ran - self._runner.not_run,
            "dropped": counters.dropped,
            "skipped": counters.skipped,
            "errors": self._runner.failures.count,
            "blocked_ns": counters.blocked_ns,
            "pending": counters.taps - self.ran,
            "not_run": self._runner.not_run,
            "printed_by_worker": self._runner.print_worker.rendered,
        }

    def close(self, timeout: float) -> int:
        """At exit: run every tap committed so far, for as long as the receiver makes
        progress (giving up after `timeout` seconds without one tap run), then stop the
        receiver and free the ring. A receiver that gives up runs no further function:
        none may still run when JAX and the interpreter shut down. Returns the number of
        taps not run."""
        target = self.ring.settled()
        self._hurry.set()
        progress = (self._runner.calls, time.monotonic())
        with self._lock:
            while self.handled < target and not self._closing:
                if self._runner.calls != progress[0]:
                    progress = (self._runner.calls, time.monotonic())
                elif time.monotonic() - progress[1] >= timeout:
                    logger.error("tapd at exit: %s", self._waiting_for(target, timeout))
                    self._runner.abandoned = True  # the rest are counted, not run
                    break
                self._hurry.set()
                self._progress.wait(min(0.5, timeout))
            self._closing = True
        os.write(self._stop_write, b"x")
        self._thread.join(timeout)
        if self._thread.is_alive():
            running = self._runner.running
            logger.error(
                "tapd at exit: the local receiver is still running %s; the process ends around it",
                running[0] if running else "(between taps)",
            )
        else:
            self._wake.close()
            self._runner.print_worker.close()
            shutil.rmtree(self.directory, ignore_errors=True)
        counts = self.stats()
        return counts["not_run"] + counts["pending"]


class _Hurry:
    """Someone waits for the receiver (a barrier, a print, exit): it reads again at once
    instead of letting taps gather. A flag, and a pipe that wakes it from its wait (left
    open for the process's life: a late `set` must never write to a reused descriptor)."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._flag.set()
        with contextlib.suppress(BlockingIOError):  # (full: it will wake anyway)
            os.write(self._write, b"!")

    def is_set(self) -> bool:
        return self._flag.is_set()

    def fileno(self) -> int:
        return self._read

    def clear(self) -> None:
        """The receiver is about to read: every hurry so far is answered. (The pipe
        first: a hurry between the two leaves its byte, and the next wait is short.)"""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass
        self._flag.clear()


def _private_directory() -> Path:
    """A new 0700 directory for the local ring's wake socket: in /dev/shm beside the
    daemons' ring directories (`tapd clean` removes one whose process is gone), else in
    the temporary directory."""
    parent = (
        SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())
    )
    directory = parent / local_ring_dir_name(os.getpid(), secrets.token_hex(4))
    return ensure_private_dir(directory)
