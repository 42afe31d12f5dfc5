"""The emitter's sender: a byte-bounded buffer drained by one thread that owns the socket.

`submit` is called from XLA's callback threads, several at once. It never touches the
network: it appends the copied arrays to the buffer and wakes the sender thread through
a pipe. Only when the buffer is full does it wait (policy `block`) or drop and count
(`drop_newest`). The sender thread sends while the daemon's credit window allows
(docs/PROTOCOL.md, "Flow control"), so a slow subscriber fills the daemon's queues, then
this buffer, then pauses the computation -- never memory without bound, never silently.

On the native backend the taps go through the shared-memory ring instead, and this
thread carries only control traffic: hello (naming the ring), barriers, handler errors.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from tapd.clients import control, emitter_socket
from tapd.clients.emitter_socket import EmitterSocket
from tapd.clients.liveness import FIRST_LOOK_AFTER, DaemonWatch, Sighting
from tapd.emitter.native_backend import NativeEmitter
from tapd.emitter.settings import EmitterSettings
from tapd.errors import BarrierTimeout, ProtocolError, TapFunctionException
from tapd.protocol import encode
from tapd.protocol.link import Refused, RehelloAsked, Restarted, Welcomed
from tapd.settings import CONNECT_TIMEOUT

logger = logging.getLogger("tapd.emitter")

_FIRST_SLICE = 0.25  # s a barrier waits before it watches the daemon (most pass sooner)
_SLICE = 0.25  # s between the watch's checks (it looks at the daemon once a second)


@dataclasses.dataclass(frozen=True)
class TapSite:
    """What is fixed at trace time for one tap site; shared by all its records."""

    consumer: str
    fields: Mapping[str, Any]  # transforms, meta, tree: already msgpack-ready

    @property
    def every(self) -> int:
        """The site's own sampling (`tap(..., every=K)`)."""
        return int(self.fields.get("every", 1))


@dataclasses.dataclass
class _Tap:
    site: TapSite
    seq: int
    step: int | None
    device: int | None
    time_ns: int
    arrays: list[np.ndarray]
    nbytes: int
    coords: list[int] | None = None  # shard coordinates inside pmap/shard_map


@dataclasses.dataclass
class _Barrier:
    id: int
    covers: int  # taps submitted before it
    ring_position: int | None = None  # native backend: ring bytes committed before it
    lost_bytes: int = 0
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    reply: dict[str, Any] = dataclasses.field(default_factory=dict)
    nbytes: int = 0


@dataclasses.dataclass
class SenderStats:
    """Counts of this emitter's taps. `delivered`/`unrouted`/`daemon_dropped` are the
    daemons' figures as of their last report (each tap counted once: never more than
    were sent). `unknown`: once every tap sent is confirmed, those that no daemon
    reported on: they were with a daemon that stopped (killed, crashed) before it said
    what became of them, so they may have been delivered or lost."""

    submitted: int = 0
    sent: int = 0
    dropped: int = 0  # dropped here, buffer full under drop_newest
    delivered: int = 0
    daemon_dropped: int = 0
    unrouted: int = 0
    unknown: int = 0
    lost_in_flight_bytes: int = 0
    errors: int = 0
    buffered_bytes: int = 0
    skipped: int = 0  # not copied: sampled out by the site's every= (or dormant, ring)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class Sender:
    """Connection of one emitter process to its host's daemon."""

    def __init__(
        self,
        settings: EmitterSettings,
        *,
        process_index: int = 0,
        native: NativeEmitter | None = None,
    ) -> None:
        self.settings = settings
        self.native = native  # taps go through its ring; this thread does control only
        self._identity: dict[str, Any] = {
            "role": "emitter",
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "process": process_index,
            **(native.identity() if native else {}),
        }
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # producers wait here for room
        self._queue: collections.deque[_Tap | _Barrier] = collections.deque()
        self._sequences: dict[tuple[int | None, str], int] = {}
        self._errors: list[str] = []
        self._barriers: dict[int, _Barrier] = {}
        self._next_barrier = 0
        self._confirmed = 0  # taps submitted before the last barrier that passed
        self._stats = SenderStats()
        self._skipped: dict[str, int] = {}  # by consumer (taps that go over the socket)
        self._totals: dict[str | None, tuple[int, int, int]] = {}  # by daemon id
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._wake_pending = False
        self._closing = False
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="tapd-sender", daemon=True)
        self._thread.start()

    # ---- called from XLA callback threads -------------------------------------------

    def sampled_out(self, site: TapSite, device: int | None) -> bool:
        """Before a tap is copied: whether the site's `every=K` skips this execution (its
        seq, which counts every execution, not a multiple of K). If so its seq is used up
        and it is counted as skipped; if not, nothing is taken (`submit` takes the seq and
        decides again)."""
        every = site.every
        if every == 1:
            return False
        with self._lock:
            key = (device, site.consumer)
            seq = self._sequences.get(key, 0)
            if seq % every == 0:
                return False
            self._sequences[key] = seq + 1
            self._count_skip_locked(site.consumer)
            return True

    def _count_skip_locked(self, consumer: str) -> None:
        self._stats.skipped += 1
        self._skipped[consumer] = self._skipped.get(consumer, 0) + 1

    def submit(
        self,
        site: TapSite,
        arrays: list[np.ndarray],
        *,
        step: int | None,
        device: int | None,
        coords: list[int] | None = None,
    ) -> bool:
        """Queue one tap (arrays already copied). False if dropped under drop_newest (a
        tap the site's `every=` skips is counted as skipped, not queued: True)."""
        nbytes = sum(a.nbytes for a in arrays)
        now = time.time_ns()
        every = site.every
        with self._lock:
            # A dropped tap still takes its sequence number, so the gap is visible.
            key = (device, site.consumer)
            seq = self._sequences.get(key, 0)
            self._sequences[key] = seq + 1
            if seq % every:  # (another thread took the seq sampled_out saw)
                self._count_skip_locked(site.consumer)
                return True
            self._stats.submitted += 1
            if not self._wait_for_room(nbytes, site.consumer):
                self._stats.dropped += 1
                return False
            self._queue.append(_Tap(site, seq, step, device, now, arrays, nbytes, coords))
            self._stats.buffered_bytes += nbytes
            self._wake_locked()
        return True

    def _wait_for_room(self, nbytes: int, consumer: str) -> bool:
        limit = self.settings.buffer_bytes
        # A tap larger than the whole buffer is still accepted when the buffer is empty.
        if self._stats.buffered_bytes == 0 or self._stats.buffered_bytes + nbytes <= limit:
            return True
        if self.settings.policy == "drop_newest":
            return False
        started = time.monotonic()
        warned = False
        while self._stats.buffered_bytes and self._stats.buffered_bytes + nbytes > limit:
            if self._closing:
                return False
            self._space.wait(timeout=1.0)
            waited = time.monotonic() - started
            if not warned and waited > self.settings.block_warning_after:
                warned = True
                logger.warning(
                    "tap %r has waited %.0f s for buffer space (%d bytes buffered, limit %d): "
                    "the daemon at %s is not taking taps; is it running and are its "
                    "subscribers keeping up?",
                    consumer,
                    waited,
                    self._stats.buffered_bytes,
                    limit,
                    self.settings.endpoint,
                )
        return True

    def _wake_locked(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            os.write(self._wake_write, b"\0")

    # ---- called from user threads ---------------------------------------------------

    def barrier(
        self, timeout: float | None, *, keep_errors: bool = False, name: str = "barrier_wait"
    ) -> dict[str, Any]:
        """Wait until every tap submitted so far is processed; raise handler errors
        (`keep_errors`: leave them for the next barrier). Raises DaemonUnreachable where
        no daemon answers for TAPD_CONNECT_TIMEOUT s and none is started on demand
        (tapd/clients/liveness.py); `name` names the wait in what it logs."""
        # Everything in the ring so far precedes it. (Outside the lock: waiting for a
        # CUDA stream's commits may take seconds, and submits must not wait for that.)
        ring_position = self.native.settled_position() if self.native is not None else None
        with self._lock:
            barrier = _Barrier(self._next_barrier, covers=self._submitted_locked())
            barrier.ring_position = ring_position
            self._next_barrier += 1
            self._barriers[barrier.id] = barrier
            self._queue.append(barrier)
            self._wake_locked()
        try:
            silent = self._wait_watched(barrier, timeout, name)
        finally:
            if not barrier.done.is_set():
                with self._lock:
                    self._barriers.pop(barrier.id, None)
        if not barrier.done.is_set():
            with self._lock:
                queued = sum(1 for item in self._queue if isinstance(item, _Tap))
            if silent is not None:
                where = f"no daemon answers there: {silent.describe()}"
            else:
                where = _waiting_upstream(self.settings.endpoint) or (
                    "not yet processed by its subscribers (is the daemon running? `tapd status`)"
                )
            raise BarrierTimeout(
                f"barrier_wait timed out after {timeout} s: {queued} taps still buffered in "
                f"this process, the rest sent to the daemon at {self.settings.endpoint} and "
                f"{where}"
            )
        with self._lock:
            errors, self._errors = ([], self._errors) if keep_errors else (self._errors, [])
            self._confirmed = max(self._confirmed, barrier.covers)
            self._stats.lost_in_flight_bytes = barrier.lost_bytes
        if errors:
            raise TapFunctionException(errors)
        return barrier.reply

    def _wait_watched(self, barrier: _Barrier, timeout: float | None, name: str) -> Sighting | None:
        """Wait for `barrier` (up to `timeout` s), watching the daemon meanwhile: a wait
        on one that does not answer says so within seconds, and fails where nobody starts
        one on demand. Returns what the last look found if the daemon did not answer it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if barrier.done.wait(_FIRST_SLICE if timeout is None else min(timeout, _FIRST_SLICE)):
            return None
        watch = DaemonWatch(
            self.settings.endpoint,
            waiting_for=name,
            log=logger,
            fail_after=float(CONNECT_TIMEOUT.value()),
            what_then=", which stay in this process for the next daemon",
            first_look_after=FIRST_LOOK_AFTER - _FIRST_SLICE,
        )
        while True:
            left = _SLICE if deadline is None else min(deadline - time.monotonic(), _SLICE)
            if left <= 0 or barrier.done.wait(left):
                last = watch.last
                return None if last is None or last.answered else last
            watch.check(lambda: self._pending_text(barrier))

    def _pending_text(self, barrier: _Barrier) -> str:
        with self._lock:
            pending = max(0, barrier.covers - self._confirmed)
            queued = sum(1 for item in self._queue if isinstance(item, _Tap))
        where = "" if not queued else f", {queued} of them still buffered in this process"
        return f"{pending} taps{where}"

    def _submitted_locked(self) -> int:
        if self.native is not None:
            native = self.native.stats()
            return native["sent"] + native["dropped"]
        return self._stats.submitted

    def _sent_locked(self) -> int:
        return self.native.stats()["sent"] if self.native is not None else self._stats.sent

    def all_confirmed(self) -> bool:
        """True when a barrier has passed since the last tap was submitted."""
        with self._lock:
            return self._confirmed == self._submitted_locked()

    def _unknown_locked(self, sent: int) -> int:
        """Taps no daemon reported on, once all are confirmed, if a daemon restarted
        while serving us (with one daemon, its totals cover every tap it confirmed)."""
        if len(self._totals) < 2 or self._confirmed != self._submitted_locked():
            return 0
        known = self._stats.delivered + self._stats.daemon_dropped + self._stats.unrouted
        return max(0, sent - known)

    def stats(self) -> dict[str, Any]:
        """The counters (ints), and `skipped_by_consumer`: {consumer: taps skipped}."""
        with self._lock:
            stats: dict[str, Any] = self._stats.as_dict()
            skipped = dict(self._skipped)
            if self.native is not None:
                native = self.native.stats()
                stats.update(
                    submitted=native["sent"] + native["dropped"],
                    sent=native["sent"],
                    dropped=native["dropped"],
                    blocked_ns=native["blocked_ns"],
                    skipped=stats["skipped"] + native["skipped"],
                )
                for consumer, count in self.native.skipped_by_consumer().items():
                    skipped[consumer] = skipped.get(consumer, 0) + count
            stats["unknown"] = self._unknown_locked(stats["sent"])
            stats["skipped_by_consumer"] = skipped
            return stats

    def close(self, timeout: float) -> None:
        """Stop the thread; whatever is still buffered is counted as dropped and logged."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._space.notify_all()
            self._wake_locked()
        self._thread.join(timeout)

    # ---- the sender thread ------------------------------------------------------------

    def _run(self) -> None:
        sock = emitter_socket.connect(self._context, self.settings.endpoint)
        connection = EmitterSocket(sock, self._identity, time.monotonic())
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(timeout=500))
                if self._wake_read in events:
                    self._drain_wake_pipe()
                if sock in events:
                    self._receive(connection)
                if self._closing:
                    break
                self._send_ready(connection)
                self._keep_alive(connection)
        except Exception:  # a bug here must not vanish with the thread
            logger.exception("tapd sender thread failed; taps are no longer delivered")
        finally:
            self._abandon_queue()
            connection.bye()
            sock.close(linger=1000)

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _send_ready(self, connection: EmitterSocket) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    # Going idle: from now on a new tap must wake us. While we are busy,
                    # producers skip the pipe write (a syscall and a thread switch each).
                    self._wake_pending = False
                    return
                if not connection.may_send(self._queue[0].nbytes):
                    return  # credit will wake us
                item = self._queue.popleft()
                self._stats.buffered_bytes -= item.nbytes
                self._space.notify_all()
                if isinstance(item, _Tap):
                    self._stats.sent += 1
            if isinstance(item, _Barrier):
                connection.send_barrier(item.id, _barrier_fields(item))
            else:
                connection.send(_encode_tap(item, self._identity), item.nbytes)
            # Hand the GIL over between messages: an XLA thread waiting to run a tap
            # callback would otherwise wait out Python's 5 ms switch interval.
            time.sleep(0)

    def _receive(self, connection: EmitterSocket) -> None:
        for message, event in connection.receive(time.monotonic(), _malformed):
            header = message.header
            kind = message.kind
            if isinstance(event, Welcomed) and event.lost_bytes:
                logger.warning(
                    "%d bytes of taps sent to the tapd daemon never reached it "
                    "(it restarted?) and are lost",
                    event.lost_bytes,
                )
            elif isinstance(event, Refused):
                logger.error("ignoring a malformed message from the daemon: %s", event.detail)
            elif isinstance(event, (RehelloAsked, Restarted)):
                # A restarted daemon (it asked who we are, or a new one welcomed us):
                # barriers sent to the old one are lost with it, so they are asked of
                # this one, after the hello that tells it our ring.
                connection.resend_barriers()
            elif kind == "error":
                text = f"{header['consumer']}#{header['seq']}: {header['error']}"
                logger.error("tap function raised in subscriber %s: %s", header["subscriber"], text)
                with self._lock:
                    self._errors.append(text)
                    self._stats.errors += 1
            if kind in ("barrier_done", "credit") and "delivered" in header:
                self._note_totals(connection.link.daemon, header)
            if kind == "barrier_done":
                with self._lock:
                    barrier = self._barriers.pop(header["id"], None)
                if barrier is not None:
                    barrier.lost_bytes = connection.link.lost_bytes
                    barrier.reply = dict(header)
                    barrier.done.set()

    def _keep_alive(self, connection: EmitterSocket) -> None:
        """Say hello again if the daemon is silent while we wait for it: bytes in flight,
        a ring it must know of (with a ring, taps do not travel over this socket, so
        hello is how a restarted daemon learns where it is), taps queued here behind
        the window that a restarted daemon closed (no credit will come to wake us), or a
        barrier not yet answered."""
        link = connection.link
        closed = bool(self._queue) and link.window == 0 and link.daemon is not None
        # (a barrier waited for: a daemon that died holding it never answers, and the
        # next hears of us only from a hello)
        waiting = closed or "ring" in self._identity or bool(connection.barriers)
        connection.tick(time.monotonic(), waiting)

    def _note_totals(self, daemon: str | None, header: dict[str, Any]) -> None:
        """A daemon's totals for this emitter (in `barrier_done` and `credit`). Each
        daemon that served us keeps its own, so that after a restart what the old one
        finished is neither forgotten nor counted again by the new one."""
        with self._lock:
            self._totals[daemon] = (header["delivered"], header["dropped"], header["unrouted"])
            columns = zip(*self._totals.values(), strict=True)
            delivered, dropped, unrouted = (sum(column) for column in columns)
            # A ring tap one daemon finished but had not yet released is read again by
            # the next after a restart, and counted by both: a tap is delivered once.
            sent = self._sent_locked()
            self._stats.delivered = max(0, min(delivered, sent - dropped - unrouted))
            self._stats.daemon_dropped, self._stats.unrouted = dropped, unrouted

    def _abandon_queue(self) -> None:
        with self._lock:
            abandoned = sum(1 for item in self._queue if isinstance(item, _Tap))
            self._queue.clear()
            self._stats.dropped += abandoned
            self._stats.buffered_bytes = 0
            self._space.notify_all()
        if abandoned:
            logger.error(
                "tapd: %d taps were never sent to the daemon at %s and are lost",
                abandoned,
                self.settings.endpoint,
            )


def _malformed(exc: ProtocolError) -> None:
    logger.error("ignoring malformed message from the daemon: %s", exc)


def _waiting_upstream(endpoint: str) -> str | None:
    """If the daemon at `endpoint` forwards, and its upstream is where taps wait (silent,
    or holding taps unconfirmed), the end of a BarrierTimeout's message saying so."""
    try:
        forward = control.stats(endpoint, timeout=1.0).get("forward")
    except Exception:  # no answer, or none we understand: say nothing more
        return None
    if not isinstance(forward, dict) or not (forward.get("held") or forward.get("waiting")):
        return None
    upstream = f"the upstream daemon at {forward.get('endpoint')}"
    held = forward.get("held", forward.get("waiting"))
    if forward.get("upstream") is None:
        return f"waiting for {upstream}, which never answered it ({held} taps wait there)"
    silent = forward.get("silent_s", 0)
    if isinstance(silent, int | float) and silent > 2:
        return f"waiting for {upstream}, silent for {silent:.0f} s ({held} taps wait there)"
    return f"waiting for {upstream} to confirm {held} taps (is its subscriber keeping up?)"


def _barrier_fields(barrier: _Barrier) -> dict[str, Any]:
    if barrier.ring_position is None:
        return {}
    return {"ring_position": barrier.ring_position}


def _encode_tap(tap: _Tap, identity: Mapping[str, Any]) -> list[Any]:
    fields = {
        **tap.site.fields,
        "consumer": tap.site.consumer,
        "seq": tap.seq,
        "step": tap.step,
        "device": tap.device,
        "process": identity["process"],
        "host": identity["host"],
        "pid": identity["pid"],
        "time": tap.time_ns,
    }
    if tap.coords is not None:  # the site's static shard layout plus where this tap ran
        fields["shard"] = {**tap.site.fields["shard"], "coords": tap.coords}
    return encode("tap", fields, tap.arrays)
