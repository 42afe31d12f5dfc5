"""`Subscriber`: connect to one or more daemons, receive taps, run handlers, ack them.

Each daemon sends at most `window` taps this subscriber has not acknowledged; handlers
run one at a time, in arrival order per daemon, on the thread that called `run()`
(tapd_client/handlers.py). Acks go back in batches (when the receive queue runs dry, or
every half window), carrying the text of any handler exception so that the emitter's
`barrier_wait()` raises it. A subscriber given several endpoints (one daemon per host of
a multi-host job) keeps one connection, with its own delivery ids and acks, per daemon
(tapd_client/daemon_link.py). Large taps of a daemon on this host may be read from the
emitter's shared memory (tapd_client/ring_taps.py).

A *batch* handler (`on(name, batch=True)`, or a handler object whose class says
`takes_batch = True`) is called once per site per received message, with a `TapBatch`
of that site's taps in it (tapd_client/handlers.py says more).

A *fallback* handler (`add_handler(..., fallback=True)`, with `fallback_for` naming an
emitter "host:pid") gets that emitter's taps of its consumer only while no other
subscriber takes them: how a JAX process runs its own id_tap functions when no
subscriber process does (docs/PROTOCOL.md, "hello").
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import zmq

from tapd.autostart import ensure_daemon
from tapd.clients.liveness import DaemonWatch
from tapd.consumers import MAX_NAME
from tapd.protocol import Message
from tapd.security import ClientKeys, secure_client
from tapd.settings import ENDPOINT
from tapd_client.daemon_link import DaemonLink
from tapd_client.handlers import BatchHandler, Handler, Handlers
from tapd_client.ring_taps import RingTaps

logger = logging.getLogger("tapd.subscriber")

# Default windows. The daemon's cost is per message more than per tap, whatever the
# handler: with 4096 in flight it sends up to 2048 small taps a message (columnar runs,
# docs/PROTOCOL.md "taps"), where 256 made it 128 and cost the daemon ~6 times the CPU a
# tap (bench/RESULTS.md, 17). A worker pool's member with per-tap handlers keeps 256:
# the pool gives the next tap to a member with free credit, and a large window would
# let one member hoard taps that another, idle, could handle.
_WINDOW = 4096
_POOL_WINDOW = 256


class Subscriber:
    """Receives the taps of the consumers it has handlers for.

    `endpoint`: the daemon's address, or a list of them (default: this host's daemon,
    `TAPD_ENDPOINT` or the per-user ipc socket). `window`: taps in flight per daemon
    before it waits for acks (default 4096: bigger batches of small taps, fewer
    messages; 256 for a worker pool's member with per-tap handlers; the daemon bounds
    the bytes in flight too). `curve`:
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
        self._handlers = Handlers()
        self.fallback_for = fallback_for  # the emitter whose unwanted taps fallbacks take
        self.group = group
        # A plain flag, no threading.Event: `stop()` runs in signal handlers, and
        # Event.set takes a lock that a second signal, landing inside the first handler,
        # would wait on forever.
        self._stopping = False
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._links: list[DaemonLink] = []
        self._rings = RingTaps(shm, views)

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
        self._handlers.add(consumer, handler, fallback, batch, every, self.fallback_for)

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
        self._handlers.add(consumer, handler, fallback, batch, every, self.fallback_for)
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
        return _POOL_WINDOW if self.group is not None and not self._handlers.batch else _WINDOW

    @property
    def consumers(self) -> list[str]:
        return list(self._handlers.by_pattern)

    @property
    def processed(self) -> int:
        """Taps whose handlers returned."""
        return self._handlers.processed

    @property
    def failed(self) -> int:
        """Taps whose handlers raised, or that could not be read or decoded."""
        return self._handlers.failed

    @property
    def ring_taps(self) -> int:
        """Taps read from an emitter's ring, not received as bytes."""
        return self._rings.read

    @property
    def shm(self) -> bool | None:
        return self._rings.shm

    @property
    def views(self) -> bool:
        return self._rings.views

    # ---- lifecycle --------------------------------------------------------------

    def connect(self, timeout: float = 10.0) -> None:
        """Subscribe to every daemon and wait until each confirms (so taps emitted after
        this returns reach us). Raises TimeoutError naming the daemons that did not."""
        if not self._handlers.by_pattern:
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
                rings = self._rings.reader_for(endpoint)
                self._links.append(DaemonLink(endpoint, sock, rings))
        for link in self._links:
            link.welcomed = False
            link.hello(self._hello_fields())
        self._wait_welcomed(timeout)

    def _wait_welcomed(self, timeout: float) -> None:
        poller = self._poller()
        deadline = time.monotonic() + timeout
        # A daemon that does not answer is named within seconds (tapd/clients/liveness.py).
        # (Asked with the environment's keys: a tcp:// daemon given others is not asked.)
        watches = {
            link.endpoint: DaemonWatch(
                link.endpoint, waiting_for="a Subscriber's connect", log=logger, deadline=deadline
            )
            for link in self._links
            if self.curve is None or link.endpoint.startswith("ipc://")
        }
        while time.monotonic() < deadline:
            if all(link.welcomed for link in self._links):
                logger.info(
                    "subscribed to %s at %s", ", ".join(self.consumers), ", ".join(self.endpoints)
                )
                return
            for link in self._links:
                if not link.welcomed and link.endpoint in watches:
                    watches[link.endpoint].check(self._welcome_text)
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

    def _welcome_text(self) -> str:
        return f"its welcome (to a subscriber of {', '.join(self.consumers)})"

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """Receive and handle taps until `stop()` is called (or `until()` is true)."""
        if not self._links:
            self.connect()
        poller = self._poller()
        half_window = max(1, self.window // 2)
        while not self._stopping and not (until is not None and until()):
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
            self._handlers.expire()  # e.g. Assembler: report stale steps

    def stop(self) -> None:
        """Make `run()` return (within half a heartbeat: its poll's timeout); safe from
        other threads and signal handlers, nested ones too: it takes no lock."""
        self._stopping = True

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
            "consumers": self.consumers,
            "window": self.window,
            "name": self.name,
            "batch": True,
            "columns": True,  # decodes columnar runs (tapd/protocol/batch.py)
        }
        fallback = self._handlers.fallback
        if fallback:  # which of `consumers` are fallbacks, and for whom
            fields.update(fallback=sorted(fallback), fallback_for=self.fallback_for)
        if self.group is not None:
            fields["group"] = self.group
        self._handlers.every.add_to(fields)
        return fields

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        for link in self._links:
            poller.register(link.sock, zmq.POLLIN)
        return poller

    def _ready(self, poller: zmq.Poller, timeout_ms: int) -> list[DaemonLink]:
        events = dict(poller.poll(timeout_ms))
        return [link for link in self._links if link.sock in events]

    def _handle(self, link: DaemonLink, message: Message) -> None:
        kind = message.kind
        if kind == "tap":
            self._handlers.run_handler(link, message)
        elif kind == "ring_tap":  # its bytes are in the emitter's ring
            self._rings.run(link, message.header, self._handlers)
        elif kind == "taps":  # small taps, several per message
            self._handlers.handle_taps(link, message.runs)
        elif kind == "ring_taps":  # several taps whose bytes are in emitters' rings
            self._rings.run_batch(link, message, self._handlers)
        elif kind == "welcome":
            link.welcomed = True
        elif kind == "rehello" and link.rehello_wanted():  # a daemon that does not know us
            logger.warning("daemon at %s asked us to subscribe again", link.endpoint)
            link.hello(self._hello_fields())
