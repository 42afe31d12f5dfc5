"""The daemon process: binds the endpoints, runs the poll loop, shuts down by drain.

Shutdown is code: `request_stop()` (SIGTERM/SIGINT, or a `shutdown` message on the local
endpoint) sets a flag; the loop keeps delivering what is queued for up to
`drain_timeout`, then counts the rest as lost and closes its sockets with a bounded
linger.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq

from tapd import security
from tapd.channel import COPY_BELOW, Channel
from tapd.config import Config
from tapd.daemon.bounds import DepartedEmitters, ReplyBudget, configure_listener
from tapd.daemon.forward import Forwarder
from tapd.daemon.idle import IdleExit
from tapd.daemon.metrics import MetricsServer, Snapshots
from tapd.daemon.rings import RingSet
from tapd.daemon.router import Router
from tapd.daemon.targets.shm import RingReaders
from tapd.daemon.wants import WantsTable
from tapd.errors import ALREADY_RUNNING, SERVING, DaemonAlreadyRunning, ProtocolError
from tapd.protocol import Limits, decode, encode
from tapd.runtime import ensure_private_dir, pid_alive, ring_dir_for

logger = logging.getLogger("tapd.daemon")

_BATCH = 256  # messages read from one socket before looking at the others
_EXPIRE_EVERY = 0.5
_IDLE_POLL_MS = 500  # an idle daemon with rings attached: writers wake it sooner
# A round that read fewer taps than this from the rings waits `coalesce` before the next.
# At a few thousand taps a second a round passes on one or two, and each one's message,
# its subscriber's ack and the wake-ups cost ~110-160 µs of daemon CPU a tap on the
# 2-core benchmark box; with 2 ms rounds, ~40 (`bench/per_call.py coalesce`;
# bench/RESULTS.md §11).
# Rounds of more taps are already that efficient, and waiting would only cap a stream.
_FEW_TAPS = 256


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._context = zmq.Context()
        self._channels: list[Channel] = []  # the bound sockets, by index (peer keys)
        # A plain flag, no threading.Event: a signal handler sets it, and Event.set takes
        # a lock that a second signal, landing inside the first handler, waits on forever.
        self._stopping = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._wake_lock = threading.Lock()  # a wake from a scrape thread vs. close()
        self.limits = Limits(max_message_bytes=config.max_message_bytes)
        self.router = Router(
            self._send,
            policy=config.policy,
            queue_bytes=config.queue_bytes,
            window_bytes=config.emitter_window_bytes,
            daemon_id=self.id,
        )
        self.endpoints: list[str] = []
        self.zap: security.ZapHandler | None = None
        self.handshakes: list[security.HandshakeMonitor] = []
        self._lock_fds: list[int] = []
        self.rings = RingSet(ring_dir_for(config.endpoint))
        self.wants = WantsTable(self.router, self.rings, config.dormant, config.wake_ack_timeout)
        self.router.subscribers.rings = RingReaders.for_daemon(self.rings, config.policy)
        self.forwarder: Forwarder | None = None
        self.metrics: MetricsServer | None = None  # --metrics
        self.snapshots = Snapshots(self._wake_for_scrape)
        self.replies = ReplyBudget()  # errors sent back for refused messages, per peer
        self.departed = DepartedEmitters(self._send)

    # ---- lifecycle ------------------------------------------------------------------

    def bind(self) -> list[str]:
        """Bind the local endpoint (and the tcp one if configured), connect to the
        upstream if forwarding; return the real addresses (port 0 resolved)."""
        endpoints = [self.config.endpoint] + ([self.config.tcp] if self.config.tcp else [])
        for endpoint in endpoints:
            if endpoint.startswith("ipc://"):
                path = endpoint.removeprefix("ipc://")
                ensure_private_dir(Path(path).parent)
                try:
                    self._lock_fds.append(_lock_endpoint(path))
                    _remove_stale_socket(path)
                except OSError:
                    self.close()
                    raise
            sock = self._context.socket(zmq.ROUTER)
            configure_listener(sock, self.limits)
            if endpoint.startswith("tcp://") and not self.config.insecure:
                self._secure(sock)
                self.handshakes.append(security.HandshakeMonitor(sock))
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                self.close()
                raise OSError(f"cannot bind {endpoint}: {exc}") from exc
            self._channels.append(Channel(sock, endpoint, copy_below=COPY_BELOW))
            self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        if self.config.policy == "spool":
            try:
                _open_spools(self.config, self.router)
            except Exception:
                self.close()
                raise
        if self.config.tcp and self.config.insecure:
            logger.warning(
                "listening on %s WITHOUT authentication or encryption: anyone who can reach "
                "it can send taps and read them. Use it only on a trusted network.",
                self.endpoints[-1],
            )
        if self.config.forward:
            if self.config.forward.startswith("tcp://") and self.config.insecure:
                logger.warning(
                    "forwarding to %s WITHOUT authentication or encryption", self.config.forward
                )
            try:
                self.forwarder = Forwarder(self._context, self.config, self.router, self.id)
            except Exception:
                self.close()
                raise
        if self.config.metrics:
            try:
                self.metrics = MetricsServer(self.config.metrics, self.snapshots)
            except Exception:
                self.close()
                raise
            logger.info("serving Prometheus metrics at %s", self.metrics.url)
        return self.endpoints

    def _secure(self, sock: zmq.Socket[Any]) -> None:
        assert self.config.curve_secret_key and self.config.curve_allowed
        if self.zap is None:
            allowed = security.load_allowed(self.config.curve_allowed)
            self.zap = security.ZapHandler(self._context, allowed)
            logger.info(
                "CurveZMQ on the tcp endpoint: %d allowed peer key(s) from %s",
                len(allowed),
                self.config.curve_allowed,
            )
        security.make_server(sock, self.config.curve_secret_key)

    def request_stop(self) -> None:
        """Safe from signal handlers (nested ones too: it takes no lock) and other
        threads."""
        self._stopping = True
        self._wake()

    def _wake(self) -> None:
        """Wake the loop's poll. No lock: a signal handler runs on the thread that
        may hold it, in close()."""
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):  # a full pipe wakes it anyway; closed: gone
            pass

    def _wake_for_scrape(self) -> None:
        """`_wake` from an HTTP thread of --metrics, which may outlive close()."""
        with self._wake_lock:
            if self._wake_write >= 0:  # (once closed, its number may be another file's)
                self._wake()

    def stats(self) -> dict[str, Any]:
        """What `tapd status --json` shows (on the loop's thread only)."""
        stats = {
            **self.wants.stats(self.router.stats()),  # (with the taps emitters skipped)
            "rings": self.rings.stats(),
            "daemon": self.id,
            "pid": os.getpid(),
        }
        stats["started"] = self.config.how_started()
        bounds = {"reply_budgets": len(self.replies), "departed_emitters": self.departed.forgotten}
        stats["bounds"] = bounds  # per-peer tables beside the router's (tapd/daemon/bounds.py)
        if self.forwarder is not None:
            stats["forward"] = self.forwarder.stats()
        if self.metrics is not None:
            stats["metrics"] = self.metrics.url
        return stats

    def serve(self, on_ready: Callable[[list[str]], None] | None = None) -> None:
        if not self._channels:
            self.bind()
        poller = zmq.Poller()
        for channel in self._channels:
            poller.register(channel.socket, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        if self.zap is not None:
            poller.register(self.zap.socket, zmq.POLLIN)
        for monitor in self.handshakes:
            poller.register(monitor.socket, zmq.POLLIN)
        forwarder = self.forwarder
        if forwarder is not None:
            poller.register(forwarder.socket, zmq.POLLIN)
        wake = self.rings.start(self.config.endpoint, self.router)
        if wake is not None:  # (by fd: zmq.Poller reports plain sockets by fd)
            poller.register(wake.fileno(), zmq.POLLIN)
        # Ready only now: an emitter that connects finds the ring directory claimed and
        # the wake socket open.
        logger.info(
            "tapd daemon %s %s %s (policy %s)",
            self.id,
            SERVING,
            ", ".join(self.endpoints),
            self.config.policy,
        )
        if on_ready is not None:
            on_ready(self.endpoints)
        last_check = time.monotonic()
        rings_from = last_check + self.config.startup_grace
        # Taps no subscriber wants yet wait as long: subscribers of a daemon that was
        # down reconnect, and forwarders send what they held for it (docs/PROTOCOL.md).
        self.router.hold_unrouted_until = rings_from
        drain_deadline: float | None = None
        idle_exit = IdleExit(self.config.idle_limit, last_check)
        quiet_rounds = 0
        coalesce_next = False
        try:
            while True:
                if coalesce_next:
                    time.sleep(self.config.coalesce)
                events = dict(poller.poll(timeout=self._poll_timeout(quiet_rounds)))
                for index, channel in enumerate(self._channels):
                    if channel.socket in events:
                        self._read(index, channel)
                if self._wake_read in events:
                    _drain_pipe(self._wake_read)
                if wake is not None and wake.fileno() in events:
                    wake.drain()
                if self.zap is not None and self.zap.socket in events:
                    self.zap.handle()
                for monitor in self.handshakes:
                    if monitor.socket in events:
                        monitor.handle()
                if self.zap is not None:
                    refused = self.zap.refused + sum(m.refused for m in self.handshakes)
                    more = refused - self.router.counters["auth_refused"]
                    if more > 0:  # (a running total of the handlers')
                        self.router.ledger.count("auth_refused", more)
                now = time.monotonic()
                if forwarder is not None and forwarder.socket in events:
                    forwarder.receive(now)
                if now - last_check > _EXPIRE_EVERY:
                    self.router.expire(now, self.config.subscriber_timeout)
                    self.rings.check_writers(self.router)
                    self.rings.read_new_sites()
                    self.router.forget_dead_emitters(pid_alive, self.rings.sources)
                    self.departed.check(self.router, self.rings.sources, now)
                    self.replies.forget(self.router.emitters)
                    last_check = now
                self.router.unpark()
                moved = self.rings.poll(self.router) if now >= rings_from else 0
                self.wants.update()
                self.router.subscribers.send_welcomes(unless=self.wants.awaiting)
                quiet_rounds = 0 if moved or events else quiet_rounds + 1
                coalesce_next = 0 < moved < _FEW_TAPS and self.config.coalesce > 0
                self.router.subscribers.pump()
                if forwarder is not None:
                    forwarder.flush(now)
                self.router.flush_credit()
                self.snapshots.answer(self.stats)  # scrapes of --metrics, if any wait
                if not self._stopping and idle_exit.due(self._has_clients(), now):
                    logger.info(
                        "no emitters and no subscribers for %g s: stopping", idle_exit.limit
                    )
                    self._stopping = True
                if self._stopping:
                    if drain_deadline is None:
                        drain_deadline = now + self.config.drain_timeout
                        logger.info("stopping: draining for up to %g s", self.config.drain_timeout)
                    if (self.router.idle() and self.rings.idle()) or now >= drain_deadline:
                        break
        finally:
            self._report_undelivered()
            self.close()

    def _has_clients(self) -> bool:
        router = self.router
        return (
            bool(router.emitters or router.subscribers.peers or self.rings.sources)
            or not router.idle()
        )

    def _poll_timeout(self, quiet_rounds: int) -> int:
        """Milliseconds to wait for a socket. Rings have no file descriptor to wait on:
        after activity the loop looks at them again at once, then every millisecond for
        a while; once quiet, it asks their writers to wake it (`wake.sock`) and sleeps
        (bounded, for the periodic checks)."""
        if self.router.subscribers.welcomes_due():  # (held for a wake's acknowledgment)
            return 1
        if not self.rings.sources:
            return 100
        if quiet_rounds == 0:
            return 0
        if quiet_rounds < 50:
            return 1
        # Records readable but not taken (queues full under "block", a site entry not
        # yet written): look again in a millisecond, never spin.
        return _IDLE_POLL_MS if self.rings.sleep() else 1

    def _report_undelivered(self) -> None:
        self.wants.release()  # a clean exit: every tap is sent again, for the next daemon
        self.router.stop_releasing()  # what rings still hold stays for the next daemon
        self.router.subscribers.close_spools()  # what is spooled stays for the next daemon
        self.router.subscribers.drop_all("was still connected at shutdown")
        try:  # emitters learn the final totals (they outlive this daemon, maybe)
            self.router.flush_credit(final=True)
        except zmq.ZMQError:
            pass
        parked = self.router.parked_taps()
        if parked:
            logger.error(
                "%d taps were still waiting for queue room at shutdown and are lost", parked
            )
        logger.info("tapd daemon stopped: %s", dict(self.router.counters))

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.snapshots.refuse()
        if self.forwarder is not None:
            self.forwarder.close()
            self.forwarder = None
        if self.zap is not None:
            self.zap.close()
        for monitor in self.handshakes:
            monitor.close()
        self.handshakes.clear()
        for channel in self._channels:
            channel.close(linger=1000)
        self._channels.clear()
        for endpoint in self.endpoints:
            if endpoint.startswith("ipc://"):  # libzmq leaves the socket file behind
                Path(endpoint.removeprefix("ipc://")).unlink(missing_ok=True)
        self._context.term()
        # Only now: until the sockets are gone, ZeroMQ may still be sending ring memory.
        # And before the lock goes: the next daemon's start must not meet our tidying.
        self.rings.close()
        for fd in self._lock_fds:
            os.close(fd)  # (the lock file stays: removing it would race a new daemon)
        self._lock_fds.clear()
        with self._wake_lock:
            for fd in (self._wake_read, self._wake_write):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_read = self._wake_write = -1

    # ---- messages -------------------------------------------------------------------

    def _send(self, key: Any, frames: list[Any]) -> bool:
        index, identity = key
        if not isinstance(index, int):  # an orphaned ring's emitter: no peer to tell
            return False
        try:
            self._channels[index].send([identity, *frames], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def _read(self, index: int, channel: Channel) -> None:
        now = time.monotonic()
        for _ in range(_BATCH):
            frames = channel.recv()
            if frames is None:
                return
            key = (index, frames[0].bytes)
            try:
                message = decode(frames[1:], self.limits)
            except ProtocolError as exc:
                self._rejected(key, frames[1:], exc)
                continue
            try:
                self._dispatch(key, index, message, now)
            except Exception as exc:  # a bug must not take every other peer down with it
                first = self.router.counters["rejected_internal_error"] == 0
                self.router.reject("internal_error", f"{message.kind!r} message: {exc!r}")
                if first:
                    logger.exception("handling a %r message failed", message.kind)

    def _rejected(self, key: Any, frames: list[Any], exc: ProtocolError) -> None:
        """Count a message that broke the protocol. If its sender is an emitter we know,
        tell it (as an `error`, which its barrier_wait raises) and credit back the
        array bytes it spent on it, so that its window does not shrink for good."""
        self.router.reject(exc.reason, str(exc))
        if key not in self.router.emitters:
            return
        consumer, seq, is_tap = _named_in(frames, self.limits)
        error = f"the tapd daemon rejected a message from this emitter: {exc}"[:4000]
        credit = sum(len(f) for f in frames[2:]) if is_tap else 0
        report = self.replies.allow(key, time.monotonic())  # past its share: only counted
        self.router.ledger.refused(
            key, consumer, seq, error, credit_bytes=credit, tap=is_tap, report=report
        )

    def _dispatch(self, key: Any, index: int, message: Any, now: float) -> None:
        router = self.router
        header = message.header
        kind = message.kind
        if kind == "tap":
            router.tap(key, message)
        elif kind == "ack":
            router.subscribers.ack(key, header, now)
        elif kind == "heartbeat":
            router.subscribers.heartbeat(key, now)
        elif kind == "hello":  # (decode checked the fields of its role: schema.py)
            if header["role"] == "emitter":
                router.emitter_hello(key, header)
                if "ring" in header:
                    self.rings.attach(key, header, router)
            else:
                router.subscribers.hello(key, header, now)
        elif kind == "barrier":
            position = header.get("ring_position")
            if not (
                isinstance(position, int)
                and self.rings.barrier(key, header["id"], position, router)
            ):
                router.barrier(key, header["id"])
        elif kind == "bye":
            router.subscribers.drop(key, "said goodbye")
            if key not in self.rings.sources:  # a ring's lifetime is its writer's
                router.emitter_bye(key)
        elif kind == "stats":
            self._send(key, encode("stats_reply", {"stats": self.stats()}))
        elif kind == "shutdown":
            if index == 0 and self.config.endpoint.startswith("ipc://"):
                logger.info("shutdown requested over the local endpoint")
                self.request_stop()
            else:
                router.reject("forbidden", "shutdown is accepted on the local ipc endpoint only")
        else:
            router.reject("bad_header", f"{kind!r} is not something peers send to a daemon")


def _open_spools(config: Config, router: Router) -> None:
    """Policy "spool": where full queues spill, and the logs an earlier daemon left.
    Only once this daemon holds the endpoint's lock: a second daemon, refused, must not
    read (and tidy: an empty segment is removed) the logs the first is writing."""
    spool_dir = config.spool_dir or spool_dir_for(config.endpoint)
    ensure_private_dir(spool_dir)
    router.subscribers.configure_spool(spool_dir, config.spool_bytes, config.spool_fallback)


def _lock_endpoint(path: str) -> int:
    """Take `<socket>.lock` beside the socket for as long as this daemon runs: of two
    daemons started at once for one endpoint, exactly one gets it (the other would
    otherwise bind over the first, and both would drain the same rings)."""
    lock_path = f"{path}.lock"
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OSError(f"cannot open the lock file {lock_path}: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonAlreadyRunning(
            f"{ALREADY_RUNNING} for ipc://{path} (it holds {lock_path})"
        ) from None
    return fd


def spool_dir_for(endpoint: str) -> Path:
    """The default --spool-dir: on disk (the runtime directory may be in memory), one per
    endpoint, so that a daemon restarted on it finds what it left."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tapd" / "spool" / hashlib.sha256(endpoint.encode()).hexdigest()[:12]


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file left by a daemon that died. Called with the endpoint's lock
    held (`_lock_endpoint`), which every daemon holds while it serves: whether another
    daemon runs there is the lock's to say, so a socket file found here is stale."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _drain_pipe(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _named_in(frames: list[Any], limits: Limits) -> tuple[str, int, bool]:
    """A best effort at naming what a refused message was: its consumer ("?"), seq (-1)
    and whether it was a tap, from a header that may be anything."""
    consumer, seq, is_tap = "?", -1, False
    if len(frames) >= 2 and len(frames[1]) <= 4 * limits.max_header_bytes:
        try:
            header = msgpack.unpackb(frames[1].buffer, raw=False, strict_map_key=False)
        except Exception:  # only a best effort
            header = None
        if isinstance(header, dict):
            is_tap = header.get("kind") == "tap"
            if isinstance(header.get("consumer"), str):
                consumer = header["consumer"][: limits.max_name]
            if type(header.get("seq")) is int:
                seq = header["seq"]
    return consumer, seq, is_tap
