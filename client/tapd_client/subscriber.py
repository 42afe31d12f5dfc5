"""`Subscriber`: connect to a daemon, receive taps, run handlers, acknowledge them.

The daemon sends at most `window` taps this subscriber has not acknowledged; handlers
run one at a time, in arrival order, on the thread that called `run()`. Acks go back in
batches (when the receive queue runs dry, or every half window), carrying the text of
any handler exception so that the emitter's `barrier_wait()` raises it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import zmq

from tapd.errors import ProtocolError, TapdError
from tapd.protocol import Message, decode, encode
from tapd.runtime import default_endpoint
from tapd.security import ClientKeys, secure_client
from tapd_client.meta import TapMeta

logger = logging.getLogger("tapd.subscriber")

Handler = Callable[[Any, TapMeta], object]


class Subscriber:
    """Receives the taps of the consumers it has handlers for.

    `endpoint`: the daemon's address (default: this host's daemon, `TAPD_ENDPOINT` or
    the per-user ipc socket). `window`: taps in flight before the daemon waits for acks.
    `curve`: keys for a tcp:// daemon (default: from TAPD_CURVE_SERVER_KEY and
    TAPD_CURVE_SECRET).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        name: str | None = None,
        window: int = 64,
        heartbeat: float = 1.0,
        curve: ClientKeys | None = None,
    ) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.endpoint = endpoint or os.environ.get("TAPD_ENDPOINT") or default_endpoint()
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.window = window
        self.heartbeat = heartbeat
        self.curve = curve  # for tcp:// daemons; default from TAPD_CURVE_* variables
        self._handlers: dict[str, Handler] = {}
        self._stop = threading.Event()
        self._context: zmq.Context[Any] = zmq.Context.instance()
        self._sock: zmq.Socket[Any] | None = None
        self._last_tid = -1
        self._acked_tid = -1
        self._errors: list[dict[str, Any]] = []
        self._last_sent = 0.0
        self.processed = 0
        self.failed = 0

    # ---- registration -----------------------------------------------------------

    def on(self, consumer: str) -> Callable[[Handler], Handler]:
        """Decorator: run the function for taps named `consumer`. A name ending in `*`
        matches by prefix (`"mymodule:*"`)."""

        def register(handler: Handler) -> Handler:
            self.add_handler(consumer, handler)
            return handler

        return register

    def add_handler(self, consumer: str, handler: Handler) -> None:
        if self._sock is not None:
            raise RuntimeError("add handlers before connecting")
        if consumer in self._handlers:
            raise ValueError(f"consumer {consumer!r} already has a handler")
        self._handlers[consumer] = handler

    @property
    def consumers(self) -> list[str]:
        return list(self._handlers)

    # ---- lifecycle --------------------------------------------------------------

    def connect(self, timeout: float = 10.0) -> None:
        """Subscribe and wait until the daemon confirms (so taps emitted after this
        returns reach us). Raises TimeoutError if no daemon answers."""
        if not self._handlers:
            raise ValueError("no handlers: register some with @subscriber.on(name) first")
        if self._sock is None:
            self._sock = self._context.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 1000)
            secure_client(self._sock, self.endpoint, self.curve)
            self._sock.connect(self.endpoint)
        self._hello()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sock.poll(100):
                message = self._receive()
                if message is not None and message.kind == "welcome":
                    logger.info("subscribed to %s at %s", ", ".join(self._handlers), self.endpoint)
                    return
                if message is not None:
                    self._handle(message)
        raise TimeoutError(
            f"no tapd daemon answered at {self.endpoint} within {timeout} s "
            "(start one with `tapd start`)"
        )

    def run(self, *, until: Callable[[], bool] | None = None) -> None:
        """Receive and handle taps until `stop()` is called (or `until()` is true)."""
        if self._sock is None:
            self.connect()
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set() and not (until is not None and until()):
            if sock.poll(int(self.heartbeat * 500)):
                for _ in range(self.window):
                    message = self._receive()
                    if message is None:
                        break
                    self._handle(message)
                    if self._last_tid - self._acked_tid >= max(1, self.window // 2):
                        self._ack()
            self._ack()
            if time.monotonic() - self._last_sent > self.heartbeat:
                self._send(encode("heartbeat", {}))

    def stop(self) -> None:
        """Make `run()` return; safe from other threads and signal handlers."""
        self._stop.set()

    def close(self) -> None:
        if self._sock is not None:
            self._ack()
            self._send(encode("bye", {}))
            self._sock.close(linger=1000)
            self._sock = None

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

    def _send(self, frames: Iterable[Any]) -> None:
        assert self._sock is not None
        self._sock.send_multipart(list(frames))
        self._last_sent = time.monotonic()

    def _hello(self) -> None:
        self._last_tid = self._acked_tid = -1
        self._errors = []
        self._send(encode("hello", {
            "role": "subscriber", "consumers": list(self._handlers), "window": self.window,
            "name": self.name,
        }))  # fmt: skip

    def _receive(self) -> Message | None:
        assert self._sock is not None
        try:
            frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(frames)
        except ProtocolError as exc:
            logger.error("ignoring malformed message from the daemon: %s", exc)
            return None

    def _handle(self, message: Message) -> None:
        kind = message.kind
        if kind == "tap":
            self._run_handler(message)
        elif kind == "rehello":  # the daemon restarted and does not know us
            logger.warning("daemon at %s asked us to subscribe again", self.endpoint)
            self._hello()

    def _run_handler(self, message: Message) -> None:
        header = message.header
        tid = header.get("tid")
        if not isinstance(tid, int):
            logger.error("tap from the daemon without a delivery id; ignored")
            return
        self._last_tid = tid
        consumer = header["consumer"]
        handler = self._handler_for(consumer)
        try:
            if handler is None:
                raise TapdError(f"no handler here for consumer {consumer!r}")
            handler(message.value(), TapMeta.from_header(header))
            self.processed += 1
        except Exception as exc:
            self.failed += 1
            name = getattr(handler, "__qualname__", repr(handler))
            logger.error(
                "handler %s for %r (seq %s) raised:\n%s",
                name,
                consumer,
                header["seq"],
                traceback.format_exc(),
            )
            self._errors.append({"tid": tid, "error": f"{name} raised {exc!r}"})

    def _handler_for(self, consumer: str) -> Handler | None:
        if consumer in self._handlers:
            return self._handlers[consumer]
        for pattern, handler in self._handlers.items():
            if pattern.endswith("*") and consumer.startswith(pattern[:-1]):
                return handler
        return None

    def _ack(self) -> None:
        if self._last_tid > self._acked_tid:
            self._send(encode("ack", {"upto": self._last_tid, "errors": self._errors}))
            self._acked_tid = self._last_tid
            self._errors = []
