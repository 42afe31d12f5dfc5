"""The emitter's end of a connection to a daemon, sans I/O (docs/PROTOCOL.md, "Flow
control" and "Forwarding").

Three parts of tapd speak to a daemon as an emitter: an emitter process's sender thread
(`tapd/emitter/sender.py`), a forwarding daemon facing its upstream
(`tapd/daemon/forward.py`) and the replayer (`tapd/tools/replay.py`). What they share
lives here, once, and their socket around it in tapd/clients/emitter_socket.py:
- `hello` and the daemon's `welcome`: the credit window it grants, and `held_bytes`,
  the bytes of ours it holds and has not credited yet, from which the link knows how
  many bytes it has in flight, and how many were lost on the way (a restart, a dropped
  connection);
- the credit window: `may_send` before a tap, `sent` after it, `credit` returning room;
- a `welcome` from a different daemon (it restarted): the window closes until that one
  has answered a fresh `hello`;
- the rehello timer: silent for a while with something outstanding, say hello again, in
  case the daemon restarted or the connection dropped and took its answers along.

The link has no socket and reads no clock: the owner passes `now` in, feeds it every
decoded message from the daemon (`received`), and sends what `outgoing()` returns, in
order, after each call. `received` returns an event for the messages the link handles
itself (welcome, rehello, credit) and None for the rest (barrier_done, error, ...), which
are the owner's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tapd.protocol.rules import DEFAULT_LIMITS, is_int
from tapd.protocol.wire import encode

# Say hello again after this long without a word from the daemon while something is
# outstanding; an owner may let the wait grow (doubling, up to `rehello_max`) while the
# daemon stays silent, so that a long outage does not fill its queue with hellos.
REHELLO_AFTER = 2.0
_HELLOS_KEPT = 64  # unanswered hellos remembered (see EmitterLink._sent_at)


@dataclasses.dataclass(frozen=True)
class Welcomed:
    """The daemon welcomed us: the window is open. `lost_bytes`: bytes we had in flight
    that it says it never got (it restarted, or a connection dropped them)."""

    daemon: str
    lost_bytes: int
    first: bool  # the first welcome this link has had


@dataclasses.dataclass(frozen=True)
class Restarted:
    """A welcome from a daemon other than the one that welcomed us before: it restarted
    (or the endpoint now leads elsewhere). The window is closed and a hello is on its way;
    the new daemon's answer to it comes as `Welcomed`."""

    previous: str
    daemon: str


@dataclasses.dataclass(frozen=True)
class Looped:
    """The daemon that welcomed us is the owner itself (`self_id`): a forwarding daemon
    forwarding to itself. The window stays closed."""

    daemon: str


@dataclasses.dataclass(frozen=True)
class RehelloAsked:
    """The daemon does not know us (it restarted and met a message of ours first); a hello
    is on its way."""


@dataclasses.dataclass(frozen=True)
class Credited:
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Refused:
    """A link message the link cannot use (a malformed welcome): ignored; `reason` is a
    ProtocolError reason code, `detail` says what was wrong."""

    reason: str
    detail: str


LinkEvent = Welcomed | Restarted | Looped | RehelloAsked | Credited | Refused


class EmitterLink:
    """One emitter's connection state towards one daemon endpoint."""

    def __init__(
        self,
        identity: Mapping[str, Any],
        now: float,
        *,
        rehello_after: float = REHELLO_AFTER,
        rehello_max: float | None = None,
        self_id: str | None = None,
    ) -> None:
        self.identity = dict(identity)  # the hello's fields
        self.self_id = self_id
        self.daemon: str | None = None  # the id of the daemon that welcomed us
        self.window = 0  # nothing is sent before a welcome
        self.in_flight = 0  # bytes sent that the daemon has not credited back
        self.lost_bytes = 0  # in all, as welcomes reported them
        self.last_heard = now
        self.last_hello = now
        self._rehello_base = rehello_after
        self._rehello_max = rehello_after if rehello_max is None else rehello_max
        self._rehello_after = rehello_after
        # Each hello carries a number (`nonce`) that the daemon's welcome echoes, so that
        # a welcome answering an older hello (several queue up while a daemon is down)
        # is read against the bytes sent since *that* hello: what is in flight then is
        # neither over- nor undercounted as lost.
        self._nonce = 0
        self._sent_total = 0
        self._sent_at_hello: dict[int, int] = {}  # nonce -> _sent_total when it went out
        self._outgoing: list[list[Any]] = []
        self.hello(now)

    # ---- what the owner sends ---------------------------------------------------------

    def outgoing(self) -> list[list[Any]]:
        """Messages the link wants sent, in order; the owner sends them before its own."""
        messages, self._outgoing = self._outgoing, []
        return messages

    def hello(self, now: float) -> None:
        self.last_hello = now
        self._nonce += 1
        self._sent_at_hello[self._nonce] = self._sent_total
        if len(self._sent_at_hello) > _HELLOS_KEPT:  # answers to these will not come
            del self._sent_at_hello[min(self._sent_at_hello)]
        self._outgoing.append(encode("hello", {**self.identity, "nonce": self._nonce}))

    def may_send(self, nbytes: int) -> bool:
        """Whether a tap of `nbytes` fits the daemon's credit window now (one tap always
        fits when nothing is in flight, however large)."""
        if self.window == 0:
            return False
        return self.in_flight == 0 or self.in_flight + nbytes <= self.window

    def sent(self, nbytes: int) -> None:
        """The owner sent a tap of `nbytes` payload bytes."""
        self.in_flight += nbytes
        self._sent_total += nbytes

    # ---- what the daemon says ---------------------------------------------------------

    def received(self, header: Mapping[str, Any], now: float) -> LinkEvent | None:
        """Take one decoded message from the daemon; None if it is not the link's."""
        self.last_heard = now
        self._rehello_after = self._rehello_base
        kind = header["kind"]
        if kind == "welcome":
            return self._welcomed(header, now)
        if kind == "rehello":
            self.hello(now)
            return RehelloAsked()
        if kind == "credit":
            nbytes = header["bytes"]
            self.in_flight = max(0, self.in_flight - nbytes)
            return Credited(nbytes)
        return None

    def _welcomed(self, header: Mapping[str, Any], now: float) -> LinkEvent:
        daemon = header["daemon"]
        held = header.get("held_bytes", 0)
        if not is_int(held) or held < 0:
            return Refused("bad_field", f"welcome has held_bytes {held!r:.20}")
        if self.self_id is not None and daemon == self.self_id:
            self.window = 0
            return Looped(daemon)
        if self.daemon is not None and daemon != self.daemon:
            # A restarted daemon (it may have met one of our messages first): resync with
            # a hello, whose answer comes after it has read everything we sent before it.
            previous, self.daemon = self.daemon, daemon
            self.window = 0
            self.hello(now)
            return Restarted(previous, daemon)
        first = self.daemon is None
        self.daemon = daemon
        self.window = header["window_bytes"]
        expected = held + self._sent_total - self._sent_at(header.get("nonce"))
        lost = max(0, self.in_flight - expected)
        self.lost_bytes += lost
        self.in_flight = expected
        return Welcomed(daemon, lost, first)

    def _sent_at(self, nonce: Any) -> int:
        """`_sent_total` when the hello this welcome answers went out: the one it names,
        else (a welcome that names none: the daemon met a tap of ours first, or does
        not echo) the latest. Older hellos will not be answered any more."""
        if not (is_int(nonce) and nonce in self._sent_at_hello):
            nonce = self._nonce
        sent = self._sent_at_hello[nonce]
        for older in [n for n in self._sent_at_hello if n < nonce]:
            del self._sent_at_hello[older]
        return sent

    # ---- the timer --------------------------------------------------------------------

    def tick(self, now: float, waiting: bool) -> bool:
        """Say hello again if the daemon has been silent too long while the owner is
        `waiting` for it (or bytes are in flight); True if it did."""
        if not (waiting or self.in_flight):
            return False
        if now - max(self.last_heard, self.last_hello) <= self._rehello_after:
            return False
        self._rehello_after = min(2 * self._rehello_after, self._rehello_max)
        self.hello(now)
        return True


# ---- what became of forwarded taps -----------------------------------------------------

# A forwarding daemon numbers the taps it sends upstream (`fid`); the upstream says in
# each `barrier_done` what became of every one it finished before that barrier, as
# ranges [first fid, last fid, outcome] (docs/PROTOCOL.md, "Forwarding").
OUTCOMES = ("delivered", "dropped", "unrouted")
MAX_OUTCOME_RANGES = DEFAULT_LIMITS.max_outcome_ranges  # per barrier_done; more go later


def outcome_ranges(
    finished: list[tuple[int, str]], limit: int = MAX_OUTCOME_RANGES
) -> tuple[list[list[Any]], list[tuple[int, str]]]:
    """`finished` (fid, outcome) pairs as ranges of consecutive fids with one outcome,
    at most `limit` of them; returns the ranges and the pairs left for another time."""
    ranges: list[list[Any]] = []
    ordered = sorted(finished)
    for position, (fid, outcome) in enumerate(ordered):
        if ranges and ranges[-1][1] == fid - 1 and ranges[-1][2] == outcome:
            ranges[-1][1] = fid
        elif ranges and ranges[-1][1] == fid and ranges[-1][2] == outcome:
            continue  # the same tap twice (sent again): one outcome is enough
        elif len(ranges) == limit:
            return ranges, ordered[position:]
        else:
            ranges.append([fid, fid, outcome])
    return ranges, []


def parse_outcome_ranges(value: list[list[Any]]) -> list[tuple[int, int, str]]:
    """The `outcomes` of a `barrier_done`, as decode checked them (tapd/protocol/schema.py)."""
    return [(first, last, outcome) for first, last, outcome in value]


# ---- connections that die unseen -------------------------------------------------------

# A tcp:// connection to a daemon whose other end was reset, or whose link went down, is
# closed (and made again) within seconds, rather than held open, unusable, until the
# operating system gives up on it many minutes later: by the kernel where it can tell
# (TCP keepalive on an idle connection: dead after IDLE + CNT x INTVL s without an
# answer; ZMQ_TCP_MAXRT, Linux's TCP_USER_TIMEOUT, where data has gone unacknowledged
# for UNACKED_MAX_MS), and by the emitter's own link where it cannot (a proxy that holds
# the connection's other half): no word from the daemon for RECONNECT_AFTER s while it
# waits for one (its hellos unanswered) and the emitter drops the connection for a new
# one (tapd/clients/emitter_socket.py). An ipc:// connection needs neither: the kernel
# closes it when either process dies. No ZeroMQ heartbeats: a daemon's libzmq 4.3.5
# aborts (`Assertion failed: !_io_error`, stream_engine_base.cpp:310) when it answers a
# PING read from a connection it had stopped reading (RCVHWM, tapd/daemon/bounds.py)
# and which then died (tests/test_fanin.py). (This module does no I/O.)
KEEPALIVE_IDLE_S = 2
KEEPALIVE_INTVL_S = 1
KEEPALIVE_CNT = 3
UNACKED_MAX_MS = 10_000  # a link down for 5 s keeps its connection (TCP backs off to ~6 s)
RECONNECT_AFTER = 15.0  # s; hellos go every 2 s (doubling) while the daemon is silent
