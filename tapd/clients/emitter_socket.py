"""The emitter's end of a connection to a daemon, with its socket: written once for the
three parts of tapd that speak to a daemon as an emitter, the sender thread
(tapd/emitter/sender.py), the forwarder (tapd/daemon/forward.py) and the replayer
(tapd/tools/replay.py).

`connect` makes the DEALER socket as every emitter's is; `EmitterSocket` drives it with
the sans-I/O link (tapd/protocol/link.py: hello and welcome, the credit window,
rehello), sends what the link wants sent before anything of the owner's, and keeps the
barriers sent and not yet answered, so that an owner can say them again to a daemon
that may have lost them. One thread owns a socket and everything here: the owner's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import zmq

from tapd.channel import Channel
from tapd.errors import ProtocolError
from tapd.protocol import Limits, Message, decode, encode
from tapd.protocol.link import (
    KEEPALIVE_CNT,
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTVL_S,
    RECONNECT_AFTER,
    REHELLO_AFTER,
    UNACKED_MAX_MS,
    EmitterLink,
    LinkEvent,
)
from tapd.security import secure_client

logger = logging.getLogger("tapd.link")

Secure = Callable[[zmq.Socket[Any]], None]


def tcp_liveness(sock: zmq.Socket[Any]) -> None:
    """The kernel's TCP keepalive and unacknowledged-data timeout on a connecting
    socket: a tcp:// connection that died unseen is closed and made again; no ZeroMQ
    heartbeat is sent (tapd/protocol/link.py, "connections that die unseen"). An ipc://
    socket ignores them."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, UNACKED_MAX_MS)


def connect(
    context: zmq.Context[Any],
    endpoint: str,
    *,
    secure: Secure | None = None,
    routing_id: bytes | None = None,
) -> zmq.Socket[Any]:
    """A DEALER connected to the daemon at `endpoint`, secured by `secure` (by default
    `secure_client`: a private ipc directory, CurveZMQ keys from the environment on
    tcp). Raises what connecting raises (ConfigError, zmq.ZMQError), the socket closed."""
    sock: zmq.Socket[Any] = context.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 1000)
        # The credit window bounds what is in flight, in bytes; a message-count
        # high-water mark would only make the owner block on many small taps.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        tcp_liveness(sock)  # a tcp:// daemon's connection may die unseen
        if secure is None:
            secure_client(sock, endpoint)
        else:
            secure(sock)
        sock.connect(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


class EmitterSocket:
    """One emitter's socket towards one daemon and the link that paces it."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        identity: Mapping[str, Any],
        now: float,
        *,
        rehello_after: float = REHELLO_AFTER,
        rehello_max: float | None = None,
        self_id: str | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.sock = sock  # (for polling and options: messages go through the channel)
        self.channel = Channel(sock, "emitter")
        self.limits = limits or Limits()
        self.link = EmitterLink(
            identity, now, rehello_after=rehello_after, rehello_max=rehello_max, self_id=self_id
        )
        # Barriers sent and not answered: id -> their other fields. A daemon answers an
        # emitter's barriers in order, so an answer settles every one before it too.
        self.barriers: dict[int, dict[str, Any]] = {}
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
        self.reconnects = 0  # connections dropped for a new one (tick)
        self._connected_at = now
        self.flush()

    def flush(self) -> None:
        """Send what the link wants sent (hellos), in order."""
        for frames in self.link.outgoing():
            self.channel.send(frames)

    def may_send(self, nbytes: int) -> bool:
        return self.link.may_send(nbytes)

    def send(self, frames: list[Any], nbytes: int) -> None:
        """Send one tap of `nbytes` payload bytes (counted against the credit window)."""
        self.channel.send(frames, copy=False)
        self.link.sent(nbytes)

    def send_barrier(self, barrier_id: int, fields: Mapping[str, Any] | None = None) -> None:
        self.barriers[barrier_id] = dict(fields or {})
        self._say_barrier(barrier_id)

    def resend_barriers(self, *, last_only: bool = False) -> None:
        """Say the unanswered barriers again (all, or the last), in order: the daemon
        may have lost them with a restart or a dropped connection."""
        ids = sorted(self.barriers)
        for barrier_id in ids[-1:] if last_only else ids:
            self._say_barrier(barrier_id)

    def _say_barrier(self, barrier_id: int) -> None:
        self.channel.send(encode("barrier", {**self.barriers[barrier_id], "id": barrier_id}))

    def receive(
        self, now: float, malformed: Callable[[ProtocolError], None]
    ) -> Iterator[tuple[Message, LinkEvent | None]]:
        """Each message the daemon has sent, as long as one waits (never blocking), with
        what the link made of it (None: the owner's to handle). The link has had it, and
        what it answered is sent, before it is yielded; one that does not decode goes to
        `malformed` instead."""
        while (frames := self.channel.recv()) is not None:
            try:
                message = decode(frames, self.limits)
            except ProtocolError as exc:
                malformed(exc)
                continue
            event = self.link.received(message.header, now)
            self.flush()
            if message.kind == "barrier_done":
                answered = message.header["id"]
                for barrier_id in [b for b in self.barriers if b <= answered]:
                    del self.barriers[barrier_id]
            yield message, event

    def tick(self, now: float, waiting: bool) -> bool:
        """The link's rehello timer (tapd/protocol/link.py, EmitterLink.tick); True if it
        said hello again. A tcp:// daemon silent for RECONNECT_AFTER s while we wait gets
        a new connection, the old one dropped with what it held (its taps are counted
        lost, or sent again, as after a restart: the daemon's welcome says which)."""
        link = self.link
        hello = link.tick(now, waiting)
        silent = now - max(link.last_heard, self._connected_at)
        if (waiting or link.in_flight) and silent > RECONNECT_AFTER and self._tcp():
            self._reconnect(now, silent)
            hello = True
        self.flush()
        return hello

    def _tcp(self) -> bool:
        return self.endpoint.startswith("tcp://")

    def _reconnect(self, now: float, silent: float) -> None:
        logger.warning(
            "no word from the daemon at %s for %.0f s: a new connection to it",
            self.endpoint,
            silent,
        )
        self._connected_at = now  # (tried again after as long, whatever happens now)
        try:
            self.sock.disconnect(self.endpoint)
        except zmq.ZMQError as exc:  # (connecting again would leave two connections)
            logger.warning("could not drop the connection to %s: %s", self.endpoint, exc)
            return
        self.sock.connect(self.endpoint)
        self.reconnects += 1
        self.link.hello(now)

    def bye(self) -> None:
        """Tell the daemon we are gone, if the socket takes it now."""
        try:
            self.channel.send(encode("bye", {}), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
