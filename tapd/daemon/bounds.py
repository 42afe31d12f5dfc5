"""What bounds the memory a peer can make the daemon hold (docs/PROMISES.md, "Daemon
memory").

ZeroMQ holds a whole multipart message before the daemon sees any of it, so the bounds
that matter are set on the sockets, before a byte is read:
- the largest frame (`ZMQ_MAXMSGSIZE`, which libzmq checks per frame, not per message:
  a larger one closes the connection unread) is the largest frame a real peer of that
  socket sends: an array leaf of a tap (`max_message_bytes`) on the listening sockets,
  a header on the forwarder's socket, where only the upstream's small replies arrive;
- how many messages of one connection wait unread (`ZMQ_RCVHWM`): past it libzmq stops
  reading that connection, and the peer waits (an emitter's own credit window bounds
  what it sends anyway);
- what the daemon sends back to a peer that does not read: the errors for its refused
  messages come in a burst, then a few a second (`ReplyBudget`), the rest only counted;
- emitters whose connection is gone without a `bye` (another host's emitter, killed)
  are found by a probe that ZeroMQ cannot deliver (`DepartedEmitters`), and forgotten;
- what the router memoizes per consumer and emitter name (routes.py, `_TARGETS_CACHED`).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import zmq

from tapd.protocol import Limits, encode

if TYPE_CHECKING:
    from tapd.daemon.router import Router

# Messages of one connection that libzmq reads ahead of the daemon. The loop reads at
# most 256 from a socket per round; a busy emitter's next ones wait in its own socket.
LISTENER_QUEUE = 64
FRAME_OVERHEAD = 64  # beyond the payload a frame carries (none today): a margin
PROBE_EVERY = 2.0  # seconds between looks for emitters whose connection is gone
REPLY_BURST = 64  # errors for refused messages a peer gets at once...
REPLY_RATE = 16.0  # ...then this many a second
REPLY_PEERS = 4096  # peers whose reply budget is remembered (the oldest are forgotten)
Budgets = collections.OrderedDict[Any, tuple[float, float]]


def largest_frame(limits: Limits) -> int:
    """The largest frame a real peer sends to a listening socket: one array leaf of a tap
    (at most all of its `max_message_bytes`) or a header."""
    return max(limits.max_message_bytes, limits.max_header_bytes) + FRAME_OVERHEAD


def bound_listener(sock: zmq.Socket[Any], limits: Limits) -> None:
    """A listening socket (emitters, subscribers, control requests)."""
    sock.setsockopt(zmq.MAXMSGSIZE, largest_frame(limits))
    sock.setsockopt(zmq.RCVHWM, LISTENER_QUEUE)


def configure_listener(sock: zmq.Socket[Any], limits: Limits) -> None:
    """A daemon's listening ROUTER socket, before it binds."""
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer is an error, not a drop
    # A peer that reconnects under its routing id (a forwarder) takes that id over from
    # its dead connection instead of being ignored (docs/PROTOCOL.md).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    # No ZeroMQ heartbeats on either side: libzmq 4.3.5 aborts the daemon (`Assertion
    # failed: !_io_error`, stream_engine_base.cpp:310; libzmq #4364) when a peer dies
    # while its connection holds RCVHWM messages the daemon has not read yet, as a busy
    # upstream's forwarders do when their hosts are preempted: at this side's next
    # heartbeat, or as it answers a PING the peer had sent among those messages. The
    # peers that connect find a dead tcp:// connection themselves (tapd/protocol/link.py);
    # this side's end of it is closed by TCP keepalives.
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 10)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDHWM, 0)  # bounded by credit windows, not message counts
    bound_listener(sock, limits)  # largest frame, messages read ahead


def bound_upstream(sock: zmq.Socket[Any], limits: Limits) -> None:
    """The forwarder's socket: its upstream sends welcomes, credit, barrier_done, errors
    and rehellos, each a header and nothing more."""
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_header_bytes + FRAME_OVERHEAD)


class ReplyBudget:
    """How many errors for refused messages each peer may be sent now: `REPLY_BURST` at
    once, refilled at `REPLY_RATE` a second. A peer that floods the daemon with bad
    messages and never reads would otherwise have every answer queued for it, unbounded
    (the listening sockets' send queues are bounded by credit windows, not counts)."""

    def __init__(
        self, burst: int = REPLY_BURST, rate: float = REPLY_RATE, peers: int = REPLY_PEERS
    ) -> None:
        self.burst, self.rate, self.peers = burst, rate, peers
        self._tokens: Budgets = collections.OrderedDict()  # key -> (tokens, when)

    def allow(self, key: Any, now: float) -> bool:
        tokens, then = self._tokens.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._tokens[key] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._tokens) > self.peers:
            self._tokens.popitem(last=False)
        return allowed

    def forget(self, keep: Container[Any]) -> None:
        """Drop the budgets of peers not in `keep` (emitters the router no longer has)."""
        for key in [k for k in self._tokens if k not in keep]:
            del self._tokens[key]

    def __len__(self) -> int:
        return len(self._tokens)


class DepartedEmitters:
    """Emitters whose connection is gone without a `bye` leave their state in the router
    for good: a local one is found by its pid, a forwarder by its silence, but another
    host's portable emitter, killed, or a peer that said hello and hung up, by nothing.
    Every `PROBE_EVERY` s each idle one (nothing pending or parked) is sent an empty
    credit, which a live emitter ignores; the listening sockets refuse to send to a peer
    that is gone (`ROUTER_MANDATORY`), and that emitter is forgotten as if it said bye."""

    def __init__(self, send: Callable[[Any, list[Any]], bool], every: float = PROBE_EVERY):
        self._send = send
        self.every = every
        self._next = 0.0
        self.forgotten = 0

    def check(self, router: Router, skip: Container[Any], now: float) -> None:
        """`skip`: emitters with a ring (the ring's writer pid says when they are gone)."""
        if now < self._next:
            return
        self._next = now + self.every
        probe = encode("credit", {"bytes": 0})
        for key, emitter in list(router.emitters.items()):
            if (
                emitter.gone
                or emitter.forwarder
                or emitter.pending
                or emitter.parked
                or key in skip
                or not (isinstance(key, tuple) and isinstance(key[0], int))  # no socket
            ):
                continue
            if not self._send(key, probe):
                self.forgotten += 1
                router.emitter_bye(key)
