"""The records that the router and its targets share: what is routed (a unit), whose it
is (an emitter), and one unit on its way to one target (a delivery).

Records only, with no routing rules: the router (tapd/daemon/router.py) and the kinds
of target (tapd/daemon/targets/) import them, and they import neither.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Hashable
from typing import Any

from tapd.daemon.runs import TapRun
from tapd.protocol import Message
from tapd.protocol.batch import BatchRun, BatchTap

PeerKey = Hashable
Send = Callable[[PeerKey, list[Any]], bool]  # False when the peer is gone

# What the router routes: one tap, or a run of a ring site's taps (tapd/daemon/runs.py),
# which is queued, delivered and acknowledged as one unit of `count` taps. Emitter
# indices, pending entries and barriers count units; counters count taps.
Unit = Message | TapRun


def unit_count(unit: Unit) -> int:
    return unit.count if isinstance(unit, TapRun) else 1


@dataclasses.dataclass
class Pending:
    remaining: int  # targets that still have to process this unit
    count: int  # its taps
    lost: bool = False
    # What a forwarder reports of its taps upstream (`Subscribers.ack`): how many an upstream
    # subscriber handled is what counts as delivered. Of the unit's taps, those the
    # upstream dropped or lost (the most any subscriber reports) count as dropped; those
    # it had no subscriber for, unless some subscriber here handled them, as unrouted.
    dropped: int = 0
    unrouted: int | None = None
    copied: int = 0  # of `remaining`, deliveries whose bytes are copies (spool): ring-free


@dataclasses.dataclass
class Emitter:
    key: PeerKey
    name: str  # "host:pid"
    next_index: int = 0
    low: int = 0  # every tap below this index is finished
    pending: dict[int, Pending] = dataclasses.field(default_factory=dict)
    parked: collections.deque[tuple[int, Unit, int, int]] = dataclasses.field(
        default_factory=collections.deque
    )  # (index, tap, nbytes, credit bytes) waiting for queue room under "block"
    barriers: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=collections.deque
    )  # (barrier id, first index after it)
    credit_due: int = 0
    reported: tuple[int, int, int] = (0, 0, 0)  # totals last told the emitter
    reported_at: float = 0.0
    parked_bytes: int = 0
    received: int = 0  # taps
    delivered: int = 0
    dropped: int = 0
    unrouted: int = 0
    received_bytes: int = 0  # (tapd top: MB/s per emitter)
    last_handled_ns: int | None = None  # emitter time of the newest tap a subscriber handled
    gone: bool = False
    forwarder: bool = False  # a forwarding daemon: its taps name their own emitters
    hellos: int = 0  # hellos it said (a forwarder is told our wants after each: wants.py)
    local_pid: int | None = None  # an emitter process on this host (from its hello)
    # A forwarder's taps carry its number for them (`fid`); what became of each goes back
    # in the barrier_done after it (docs/PROTOCOL.md, "Forwarding").
    fids: dict[int, int] = dataclasses.field(default_factory=dict)  # index -> fid
    outcomes: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    # Last heard (time.monotonic(): hello, barrier, a forwarder's tap); a forwarding
    # daemon silent too long is gone (`Router.expire`): it sends a barrier every second.
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    # Under the spool policy: routed units still pending whose bytes some target holds
    # in memory (not copied to its spool), in index order (`Router.safe_low`).
    unsafe: dict[int, None] = dataclasses.field(default_factory=dict)
    # An emitter whose taps come from a ring (`Router.watch_ring`): `give_back` returns
    # the ring space of its finished units. What it is told it finished counts only
    # those (`released`): the others a daemon after this one reads again, and counts.
    give_back: Callable[[], None] | None = None
    unreleased: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    released: tuple[int, int, int] = (0, 0, 0)  # delivered, dropped, unrouted

    @property
    def held_bytes(self) -> int:
        return self.parked_bytes + self.credit_due

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "taps": self.received,
            "bytes": self.received_bytes,
            "delivered": self.delivered,
            "dropped": self.dropped,
            "unrouted": self.unrouted,
            "pending": len(self.pending),
            "parked_bytes": self.parked_bytes,
            "last_handled_time": None
            if self.last_handled_ns is None
            else self.last_handled_ns / 1e9,
        }


@dataclasses.dataclass
class Delivery:
    emitter: Emitter
    index: int
    tap: Unit
    nbytes: int
    count: int  # taps: delivery ids tid .. tid + count - 1
    tid: int = -1
    copied: bool = False  # taken back from a spool: its bytes are its own
    # What its acknowledgement lets go besides (the spool record it was read from).
    release: Callable[[], None] | None = None

    def taps(self) -> list[Message]:
        tap = self.tap
        return tap.taps() if isinstance(tap, TapRun) else [tap]

    def header_of(self, tid: int) -> dict[str, Any]:
        """The header of its tap with delivery id `tid`."""
        tap = self.tap
        return (tap.tap(tid - self.tid) if isinstance(tap, TapRun) else tap).header

    def batch_piece(self) -> BatchTap | BatchRun:
        tap = self.tap
        name = self.emitter_name
        if isinstance(tap, TapRun):
            return tap.batch_piece(self.tid, name)
        return BatchTap(tap.header, tap.frames, self.tid, name, tap.site)

    @property
    def emitter_name(self) -> str:
        """The emitter a subscriber is told about: the one named in a forwarded tap (a
        forwarding daemon passes on its emitter's name), else the one that sent it here:
        no other emitter may speak for another."""
        name = self.tap.header.get("emitter") if self.emitter.forwarder else None
        return name if isinstance(name, str) else self.emitter.name

    @property
    def time_ns(self) -> Any:
        """When its (last) tap ran, on the emitter's clock: an int, or whatever came."""
        tap = self.tap
        return tap.last_time_ns if isinstance(tap, TapRun) else tap.header.get("time")
