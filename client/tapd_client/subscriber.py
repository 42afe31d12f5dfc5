"""`Subscriber`: connect to one or more daemons, receive taps, run handlers, ack them.

Each daemon sends at most `window` taps this subscriber has not acknowledged; handlers
run one at a time, in arrival order per daemon, on the thread that called `run()`. Acks
go back in batches (when the receive queue runs dry, or every half window), carrying
the text of any handler exception so that the emitter's `barrier_wait()` raises it.
A subscriber given several endpoints (one daemon per host of a multi-host job) keeps
one connection, with its own delivery ids and acks, per daemon.

A *batch* handler (`on(name, batch=True)`, or a handler object whose class says
`takes_batch = True`) is called once per site per received message, with a `TapBatch`
of that site's taps in it: the leaves stacked, the meta as columns, in seq order. It
runs where the site's first tap is in the message, so its taps may be handled before
other consumers' taps that arrived between them. It costs far less per tap than a
per-tap handler (bench/RESULTS.md, section 2), so sinks and recorders use it.

A *fallback* handler (`add_handler(..., fallback=True)`, with `fallback_for` naming an
emitter "host:pid") gets that emitter's taps of its consumer only while no other
subscriber takes them: how a JAX process runs its own id_tap functions when no
subscriber process does (docs/PROTOCOL.md, "hello").
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, cast

import msgpack
import zmq

from tapd.autostart import ensure_daemon
from tapd.consumers import MAX_NAME, first_match
from tapd.errors import ConfigError, ProtocolError, TapdError
from tapd.protocol import Message, decode, encode
from tapd.protocol.batch import SiteRun
from tapd.security import ClientKeys, secure_client
from tapd.settings import ENDPOINT
from tapd_client.batch import TapBatch, batch_of_runs, batch_of_tap
from tapd_client.meta import MetaTemplate, TapMeta
from tapd_client.sampling import Sampling
from tapd_client.shm import RingReader, RingReadError, ring_directory, ring_offer

logger = logging.getLogger("tapd.subscriber")

Handler = Callable[[Any, TapMeta], object]
BatchHandler = Callable[[TapBatch], object]


# After a hello, rehellos are not answered for this long: they are the daemon's answers
# to messages sent before it (e.g. the acks and heartbeats of a subscriber whose daemon
# restarted), and each answered with a hello made a storm of them.
_REHELLO_QUIET = 1.0
_ERROR_CHARS = 4000  # of an error's text sent back (the protocol allows 8192)
# Default windows. A batch handler's cost is per message more than per tap: with 4096
# in flight the daemon sends up to 2048 small taps a message (bench/RESULTS.md, 2).
_WINDOW = 256
_BATCH_WINDOW = 4096


class _DaemonLink:
    """The connection to one daemon: its socket and its delivery ids and acks.

    Nothing here ever blocks on the daemon: the socket sends only to a connected daemon
    (ZMQ_IMMEDIATE) and never waits for room, so that a daemon that is gone, or slow,
    cannot make the subscriber deaf to stop() and SIGTERM. What could not be sent is
    sent later (acks and errors are kept until they go; a hello is retried)."""

    def __init__(
        self, endpoint: str, sock: zmq.Socket[Any], rings: RingReader | None = None
    ) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.rings = rings  # where it may read ring taps (tapd_client/shm.py), if anywhere
        self.welcomed = False
        self.last_tid = -1
        self.acked_tid = -1
        self.errors: list[dict[str, Any]] = []
        self.last_sent = 0.0
        self.hello_sent = -_REHELLO_QUIET  # when the last hello went out
        self.hello_due: dict[str, Any] | None = None  # a hello still to send

    def send(self, frames: list[Any]) -> bool:
        """Send now, or not at all (False): never wait for the daemon."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.last_sent = time.monotonic()
        return True

    def hello(self, fields: dict[str, Any]) -> None:
        self.last_tid = self.acked_tid = -1  # delivery ids are per daemon incarnation
        self.errors = []
        offer = ring_offer(self.rings.directory) if self.rings is not None else None
        self.hello_due = fields if offer is None else {**fields, "rings": offer}
        self.send_hello()

    def send_hello(self) -> None:
        if self.hello_due is not None and self.send(encode("hello", self.hello_due)):
            self.hello_due = None
            self.hello_sent = time.monotonic()

    def rehello_wanted(self) -> bool:
        """A rehello deserves a hello only if none went out just before it."""
        return time.monotonic() - self.hello_sent >= _REHELLO_QUIET

    def receive(self) -> Message | None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(frames)
        except ProtocolError as exc:
            self._refuse(frames, exc)
            return None

    def _refuse(self, frames: list[Any], exc: ProtocolError) -> None:
        """A message from the daemon that does not decode. If it carries taps (their
        delivery ids are readable), acknowledge them with the reason as their error, so
        that the emitter's barrier_wait raises instead of waiting for them for ever."""
        tids = _delivery_ids(frames)
        tids = [t for t in tids if t > self.last_tid]
        logger.error(
            "refused a malformed message from the daemon at %s (%d taps, "
            "acknowledged as failed): %s",
            self.endpoint,
            len(tids),
            exc,
        )
        for tid in tids:
            text = f"the subscriber could not decode this tap: {exc}"
            self.errors.append({"tid": tid, "error": text[:_ERROR_CHARS]})
        if tids:
            self.last_tid = max(tids)

    def ack(self) -> None:
        fields = {"upto": self.last_tid, "errors": self.errors}
        if self.last_tid > self.acked_tid and self.send(encode("ack", fields)):
            self.acked_tid = self.last_tid
            self.errors = []

    def keep_alive(self, heartbeat: float) -> None:
        self.send_hello()
        if self.rings is not None:
            self.rings.tidy()
        if time.monotonic() - self.last_sent > heartbeat:
            self.send(encode("heartbeat", {}))

    def close(self) -> None:
        self.ack()
        self.send(encode("bye", {}))
        self.sock.close(linger=1000)
        if self.rings is not None:
            self.rings.close()


def _delivery_ids(frames: list[Any]) -> list[int]:
    """The delivery ids a message that failed to decode names, read as leniently as
    msgpack allows: a `tap`'s `tid`, a `taps` batch's rows' tids."""
    if len(frames) < 2:
        return []
    raw = getattr(frames[1], "buffer", frames[1])
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # (msgpack raises several unrelated types)
        return []
    if not isinstance(header, dict):
        return []
    if header.get("kind") == "tap":
        tid = header.get("tid")
        return [tid] if type(tid) is int else []
    if header.get("kind") == "taps" and isinstance(header.get("taps"), list):
        rows = header["taps"]
        return sorted(
            {r[1] for r in rows if isinstance(r, list) and len(r) > 1 and type(r[1]) is int}
        )
    return []


class Subscriber:
    """Receives the taps of the consumers it has handlers for.

    `endpoint`: the daemon's address, or a list of them (default: this host's daemon,
    `TAPD_ENDPOINT` or the per-user ipc socket). `window`: taps in flight per daemon
    before it waits for acks (default 256, or 4096 with a batch handler: bigger batches
    of small taps, fewer messages; the daemon bounds the bytes in flight too). `curve`:
    keys for tcp:// daemons (default: from TAPD_CURVE_SERVER_KEY and TAPD_CURVE_SECRET).
    `group`: a worker pool's name; the subscribers of one group with the same consumers
    share their taps, each tap going to one of them (docs/PROTOCOL.md, "Worker pools").
    `shm`: read large taps of a daemon on this host from the emitter's shared memory
    (default: TAPD_SHM_SUBSCRIBERS, on); the handler gets a copy in this process's
    memory either way. `views`: it gets read-only views of that shared memory instead,
    valid only during its call (keep nothing of them; see tapd_client/shm.py).
    """

    def __init__(
        self,
        endpoint: str | Sequence[str] | None = None,
        *,
        name: str | None = None,
        window: int | None = None,
        heartbeat: float = 1.0,
        curve: ClientKeys | None = None,
        fallback_for: str | None = None,
        group: str | None = None,
        shm: bool | None = None,
        views: bool = False,
    ) -> None:
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        if group is not None and not 0 < len(group) <= MAX_NAME:  # the protocol's name bound
            raise ValueError(f"a group name has 1 to {MAX_NAME} characters, got {group!r:.300}")
        if isinstance(endpoint, str) or endpoint is None:
            endpoints = [endpoint or ENDPOINT.value()]
        else:
            endpoints = list(endpoint)
        if not endpoints:
            raise ValueError("give at least one endpoint")
        self.endpoints = endpoints
        self.endpoint = endpoints[0]
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self._window = window
        self.heartbeat = heartbeat
        self.curve = curve
        self._handlers: dict[str, Handler | BatchHandler] = {}
        self._batch: set[str] = set()  # consumers whose handlers take TapBatches
        self.fallback_for = fallback_for  # the emitter whose unwanted taps fallbacks take
        self.group = group
        self._fallback: set[str] = set()  # consumers whose handlers are fallbacks
        self._every = Sampling()  # consumers whose handlers sample: `every`
        self._stop = threading.Event()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._links: list[_DaemonLink] = []
        self.processed = 0
        self.failed = 0
        self.shm = shm
        self.views = views
        self.ring_taps = 0  # taps read from a ring, not received as bytes

    # ---- registration -----------------------------------------------------------

    def on(self, consumer: str, *, batch: bool = False, every: int = 1) -> Callable[[Any], Any]:
        """Decorator: run the function for taps named `consumer`. A name ending in `*`
        matches by prefix (`"mymodule:*"`). With `batch`, the function gets a `TapBatch`
        of each site's taps in a received message instead of `(value, meta)` per tap.
        `every=n`: only the taps whose `meta.seq` is a multiple of n (times the site's
        own `every`); the emitter copies no others unless someone else wants them."""

        def register(handler: Any) -> Any:
            self.add_handler(consumer, handler, batch=batch, every=every)
            return handler

        return register

    def add_handler(
        self,
        consumer: str,
        handler: Handler | BatchHandler,
        *,
        fallback: bool = False,
        batch: bool | None = None,
        every: int = 1,
    ) -> None:
        """Run `handler` for taps named `consumer`. With `fallback`, only for taps of the
        emitter `fallback_for` that no other subscriber takes. `batch`: it takes a
        `TapBatch` (default: what the handler's `takes_batch` attribute says). `every`:
        as for `on`."""
        if self._links:
            raise RuntimeError("add handlers before connecting (or use subscribe())")
        self._add(consumer, handler, fallback, batch, every)

    def _add(
        self,
        consumer: str,
        handler: Handler | BatchHandler,
        fallback: bool,
        batch: bool | None,
        every: int = 1,
    ) -> None:
        if consumer in self._handlers:
            raise ValueError(f"consumer {consumer!r} already has a handler")
        self._every.add(consumer, every)
        if fallback and self.fallback_for is None:
            raise ValueError("a fallback handler needs Subscriber(fallback_for=...)")
        self._handlers[consumer] = handler
        if getattr(handler, "takes_batch", False) if batch is None else batch:
            self._batch.add(consumer)
        if fallback:
            self._fallback.add(consumer)

    def subscribe(
        self,
        consumer: str,
        handler: Handler | BatchHandler,
        *,
        fallback: bool = False,
        batch: bool | None = None,
        timeout: float = 10.0,
        every: int = 1,
    ) -> None:
        """Add a handler to a connected subscriber: every daemon is told the new set of
        consumers (taps in flight stay in flight) and confirms before this returns.
        Call it from the thread that runs the subscriber, between `run()` calls."""
        if not self._links:
            self.add_handler(consumer, handler, fallback=fallback, batch=batch, every=every)
            return
        self._add(consumer, handler, fallback, batch, every)
        for link in self._links:
            link.welcomed = False
            link.hello_due = {**self._hello_fields(), "update": True}  # (sent when it can be)
            link.send_hello()
        self._wait_welcomed(timeout)

    @property
    def window(self) -> int:
        """Taps in flight per daemon: as given, else by the kind of handlers."""
        if self._window is not None:
            return self._window
        return _BATCH_WINDOW if self._batch else _WINDOW

    @property
    def consumers(self) -> list[str]:
        return list(self._handlers)

    # ---- lifecycle --------------------------------------------------------------

    def connect(self, timeout: float = 10.0) -> None:
        """Subscribe to every daemon and wait until each confirms (so taps emitted after
        this returns reach us). Raises TimeoutError naming the daemons that did not."""
        if not self._handlers:
            raise ValueError("no handlers: register some with @subscriber.on(name) first")
        if not self._links:
            for endpoint in self.endpoints:
                ensure_daemon(endpoint)  # this user's default endpoint: start one if none
                sock = self._context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a daemon not there
                try:
                    secure_client(sock, endpoint, self.curve)  # (checks an ipc directory)
                    sock.connect(endpoint)
                except BaseException:
                    sock.close(linger=0)
                    raise
                directory = ring_directory(endpoint, self.shm)
                rings = None if directory is None else RingReader(directory)
                self._links.append(_DaemonLink(endpoint, sock, rings))
        for link in self._links:
            link.welcomed = False
            link.hello(self._hello_fields())
        self._wait_welcomed(timeout)

    def _wait_welcomed(self, timeout: float) -> None:
        poller = self._poller()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(link.welcomed for link in self._links):
                logger.info(
                    "subscribed to %s at %s", ", ".join(self._handlers), ", ".join(self.endpoints)
                )
                return
            # A hello not out yet waits for the connection (IMMEDIATE): look again soon,
            # so that attaching to a running job takes milliseconds, not a poll period.
            due = any(link.hello_due is not None for link in self._links)
            for link in self._ready(poller, 2 if due else 100):
                while (message := link.receive()) is not None:
                    self._handle(link, message)
            for link in self._links:
                link.send_hello()  # (one that could not go out before the connection)
        silent = [link.endpoint for link in self._links if not link.welcomed]
        raise TimeoutError(
            f"no tapd daemon answered at {', '.join(silent)} within {timeout} s "
            "(start one with `tapd start`)"
        )

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """Receive and handle taps until `stop()` is called (or `until()` is true)."""
        if not self._links:
            self.connect()
        poller = self._poller()
        half_window = max(1, self.window // 2)
        while not self._stop.is_set() and not (until is not None and until()):
            for link in self._ready(poller, int(self.heartbeat * 500)):
                for _ in range(self.window):
                    message = link.receive()
                    if message is None:
                        break
                    self._handle(link, message)
                    if link.last_tid - link.acked_tid >= half_window:
                        link.ack()
            for link in self._links:
                link.ack()
                link.keep_alive(self.heartbeat)
            for handler in self._handlers.values():  # e.g. Assembler: report stale steps
                expire = getattr(handler, "expire", None)
                if callable(expire):
                    expire()

    def stop(self) -> None:
        """Make `run()` return; safe from other threads and signal handlers."""
        self._stop.set()

    def close(self) -> None:
        for link in self._links:
            link.close()
        self._links = []

    def __enter__(self) -> Subscriber:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------

    def _hello_fields(self) -> dict[str, Any]:
        fields = {
            "role": "subscriber",
            "consumers": list(self._handlers),
            "window": self.window,
            "name": self.name,
            "batch": True,
        }
        if self._fallback:  # which of `consumers` are fallbacks, and for whom
            fields.update(fallback=sorted(self._fallback), fallback_for=self.fallback_for)
        if self.group is not None:
            fields["group"] = self.group
        self._every.add_to(fields)
        return fields

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for link in self._links:
            poller.register(link.sock, zmq.POLLIN)
        return poller

    def _ready(self, poller: zmq.Poller, timeout_ms: int) -> list[_DaemonLink]:
        events = dict(poller.poll(timeout_ms))
        return [link for link in self._links if link.sock in events]

    def _handle(self, link: _DaemonLink, message: Message) -> None:
        kind = message.kind
        if kind == "tap":
            self._run_handler(link, message)
        elif kind == "ring_tap":  # its bytes are in the emitter's ring
            self._run_ring_tap(link, message.header)
        elif kind == "taps":  # small taps, several per message
            self._handle_taps(link, message.runs)
        elif kind == "welcome":
            link.welcomed = True
        elif kind == "rehello" and link.rehello_wanted():  # a daemon that does not know us
            logger.warning("daemon at %s asked us to subscribe again", link.endpoint)
            link.hello(self._hello_fields())

    def _handle_taps(self, link: _DaemonLink, runs: Sequence[SiteRun]) -> None:
        """A `taps` message's taps, in order; a batch handler gets all the taps of one
        site in the message as one batch, where the site's first tap is."""
        templates: dict[int, MetaTemplate | None] = {}  # by static entry, for this message
        batched: set[int] = set()  # static entries whose batch has run
        for i, run in enumerate(runs):
            key = id(run.static)
            if key not in templates:
                try:
                    templates[key] = MetaTemplate(run.header(0))
                except Exception:  # odd metadata: reported per tap, or per batch
                    templates[key] = None
            pattern = self._pattern_for(run.fields["consumer"])
            if pattern not in self._batch:
                self._run_handlers(link, run, pattern, templates[key])
            elif key not in batched:
                batched.add(key)
                same_site = [r for r in runs[i:] if r.static is run.static]
                self._run_batch(link, same_site, pattern, templates[key])

    def _run_handler(
        self,
        link: _DaemonLink,
        message: Message,
        template: MetaTemplate | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Run the tap's handler; `check`, after it returns, says whether what it read
        was intact (views of a ring): a tap that fails it is one failure, reported once."""
        header = message.header
        tid = header.get("tid")
        if not isinstance(tid, int):
            logger.error("tap from the daemon at %s without a delivery id; ignored", link.endpoint)
            return
        link.last_tid = max(link.last_tid, tid)  # (a batch may have handled later ones)
        consumer = header["consumer"]
        pattern = self._pattern_for(consumer)
        if pattern in self._batch:
            self._run_batch(link, message, pattern, template)
            return
        if pattern is not None and not self._every.keeps(pattern, header):
            return  # sampled out: the daemon thins these, save a run it routed whole
        handler = None if pattern is None else cast(Handler, self._handlers[pattern])
        try:
            if handler is None:
                raise TapdError(f"no handler here for consumer {consumer!r}")
            meta = TapMeta.from_header(header) if template is None else template.meta(header)
            handler(message.value(), meta)
            if check is not None:
                check()
            self.processed += 1
        except Exception as exc:
            self._failed(link, handler, tid, consumer, header["seq"], exc)

    def _run_handlers(
        self, link: _DaemonLink, run: SiteRun, pattern: str | None, template: MetaTemplate | None
    ) -> None:
        """A per-tap handler on each tap of a run, in order: what `_run_handler` does per
        tap, with what the run's taps share looked up once (the small-tap hot path)."""
        values = None
        if pattern is not None and template is not None:
            try:
                values = run.values()
            except Exception:  # (odd leaves: each tap reports its own error below)
                pass
        if pattern is None or template is None or values is None:
            for tap in range(len(run)):  # each tap fails on its own, as it says
                self._run_handler(link, run.message(tap), template)
            return
        handler = cast(Handler, self._handlers[pattern])
        rows = run.rows  # [static, tid, seq, step, device, time, coords, frame, offset]
        link.last_tid = max(link.last_tid, max(row[1] for row in rows))
        every = self._every.modulus(pattern, run.fields)
        for row, value in zip(rows, values, strict=True):
            seq = row[2]
            if seq % every:
                continue  # sampled out (see `_run_handler`)
            try:
                handler(value, template.meta_of(seq, row[3], row[4], row[5], row[6]))
                self.processed += 1
            except Exception as exc:
                self._failed(link, handler, row[1], template.consumer, seq, exc)

    def _failed(
        self, link: _DaemonLink, handler: Any, tid: int, consumer: str, seq: Any, exc: Exception
    ) -> None:
        """A handler raised: logged here, and its text goes back with the ack."""
        self.failed += 1
        name = getattr(handler, "__qualname__", repr(handler))
        logger.error(
            "handler %s for %r (seq %s) raised:\n%s",
            name,
            consumer,
            seq,
            traceback.format_exc(),
        )
        link.errors.append({"tid": tid, "error": f"{name} raised {exc!r}"[:_ERROR_CHARS]})

    def _run_ring_tap(self, link: _DaemonLink, header: dict[str, Any]) -> None:
        tid = header.get("tid")
        if type(tid) is not int:
            logger.error("tap from the daemon at %s without a delivery id; ignored", link.endpoint)
            return
        try:
            if link.rings is None:
                raise RingReadError("this subscriber reads no rings from this daemon")
            tap, intact = link.rings.read(header, views=self.views)
            self.ring_taps += 1
            # (views: the handler must have read what the emitter wrote)
            self._run_handler(link, tap, check=intact if self.views else None)
        except (RingReadError, ConfigError) as exc:
            self.failed += 1
            logger.error("refused a ring tap from the daemon at %s: %s", link.endpoint, exc)
            text = f"the subscriber could not read this tap: {exc}"[:_ERROR_CHARS]
            link.errors.append({"tid": tid, "error": text})
            link.last_tid = max(link.last_tid, tid)

    def _run_batch(
        self,
        link: _DaemonLink,
        taps: Sequence[SiteRun] | Message,
        pattern: str,
        template: MetaTemplate | None,
    ) -> None:
        """Run a batch handler on runs of one static entry (or on one `tap` message)."""
        if isinstance(taps, Message):
            tids = [taps.header["tid"]]
            header = taps.header
        else:
            tids = [row[1] for run in taps for row in run.rows]
            header = taps[0].header(0)
        link.last_tid = max(link.last_tid, *tids)
        handler = cast(BatchHandler, self._handlers[pattern])
        try:
            if template is None:
                template = MetaTemplate(header)  # (raises what made it None)
            batch = (
                batch_of_tap(taps, template)
                if isinstance(taps, Message)
                else batch_of_runs(taps, template)
            )
            handler(batch)
            self.processed += len(tids)
        except Exception as exc:
            self.failed += len(tids)
            name = getattr(handler, "__qualname__", repr(handler))
            logger.error(
                "batch handler %s for %r (%d taps from seq %s) raised:\n%s",
                name,
                header["consumer"],
                len(tids),
                header["seq"],
                traceback.format_exc(),
            )
            text = f"{name} raised {exc!r}"[:_ERROR_CHARS]
            link.errors.extend({"tid": tid, "error": text} for tid in tids)

    def _pattern_for(self, consumer: str) -> str | None:
        """The registered name (exact, else a `prefix*` pattern) that takes `consumer`."""
        return consumer if consumer in self._handlers else first_match(self._handlers, consumer)
