"""The daemon's routing state: emitters, subscribers, queues, credit and barriers.

No sockets here: the server feeds decoded messages in and the router answers through the
`send(peer, frames)` callable it was given. Every tap gets an index per emitter; it is
"pending" until each subscriber it was routed to has acknowledged it (or lost it), which
is what barriers wait for (docs/PROTOCOL.md, "Barrier").

A worker pool (hello `group`) is one routing target, a `Subscriber` with `members`: taps
queue there as for any subscriber (same bound, same policy, same spool), and go from its
queue to the member with the most free credit; what a member leaves unacknowledged goes
back to that queue for another (docs/PROTOCOL.md, "Worker pools").
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import time
from collections.abc import Callable, Container, Hashable, Sequence
from pathlib import Path
from typing import Any

from tapd.daemon.runs import TapRun
from tapd.daemon.spool import Spool, SpoolEntry, SpoolError, SpoolFull, Taken, find_spools
from tapd.protocol import MAGIC, Message, encode
from tapd.protocol.batch import BatchRun, BatchTap, encode_batch
from tapd.protocol.link import outcome_ranges
from tapd.protocol.wire import DEFAULT_LIMITS, encode_header

logger = logging.getLogger("tapd.daemon")

PeerKey = Hashable
Send = Callable[[PeerKey, list[Any]], bool]  # False when the peer is gone
# An in-process subscriber (the forwarder) takes each delivery as (tid, tap, emitter
# name, nbytes) instead of frames on a socket, and acknowledges it through `ack`.
Deliver = Callable[[int, Message, str, int], None]
_HOSTNAME = socket.gethostname()  # emitters that say this host are local: pids checkable
_UNLIMITED = 2**62  # the message-count window of in-process subscribers
# Taps smaller than this go to subscribers in batches; pyzmq would copy them anyway.
_BATCH_BYTES = 64 * 1024
_BATCH_HEADER_BYTES = DEFAULT_LIMITS.max_header_bytes // 4  # well within what decoders take
# Sent but not yet acknowledged, per subscriber: a window of large taps stays this small.
_IN_FLIGHT_BYTES = 64 * 2**20
_FORWARDER_SILENCE_MIN = 5.0  # seconds; forwarders send a barrier every second
_SPOOL_OVERHEAD = 4096  # bytes a spool record takes beyond its arrays (headers), roughly
_SPOOL_RETRY = 5.0  # seconds after a spool write error (a full disk) before trying again
# Consumer and emitter names whose routing targets are memoized: a peer may send taps of
# a million distinct names; past this many the memo starts again (tapd/daemon/bounds.py).
_TARGETS_CACHED = 4096


_NO_TAP = Message({"kind": "tap", "consumer": ""})  # a spooled unit counted lost unread


@dataclasses.dataclass(frozen=True)
class SpoolSettings:
    directory: Path
    limit: int  # bytes per subscriber's spool
    fallback: str  # policy when it is full: "block" or "drop_newest"


_TOTALS_EVERY = 0.1  # seconds between totals sent without credit (ring emitters)


# What the router routes: one tap, or a run of a ring site's taps (tapd/daemon/runs.py),
# which is queued, delivered and acknowledged as one unit of `count` taps. Emitter
# indices, pending entries and barriers count units; counters count taps.
Unit = Message | TapRun


def _count(unit: Unit) -> int:
    return unit.count if isinstance(unit, TapRun) else 1


@dataclasses.dataclass
class _Pending:
    remaining: int  # subscribers that still have to process this unit
    count: int  # its taps
    lost: bool = False
    # What a forwarder reports of its taps upstream (`Router.ack`): how many an upstream
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
    pending: dict[int, _Pending] = dataclasses.field(default_factory=dict)
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
    local_pid: int | None = None  # an emitter process on this host (from its hello)
    # A forwarder's taps carry its number for them (`fid`); what became of each goes back
    # in the barrier_done after it (docs/PROTOCOL.md, "Forwarding").
    fids: dict[int, int] = dataclasses.field(default_factory=dict)  # index -> fid
    outcomes: list[tuple[int, int, str]] = dataclasses.field(default_factory=list)
    # Last heard (time.monotonic(): hello, barrier, a forwarder's tap); a forwarding
    # daemon silent too long is gone (`Router.expire`): it sends a barrier every second.
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    # Under the spool policy: routed units still pending whose bytes some subscriber
    # holds in memory (not copied to its spool), in index order (`Router.safe_low`).
    unsafe: dict[int, None] = dataclasses.field(default_factory=dict)

    @property
    def held_bytes(self) -> int:
        return self.parked_bytes + self.credit_due


@dataclasses.dataclass
class _Delivery:
    emitter: Emitter
    index: int
    tap: Unit
    nbytes: int
    count: int  # taps: delivery ids tid .. tid + count - 1
    tid: int = -1
    copied: bool = False  # taken back from the spool: its bytes are its own
    spooled: SpoolEntry | None = None  # the spool record its ack lets go


@dataclasses.dataclass
class Subscriber:
    key: PeerKey
    name: str
    patterns: tuple[str, ...]
    window: int
    last_seen: float
    queue: collections.deque[_Delivery] = dataclasses.field(default_factory=collections.deque)
    in_flight: collections.deque[_Delivery] = dataclasses.field(default_factory=collections.deque)
    in_flight_taps: int = 0  # what `window` bounds
    in_flight_bytes: int = 0  # bounded by _IN_FLIGHT_BYTES
    held_bytes: int = 0  # queued + in flight
    delivered: int = 0
    delivered_bytes: int = 0  # (tapd top: MB/s per subscriber)
    dropped: int = 0
    errors: int = 0
    # The emitter's `time` (ns) of the last tap it acknowledged: `tapd top`'s lag.
    last_handled_ns: int | None = None
    deliver: Deliver | None = None  # set for in-process subscribers
    batch: bool = False  # takes `taps` messages (several small taps in one)
    # Patterns it wants only from emitter `fallback_for`, and only while no other
    # subscriber takes them (see `Router._targets`): a JAX process's own tap functions.
    fallback: tuple[str, ...] = ()
    fallback_for: str | None = None
    # Under the spool policy: its taps go to `spool` while `spilling` (its queue was
    # full), and come back, in order, as it catches up; `behind`: taps that come after
    # the spool's but it could not take (full; the fallback is block).
    spool: Spool | None = None
    spilling: bool = False
    behind: collections.deque[_Delivery] = dataclasses.field(default_factory=collections.deque)
    spool_retry: float = 0.0  # after a write error, not before then
    # Worker pools: a member takes its taps from its `group`'s queue, holds them in its
    # own `in_flight` and is never a routing target itself; a group has `members` and no
    # socket of its own. Its `held_bytes` counts its members' taps in flight too.
    group: Subscriber | None = None
    members: list[Subscriber] | None = None
    group_name: str | None = None
    redelivered: int = 0  # (a group's) taps a member left unacknowledged, sent again

    def wants(self, consumer: str) -> bool:
        # exact names, or prefixes written "module:*" (the client matches the same way)
        return any(
            consumer == p or (p.endswith("*") and consumer.startswith(p[:-1]))
            for p in self.patterns
        )

    def takes(self, consumer: str) -> bool:
        """Wants `consumer` by a pattern other than the bare "*" of a watcher (`tapd tail
        '*'`, a forwarder), which takes a copy of everything and no one's place."""
        return _matches([p for p in self.patterns if p != "*"], consumer)


class Router:
    def __init__(
        self, send: Send, *, policy: str, queue_bytes: int, window_bytes: int, daemon_id: str
    ) -> None:
        self._send = send
        self.policy = policy
        self.queue_bytes = queue_bytes
        self.window_bytes = window_bytes
        self.daemon_id = daemon_id
        self.emitters: dict[PeerKey, Emitter] = {}
        self.subscribers: dict[PeerKey, Subscriber] = {}  # members of groups too
        self.groups: dict[tuple[str, tuple[str, ...]], Subscriber] = {}  # by (name, patterns)
        # by (consumer, emitter name or None); cleared on any change
        self._targets_cache: dict[tuple[str, str | None], list[Subscriber]] = {}
        self._next_tid = 0  # delivery ids, one per tap, for every subscriber
        self.counters: collections.Counter[str] = collections.Counter()
        # Until then (time.monotonic()), a tap that no subscriber wants waits, in order,
        # instead of counting as unrouted: the daemon's start-up grace, in which the
        # subscribers of a daemon that was down reconnect (and forwarders send backlogs).
        self.hold_unrouted_until = 0.0
        self.spool: SpoolSettings | None = None  # set under policy "spool"
        self._left_spools: dict[str, Spool] = {}  # found at start, by subscriber name
        # The emitter of taps an earlier daemon spooled: named by each tap's `emitter`.
        self._spooled_before = Emitter(("spool",), "spooled before a restart", forwarder=True)

    # ---- emitters -------------------------------------------------------------------

    def emitter_hello(self, key: PeerKey, header: dict[str, Any]) -> None:
        name = f"{header['host']}:{header['pid']}"
        forwarder = isinstance(header.get("forwarder"), str)
        if forwarder:  # a daemon forwarding its emitters' taps
            name = f"forwarding daemon {header['forwarder']}"
        emitter = self.emitters.get(key) or self.adopt(key, name)
        emitter.name = name  # met first through a tap, it was named after the tap's emitter
        emitter.forwarder = forwarder
        pid = header.get("pid")
        if header.get("host") == _HOSTNAME and isinstance(pid, int) and not forwarder:
            emitter.local_pid = pid
        emitter.gone = False
        emitter.last_seen = time.monotonic()
        self._welcome(emitter, header.get("nonce"))

    def _welcome(self, emitter: Emitter, nonce: Any = None) -> None:
        fields = {
            "window_bytes": self.window_bytes,
            "daemon": self.daemon_id,
            "held_bytes": emitter.held_bytes,
        }
        if type(nonce) is int:  # which hello this answers (tapd/protocol/link.py)
            fields["nonce"] = nonce
        self._send(emitter.key, encode("welcome", fields))

    def tap(
        self, key: PeerKey, tap: Unit, *, credit: bool = True, nbytes: int | None = None
    ) -> int:
        """Take one tap, or a run of them, from emitter `key`; return its index.
        `credit=False` for taps read from a ring, whose space the ring itself bounds."""
        emitter = self.emitters.get(key)
        if emitter is None:  # e.g. this daemon restarted: the tap says who sent it
            header = tap.header
            emitter = self.adopt(key, f"{header['host']}:{header['pid']}")
            emitter.forwarder = "fid" in header  # only forwarders number their taps
            self._welcome(emitter)
        if nbytes is None:
            assert isinstance(tap, Message)
            nbytes = sum(len(f) for f in tap.frames)
        index = emitter.next_index
        emitter.next_index += 1
        if emitter.forwarder and isinstance(tap, Message):
            fid = tap.header.pop("fid", None)  # the forwarder's, not for subscribers
            if type(fid) is int:
                emitter.fids[index] = fid
            emitter.last_seen = time.monotonic()
        count = _count(tap)
        emitter.received += count
        emitter.received_bytes += nbytes
        self.counters["taps_received"] += count
        self.counters["bytes_received"] += nbytes
        credit_bytes = nbytes if credit else 0
        if (
            emitter.parked
            or (self._blocking and not self._has_room(tap, nbytes, emitter))
            or self._held_unrouted(tap, emitter)
        ):
            emitter.parked.append((index, tap, nbytes, credit_bytes))
            emitter.parked_bytes += credit_bytes
            emitter.pending[index] = _Pending(remaining=-1, count=count)  # not routed yet
            return index
        self._route(emitter, index, tap, nbytes, credit_bytes)
        return index

    def adopt(self, key: PeerKey, name: str) -> Emitter:
        """State for a new emitter: from its hello, or met without one (a restarted
        daemon seeing its taps, an orphaned ring)."""
        emitter = self.emitters[key] = Emitter(key, name)
        logger.info("emitter %r connected", name)
        return emitter

    def rekey(self, old: PeerKey, new: PeerKey) -> None:
        """An emitter reconnected under a new socket identity: keep its state."""
        emitter = self.emitters.pop(old, None)
        if emitter is not None:
            self.emitters.pop(new, None)
            emitter.key = new
            self.emitters[new] = emitter

    def _targets(self, consumer: str, emitter: Emitter | None = None) -> list[Subscriber]:
        """The subscribers that want `consumer`; for a tap of `emitter` that none of them
        takes (`Subscriber.takes`), also that emitter's fallback subscribers for it."""
        # Looked up twice per tap: cached until the subscribers change.
        key = (consumer, None if emitter is None else emitter.name)
        targets = self._targets_cache.get(key)
        if targets is None:
            targets = [s for s in self.subscribers.values()
                       if s.group is None and s.wants(consumer)]  # fmt: skip
            if self.groups:  # each group is one target; its members are not
                targets += [g for g in self.groups.values() if g.wants(consumer)]
            if emitter is not None and not any(s.takes(consumer) for s in targets):
                targets += [s for s in self.subscribers.values() if s not in targets
                            and s.fallback_for == emitter.name
                            and _matches(s.fallback, consumer)]  # fmt: skip
            if len(self._targets_cache) >= _TARGETS_CACHED:  # (names are the peers' to pick)
                self._targets_cache.clear()
            self._targets_cache[key] = targets
        return targets

    def run_limit(self, consumer: str, tap_bytes: int) -> int:
        """The most taps of `consumer` (`tap_bytes` each) a ring run may hold: half the
        smallest window of the subscribers it goes to, so that batches still overlap
        acks (1 where one does not batch: its window counts one-tap messages), and half
        a queue, so that queue bounds and drops stay as fine-grained as for single taps."""
        limits = [
            _UNLIMITED if s.deliver is not None else max(1, s.window // 2) if s.batch else 1
            for s in self._targets(consumer)
        ]
        by_queue = max(1, self.queue_bytes // (2 * max(1, tap_bytes)))
        return min(*limits, by_queue, DEFAULT_LIMITS.max_batch)

    def _has_room(self, tap: Unit, nbytes: int, emitter: Emitter) -> bool:
        return all(self._room_for(s, nbytes) for s in self._targets(tap.header["consumer"],
                                                                      emitter))  # fmt: skip

    def _room_for(self, s: Subscriber, nbytes: int) -> bool:
        if not s.spilling and (s.held_bytes == 0 or s.held_bytes + nbytes <= self.queue_bytes):
            return True
        return self.spool is not None and self._spool_takes(s, nbytes)

    @property
    def _blocking(self) -> bool:
        """Whether a tap waits (parked, credit withheld) when a queue has no room."""
        return self.policy == "block" or (self.spool is not None and self.spool.fallback == "block")

    def _held_unrouted(self, tap: Unit, emitter: Emitter) -> bool:
        """Whether `tap` waits, wanted by no subscriber yet, in the start-up grace."""
        return (
            self.hold_unrouted_until > 0
            and not self._targets(tap.header["consumer"], emitter)
            and time.monotonic() < self.hold_unrouted_until
        )

    def _route(
        self, emitter: Emitter, index: int, tap: Unit, nbytes: int, credit_bytes: int
    ) -> None:
        emitter.credit_due += credit_bytes
        targets = self._targets(tap.header["consumer"], emitter)
        count = _count(tap)
        if not targets:
            emitter.unrouted += count
            self.counters["taps_unrouted"] += count
            emitter.pending.pop(index, None)
            self._outcome(emitter, index, "unrouted")
            self._advance(emitter)
            return
        pending = emitter.pending[index] = _Pending(remaining=0, count=count)
        if self.spool is not None:
            emitter.unsafe[index] = None
        for subscriber in targets:
            if self.spool is not None and self._spill(subscriber, emitter, index, tap, nbytes,
                                                      pending):  # fmt: skip
                continue
            if subscriber.held_bytes and subscriber.held_bytes + nbytes > self.queue_bytes:
                subscriber.dropped += count  # drop_newest (block never gets here while full)
                self.counters["deliveries_dropped"] += count
                pending.lost = True
                continue
            subscriber.queue.append(_Delivery(emitter, index, tap, nbytes, count))
            subscriber.held_bytes += nbytes
            pending.remaining += 1
        if pending.remaining == 0:
            self._finish(emitter, index)
        elif pending.copied >= pending.remaining:  # on disk for all: the ring may go on
            emitter.unsafe.pop(index, None)

    def unpark(self) -> None:
        """Route parked taps, in order, as far as queue room allows."""
        for emitter in list(self.emitters.values()):  # (routing may finish and remove one)
            while emitter.parked:
                index, tap, nbytes, credit_bytes = emitter.parked[0]
                if (
                    self._blocking and not self._has_room(tap, nbytes, emitter)
                ) or self._held_unrouted(tap, emitter):
                    break
                emitter.parked.popleft()
                emitter.parked_bytes -= credit_bytes
                self._route(emitter, index, tap, nbytes, credit_bytes)

    def _finish(self, emitter: Emitter, index: int) -> None:
        pending = emitter.pending.pop(index)
        emitter.unsafe.pop(index, None)
        count = pending.count
        dropped = count if pending.lost else pending.dropped
        unrouted = min(pending.unrouted or 0, count - dropped)
        emitter.dropped += dropped
        emitter.unrouted += unrouted
        emitter.delivered += count - dropped - unrouted
        # (a forwarder's taps are single taps: one of the three)
        self._outcome(emitter, index, "dropped" if dropped else "unrouted" if unrouted
                      else "delivered")  # fmt: skip
        self._advance(emitter)

    def _outcome(self, emitter: Emitter, index: int, outcome: str) -> None:
        fid = emitter.fids.pop(index, None) if emitter.fids else None
        if fid is not None:
            emitter.outcomes.append((index, fid, outcome))

    def _advance(self, emitter: Emitter) -> None:
        # `pending` is keyed by index in insertion order, which is index order: its first
        # key is the oldest unit not yet finished.
        emitter.low = next(iter(emitter.pending), emitter.next_index)
        while emitter.barriers and emitter.barriers[0][1] <= emitter.low:
            barrier_id, bound = emitter.barriers.popleft()
            fields: dict[str, Any] = {"id": barrier_id, "delivered": emitter.delivered,
                                      "dropped": emitter.dropped,
                                      "unrouted": emitter.unrouted}  # fmt: skip
            if emitter.forwarder:  # what became of each tap it sent before the barrier
                fields["outcomes"] = self._outcomes_before(emitter, bound)
            self._send(emitter.key, encode("barrier_done", fields))
        if emitter.gone and not emitter.pending:
            self.emitters.pop(emitter.key, None)

    def _outcomes_before(self, emitter: Emitter, bound: int) -> list[list[Any]]:
        final = [(fid, outcome) for index, fid, outcome in emitter.outcomes if index < bound]
        if not final:
            return []
        ranges, left = outcome_ranges(final)
        later = [entry for entry in emitter.outcomes if entry[0] >= bound]
        emitter.outcomes = [(-1, fid, outcome) for fid, outcome in left] + later
        return ranges

    def barrier(self, key: PeerKey, barrier_id: int) -> None:
        emitter = self.emitters.get(key)
        if emitter is None:
            self._send(key, encode("rehello", {}))
            return
        emitter.last_seen = time.monotonic()
        emitter.barriers.append((barrier_id, emitter.next_index))
        self._advance(emitter)

    def emitter_bye(self, key: PeerKey) -> None:
        emitter = self.emitters.get(key)
        if emitter is not None:
            emitter.gone = True
            logger.info("emitter %r disconnected", emitter.name)
            self._advance(emitter)

    def refused(
        self,
        key: PeerKey,
        consumer: str,
        seq: int,
        error: str,
        *,
        credit_bytes: int = 0,
        tap: bool = True,
        report: bool = True,
    ) -> int:
        """A tap of emitter `key` that this daemon refused (malformed, too large for its
        subscribers): reported to the emitter as an `error`, so that its barrier_wait
        raises, counted dropped, and finished at once; its bytes are credited back.
        Returns its index (ring records are released by index). `tap=False`: another
        message of the emitter's, refused: only reported. `report=False`: counted, not
        reported (the peer had its share of errors: tapd/daemon/bounds.py)."""
        emitter = self.emitters.get(key)
        if emitter is None:
            return -1
        index = emitter.next_index
        if tap:
            emitter.next_index += 1
            emitter.received += 1
            emitter.dropped += 1
            self.counters["taps_refused"] += 1
        emitter.credit_due += credit_bytes
        if not report:
            self.counters["refusals_unreported"] += 1
        elif not emitter.gone:
            self._send(key, encode("error", {
                "consumer": consumer, "seq": seq, "error": error, "subscriber": "tapd daemon",
                "emitter": emitter.name, "device": None,
            }))  # fmt: skip
        self._advance(emitter)
        return index

    def forget_dead_emitters(self, alive: Callable[[int], bool], skip: Container[Any]) -> None:
        """Emitters on this host that died without saying bye (kill -9) leave their
        state here: finish it as if they had (`skip`: emitters whose rings still
        hold taps; the rings' own check handles those)."""
        for key, emitter in list(self.emitters.items()):
            pid = emitter.local_pid
            if pid is not None and not emitter.gone and key not in skip and not alive(pid):
                logger.info("emitter %r (pid %d) is gone without a bye", emitter.name, pid)
                self.emitter_bye(key)

    def flush_credit(self, *, now: float | None = None, final: bool = False) -> None:
        """Return credit; with it (or alone, at most every `_TOTALS_EVERY` s, and at
        shutdown: `final`), this emitter's totals here, so that an emitter whose daemon
        restarts still knows what the old one finished (docs/PROTOCOL.md, `credit`)."""
        now = time.monotonic() if now is None else now
        for emitter in list(self.emitters.values()):
            totals = (emitter.delivered, emitter.dropped, emitter.unrouted)
            due = totals != emitter.reported and (
                final or now - emitter.reported_at >= _TOTALS_EVERY
            )
            if emitter.credit_due or due:
                fields = {"bytes": emitter.credit_due}
                if totals != emitter.reported:
                    fields.update(delivered=totals[0], dropped=totals[1], unrouted=totals[2])
                    emitter.reported, emitter.reported_at = totals, now
                self._send(emitter.key, encode("credit", fields))
                emitter.credit_due = 0

    # ---- subscribers ----------------------------------------------------------------

    def subscriber_hello(self, key: PeerKey, header: dict[str, Any], now: float) -> None:
        # (decode checked every field: tapd/protocol/schema.py, SUBSCRIBER_HELLO)
        consumers, window = header["consumers"], header["window"]
        # Which of `consumers` are fallbacks, for which emitter (docs/PROTOCOL.md, "hello")
        owner = header.get("fallback_for")
        marked = header.get("fallback")
        fallback = [c for c in consumers if isinstance(marked, list) and c in marked]
        group = header.get("group")  # a worker pool's members have no fallbacks
        if group is not None or not (isinstance(owner, str)
                                     and 0 < len(owner) <= DEFAULT_LIMITS.max_id):  # fmt: skip
            owner, fallback = None, []
        patterns = tuple(c for c in consumers if c not in fallback)
        if group is not None:  # (a group's key: in whatever order its members list them)
            patterns = tuple(sorted(set(patterns)))
        known = self.subscribers.get(key)
        if header.get("update") is True:  # more consumers, same session: nothing in flight lost
            if known is None:  # e.g. this daemon restarted: a full hello, please
                self._send(key, encode("rehello", {}))
                return
            if known.group is not None or group is not None:
                if known.group_name == group and known.patterns == patterns:
                    known.last_seen = now
                    self._send(key, encode("welcome", {"window_bytes": 0,
                                                       "daemon": self.daemon_id}))  # fmt: skip
                    return
                # Other consumers make another group (they key it): it leaves this one,
                # and what it held goes to the other members.
                self.drop_subscriber(key, "changed its consumers or group")
                known = None
        if header.get("update") is True and known is not None:
            known.patterns, known.fallback, known.fallback_for = patterns, tuple(fallback), owner
            known.last_seen = now
            self._targets_cache.clear()
            logger.info("subscriber %r now wants %r", known.name, consumers)
            self._send(key, encode("welcome", {"window_bytes": 0, "daemon": self.daemon_id}))
            return
        if (
            known is not None
            and known.deliver is None
            and _same_subscription(known, patterns, owner, group)
        ):
            # The same subscription again (it answered two rehellos, say): it starts its
            # delivery ids afresh, so what it had in flight goes to it again, same seq.
            again = self._deliver_again(known)
            known.window, known.batch, known.last_seen = window, header.get("batch") is True, now
            if known.group is not None:
                self._size_group(known.group)
            logger.info("subscriber %r said hello again; the %d taps it had in flight go to "
                        "it again", known.name, again)  # fmt: skip
            self._send(key, encode("welcome", {"window_bytes": 0, "daemon": self.daemon_id}))
            return
        if known is not None:
            self.drop_subscriber(key, "said hello again")
        name = str(header.get("name", "")) or repr(key)
        self._targets_cache.clear()
        if group is not None:
            self._join(key, name, group, patterns, window, header.get("batch") is True, now)
            self._send(key, encode("welcome", {"window_bytes": 0, "daemon": self.daemon_id}))
            return
        self.subscribers[key] = Subscriber(key, name, patterns, window, now,
                                           batch=header.get("batch") is True,
                                           fallback=tuple(fallback),
                                           fallback_for=owner)  # fmt: skip
        logger.info("subscriber %r connected for %r", name, consumers)
        self._adopt_spool(self.subscribers[key])
        self._send(key, encode("welcome", {"window_bytes": 0, "daemon": self.daemon_id}))

    def _join(self, key: PeerKey, name: str, group_name: str, patterns: tuple[str, ...],
              window: int, batch: bool, now: float) -> None:  # fmt: skip
        """A member of the worker pool (`group_name`, `patterns`), formed by its first."""
        group = self.groups.get((group_name, patterns))
        if group is None:
            # Named with its consumers: it is also the name of its spool, which another
            # group of this name but other consumers must not share.
            label = f"group {group_name} ({', '.join(patterns)})"
            group = Subscriber(("group", group_name, patterns), label, patterns, window, now,
                               members=[], group_name=group_name)  # fmt: skip
            self.groups[(group_name, patterns)] = group
            self._adopt_spool(group)
        assert group.members is not None
        member = Subscriber(key, name, patterns, window, now, batch=batch, group=group,
                            group_name=group_name)  # fmt: skip
        self.subscribers[key] = member
        group.members.append(member)
        self._size_group(group)
        logger.info("subscriber %r joined group %r (%d members) for %r", name, group_name,
                    len(group.members), list(patterns))  # fmt: skip

    def _size_group(self, group: Subscriber) -> None:
        """What routing reads of a group as a target (`run_limit`): a run must fit any
        member, and only batch-taking members may get batches."""
        assert group.members
        group.window = min(m.window for m in group.members)
        group.batch = all(m.batch for m in group.members)

    def _leave(self, member: Subscriber, why: str, *, shutdown: bool = False) -> None:
        """A member is gone: what it had not acknowledged goes back to the front of its
        group's queue, for the others (at least once: it may have handled some). With no
        member left the group goes as a subscriber does, its taps counted lost."""
        group, member.group = member.group, None
        assert group is not None and group.members is not None
        group.members.remove(member)
        back = [*member.in_flight, *member.queue]
        taps = sum(d.count for d in back)
        group.queue.extendleft(reversed(back))  # (its bytes were the group's all along)
        group.delivered += member.delivered
        group.delivered_bytes += member.delivered_bytes
        group.errors += member.errors
        if not group.members:
            del self.groups[(group.group_name or "", group.patterns)]
            self._lose(group, f"lost its last member, {member.name!r}, which {why}")
            return
        if shutdown:
            return
        if taps:
            group.redelivered += taps
            self.counters["deliveries_redelivered"] += taps
            logger.warning("subscriber %r of group %r %s; the %d taps it had not acknowledged "
                           "go to the other members (%d)", member.name, group.group_name, why,
                           taps, len(group.members))  # fmt: skip
        else:
            logger.info("subscriber %r of group %r %s; %d members remain", member.name,
                        group.group_name, why, len(group.members))  # fmt: skip
        self._size_group(group)

    def _deliver_again(self, subscriber: Subscriber) -> int:
        """Its deliveries in flight back to the front of its queue, in order; how many
        taps they hold."""
        taps = subscriber.in_flight_taps
        subscriber.queue.extendleft(reversed(subscriber.in_flight))
        subscriber.in_flight.clear()
        subscriber.in_flight_taps = subscriber.in_flight_bytes = 0
        self.counters["deliveries_resent"] += taps
        return taps

    def add_local_subscriber(
        self, key: PeerKey, name: str, patterns: Sequence[str], deliver: Deliver, now: float
    ) -> None:
        """An in-process subscriber: fed through `deliver`, with no message-count window
        (its bytes are still bounded by `queue_bytes` and the policy) and never expired."""
        self._targets_cache.clear()
        self.subscribers[key] = Subscriber(
            key, name, tuple(patterns), _UNLIMITED, now, deliver=deliver
        )
        self._adopt_spool(self.subscribers[key])

    def ack(self, key: PeerKey, header: dict[str, Any], now: float) -> None:
        subscriber = self.subscribers.get(key)
        if subscriber is None:
            self._send(key, encode("rehello", {}))
            return
        subscriber.last_seen = now
        in_flight = subscriber.in_flight
        owner = subscriber if subscriber.group is None else subscriber.group  # holds its bytes
        # Errors go to their emitters at once: an ack may end inside a run, whose
        # delivery then stays in flight until a later ack covers the rest of it.
        for entry in header["errors"]:
            tid = entry.get("tid") if isinstance(entry, dict) else None
            delivery = next((d for d in in_flight if type(tid) is int
                             and d.tid <= tid < d.tid + d.count), None)  # fmt: skip
            if delivery is not None:
                assert isinstance(tid, int)
                subscriber.errors += 1
                self.counters["handler_errors"] += 1
                self._report_error(subscriber, delivery, tid, str(entry.get("error")))
        upto = header["upto"]
        # An in-process forwarder also says which taps its upstream dropped or had no
        # subscriber for (sets of tids); a socket subscriber's ack cannot.
        dropped, unrouted = (
            (header.get("dropped", ()), header.get("unrouted", ()))
            if subscriber.deliver is not None
            else ((), ())
        )
        last: _Delivery | None = None
        while in_flight and in_flight[0].tid + in_flight[0].count <= upto + 1:
            delivery = last = in_flight.popleft()
            owner.held_bytes -= delivery.nbytes
            subscriber.in_flight_taps -= delivery.count
            subscriber.in_flight_bytes -= delivery.nbytes
            subscriber.delivered += delivery.count
            subscriber.delivered_bytes += delivery.nbytes
            self.counters["deliveries_acked"] += delivery.count
            tids = range(delivery.tid, delivery.tid + delivery.count)
            if delivery.spooled is not None and owner.spool is not None:
                owner.spool.acknowledge(delivery.spooled)
            self._delivered(
                delivery,
                lost=False,
                dropped=sum(t in dropped for t in tids) if dropped else 0,
                unrouted=sum(t in unrouted for t in tids) if unrouted else 0,
            )
        if last is not None:  # once per ack, not per tap: the hot path stays O(1) here
            tap = last.tap
            when = tap.last_time_ns if isinstance(tap, TapRun) else tap.header.get("time")
            if type(when) is int:
                subscriber.last_handled_ns = when
                emitter = last.emitter
                if emitter.last_handled_ns is None or when > emitter.last_handled_ns:
                    emitter.last_handled_ns = when

    def heartbeat(self, key: PeerKey, now: float) -> None:
        subscriber = self.subscribers.get(key)
        if subscriber is None:
            self._send(key, encode("rehello", {}))
        else:
            subscriber.last_seen = now

    def _report_error(
        self, subscriber: Subscriber, delivery: _Delivery, tid: int, error: str
    ) -> None:
        emitter = delivery.emitter
        if emitter.gone:
            return
        tap = delivery.tap
        header = (tap.tap(tid - delivery.tid) if isinstance(tap, TapRun) else tap).header
        self._send(emitter.key, encode("error", {
            "consumer": header["consumer"], "seq": header["seq"], "error": error,
            "subscriber": subscriber.name,
            # which tap, for a forwarder that has to pass the error on to its emitter
            "emitter": _emitter_name(delivery), "device": header.get("device"),
        }))  # fmt: skip

    def _delivered(
        self, delivery: _Delivery, *, lost: bool, dropped: int = 0, unrouted: int = 0
    ) -> None:
        emitter = delivery.emitter
        pending = emitter.pending.get(delivery.index)
        if pending is None:
            return
        pending.lost |= lost
        if not lost:
            pending.dropped = max(pending.dropped, dropped)
            pending.unrouted = unrouted if pending.unrouted is None else min(
                pending.unrouted, unrouted)  # fmt: skip
        pending.remaining -= 1
        pending.copied -= delivery.copied
        if pending.remaining == 0:
            self._finish(emitter, delivery.index)
        elif emitter.unsafe and pending.copied >= pending.remaining:
            emitter.unsafe.pop(delivery.index, None)

    def pump(self) -> None:
        """Send each subscriber what its window allows."""
        for subscriber in list(self.subscribers.values()):
            self._pump_one(subscriber)
        if self.groups:
            for group in list(self.groups.values()):
                self._pump_group(group)

    def _pump_one(self, subscriber: Subscriber) -> None:
        if subscriber.spilling:
            self._refill(subscriber)
        while (subscriber.queue and subscriber.in_flight_taps < subscriber.window
               and (not subscriber.in_flight_bytes or subscriber.in_flight_bytes
                    + subscriber.queue[0].nbytes <= _IN_FLIGHT_BYTES)):  # fmt: skip
            if not self._send_next(subscriber):
                self.drop_subscriber(subscriber.key, "is unreachable")
                break

    def _pump_group(self, group: Subscriber) -> None:
        """Hand a group's queued taps to its members: each unit to the member with the
        most free credit (a slow one, holding unacknowledged taps, gets fewer), as many
        as one batch to it would hold; ties go round. The rest waits in the group's
        queue, under its bound and the policy, as a subscriber's does."""
        if group.spilling:
            self._refill(group)
        queue, members = group.queue, group.members
        assert members is not None
        while queue and members:
            nbytes = queue[0].nbytes
            best, free = None, 0
            for m in members:
                room = m.window - m.in_flight_taps
                if (
                    room > free
                    and not m.queue
                    and (not m.in_flight_bytes or m.in_flight_bytes + nbytes <= _IN_FLIGHT_BYTES)
                ):
                    best, free = m, room
            if best is None:
                return
            limit = min(free, max(1, best.window // 2)) if best.batch else 1
            taps = 0
            while queue and (not taps or taps + queue[0].count <= limit):
                delivery = queue.popleft()
                best.queue.append(delivery)
                taps += delivery.count
            members.remove(best)  # to the back: the next tie goes to another member
            members.append(best)
            self._pump_one(best)  # (unreachable: dropped, its taps back in `queue`)

    def _send_next(self, subscriber: Subscriber) -> bool:
        """Send the next queued unit, or the next small ones together as one `taps`
        message; False if the subscriber is unreachable."""
        if subscriber.deliver is not None:
            delivery = self._start_delivery(subscriber)
            name = _emitter_name(delivery)
            size = delivery.nbytes // delivery.count
            for i, tap in enumerate(_taps_of(delivery)):
                subscriber.deliver(delivery.tid + i, tap, name, size)
            return True
        queue = subscriber.queue
        if subscriber.batch and queue[0].nbytes <= _BATCH_BYTES:
            # Up to half a window per message, so that the subscriber's ack of one batch
            # overlaps its work on the next.
            room = subscriber.window - subscriber.in_flight_taps
            limit = min(room, max(1, subscriber.window // 2), DEFAULT_LIMITS.max_batch)
            deliveries = [self._start_delivery(subscriber)]
            taps, size = deliveries[0].count, deliveries[0].nbytes
            while (queue and taps + queue[0].count <= limit
                   and size + queue[0].nbytes <= _BATCH_BYTES):  # fmt: skip
                deliveries.append(self._start_delivery(subscriber))
                taps += deliveries[-1].count
                size += deliveries[-1].nbytes
            frames = encode_batch([_batch_piece(d) for d in deliveries])
            if len(frames[1]) <= _BATCH_HEADER_BYTES or taps == 1:
                return self._send(subscriber.key, frames)
            # Many distinct, large headers (rare): a batch could exceed what a subscriber
            # accepts, so these go one by one.
            return all(self._send_each(subscriber, d) for d in deliveries)
        return self._send_each(subscriber, self._start_delivery(subscriber))

    def _send_each(self, subscriber: Subscriber, delivery: _Delivery) -> bool:
        """The delivery's taps as `tap` messages, one each."""
        name = _emitter_name(delivery)
        for i, tap in enumerate(_taps_of(delivery)):
            header = {**tap.header, "tid": delivery.tid + i, "emitter": name}
            if not self._send(subscriber.key, [MAGIC, encode_header(header), *tap.frames]):
                return False
        return True

    def _start_delivery(self, subscriber: Subscriber) -> _Delivery:
        delivery = subscriber.queue.popleft()
        delivery.tid = self._next_tid
        self._next_tid += delivery.count
        subscriber.in_flight.append(delivery)
        subscriber.in_flight_taps += delivery.count
        subscriber.in_flight_bytes += delivery.nbytes
        return delivery

    def drop_subscriber(self, key: PeerKey, why: str, *, shutdown: bool = False) -> None:
        """A subscriber is gone. At `shutdown` a group member's taps go back to its group
        without being counted as redelivered: the others are going too, and the last
        one's going counts what the group held as lost, once."""
        subscriber = self.subscribers.pop(key, None)
        self._targets_cache.clear()
        if subscriber is None:
            return
        if subscriber.group is not None:
            self._leave(subscriber, why, shutdown=shutdown)
        else:
            self._lose(subscriber, why)

    def _lose(self, subscriber: Subscriber, why: str) -> None:
        """A subscriber (or a group) is gone: what it held is lost, and counted."""
        lost = list(subscriber.in_flight) + list(subscriber.queue) + list(subscriber.behind)
        lost += self._spooled_deliveries(subscriber)
        taps = sum(delivery.count for delivery in lost)
        if lost:
            logger.warning(
                "subscriber %r %s; %d taps it had not processed are lost",
                subscriber.name,
                why,
                taps,
            )
        else:
            logger.info("subscriber %r %s", subscriber.name, why)
        self.counters["deliveries_lost"] += taps
        for delivery in lost:
            self._delivered(delivery, lost=True)

    # ---- the spool policy (tapd/daemon/spool.py) ----------------------------------------

    def safe_low(self, emitter: Emitter) -> int:
        """Every unit of `emitter` below this index is finished, or copied to the spools
        of the subscribers that still have it: its ring space may be released."""
        if self.spool is None:
            return emitter.low
        low = next(iter(emitter.unsafe), emitter.next_index)
        return min(low, emitter.parked[0][0]) if emitter.parked else low

    def configure_spool(self, directory: Path, limit: int, fallback: str) -> None:
        """Policy "spool": full queues spill to logs under `directory` (`limit` bytes
        each; then `fallback`). Logs an earlier daemon left wait for their subscribers."""
        self.spool = SpoolSettings(directory, limit, fallback)
        for name in find_spools(directory):
            self._left_spools[name] = Spool(directory, name, limit)

    def _adopt_spool(self, subscriber: Subscriber) -> None:
        left = self._left_spools.pop(subscriber.name, None)
        if left is not None:
            subscriber.spool, subscriber.spilling = left, True
            logger.info("subscriber %r gets first the %d taps an earlier daemon spooled "
                        "for it", subscriber.name, left.taps)  # fmt: skip

    def _spool_takes(self, s: Subscriber, nbytes: int) -> bool:
        assert self.spool is not None
        if time.monotonic() < s.spool_retry:
            return False
        used = s.spool.bytes if s.spool is not None else 0
        return used + nbytes + _SPOOL_OVERHEAD <= self.spool.limit

    def _spill(self, s: Subscriber, emitter: Emitter, index: int, tap: Unit, nbytes: int,
               pending: _Pending) -> bool:  # fmt: skip
        """Route one unit to `s` under the spool policy if its queue is full (or its spool
        not yet empty, to keep order); False to route it the usual way."""
        assert self.spool is not None
        if not s.spilling and (not s.held_bytes or s.held_bytes + nbytes <= self.queue_bytes):
            return False
        count = _count(tap)
        delivery = _Delivery(emitter, index, tap, nbytes, count)
        if self._spool_append(s, delivery):
            pending.remaining += 1
            pending.copied += 1
            s.spilling = True
            return True
        if self.spool.fallback == "drop_newest":
            s.dropped += count
            self.counters["deliveries_dropped"] += count
            self.counters["spool_fallback_dropped"] += count
            pending.lost = True
            return True
        # block: in memory, after what is spooled (later taps wait, parked: `_room_for`)
        (s.behind if s.spilling else s.queue).append(delivery)
        if not s.spilling:
            s.held_bytes += nbytes
        pending.remaining += 1
        return True

    def _spool_append(self, s: Subscriber, delivery: _Delivery) -> bool:
        assert self.spool is not None
        if time.monotonic() < s.spool_retry:
            return False
        tap = delivery.tap
        try:
            if s.spool is None:
                s.spool = Spool(self.spool.directory, s.name, self.spool.limit)
            taps = tap.taps() if isinstance(tap, TapRun) else [tap]
            s.spool.append(taps, _emitter_name(delivery), delivery.nbytes,
                           owner=(delivery.emitter, delivery.index))  # fmt: skip
        except (SpoolFull, SpoolError, OSError) as exc:
            full = isinstance(exc, SpoolFull)
            if not full:  # the disk, not the bound: try again in a while
                s.spool_retry = time.monotonic() + _SPOOL_RETRY
            counter = "spool_full" if full else "spool_errors"
            if not self.counters[counter]:
                logger.error("subscriber %r: %s; falling back to %s (further ones counted "
                             "in %s)", s.name, exc, self.spool.fallback, counter)  # fmt: skip
            self.counters[counter] += delivery.count
            return False
        self.counters["taps_spooled"] += delivery.count
        return True

    def _refill(self, s: Subscriber) -> None:
        """Take spooled taps back into `s`'s queue, in order, as far as it has room;
        then those held behind; then it is caught up."""
        spool = s.spool
        while True:
            if spool is not None and spool.entries:
                nbytes = spool.entries[0].nbytes
            elif s.behind:
                nbytes = s.behind[0].nbytes
            else:
                s.spilling = False
                if spool is not None and not spool.bytes:
                    spool.remove()
                    s.spool = None
                return
            if s.held_bytes and s.held_bytes + nbytes > self.queue_bytes:
                return
            if spool is not None and spool.entries:
                taken = spool.take()
                if taken is not None:
                    self._queue_taken(s, taken)
            else:
                delivery = s.behind.popleft()
                s.queue.append(delivery)
                s.held_bytes += delivery.nbytes

    def _queue_taken(self, s: Subscriber, taken: Taken) -> None:
        entry = taken.entry
        emitter, index = entry.owner if entry.owner is not None else (self._spooled_before, -1)
        pending = emitter.pending.get(index)
        count = len(taken.taps)
        if pending is not None and count > 1:  # one delivery per tap now
            pending.remaining += count - 1
            pending.copied += count - 1
        each = entry.nbytes // max(1, count)
        for i, tap in enumerate(taken.taps):
            tap.header.setdefault("emitter", taken.emitter)
            last = i == count - 1
            nbytes = entry.nbytes - each * (count - 1) if last else each
            s.queue.append(_Delivery(emitter, index, tap, nbytes, 1, copied=True,
                                     spooled=entry if last else None))  # fmt: skip
            s.held_bytes += nbytes
        self.counters["taps_unspooled"] += count

    def _spooled_deliveries(self, s: Subscriber) -> list[_Delivery]:
        """A dropped subscriber's spool: deliveries standing for its records (counted
        lost), the log removed."""
        spool, s.spool, s.spilling = s.spool, None, False
        if spool is None:
            return []
        lost = []
        for entry in spool.entries:
            emitter, index = entry.owner if entry.owner is not None else (self._spooled_before,
                                                                          -1)  # fmt: skip
            lost.append(_Delivery(emitter, index, _NO_TAP, entry.nbytes, entry.count,
                                  copied=True))  # fmt: skip
        spool.remove()
        return lost

    def close_spools(self) -> None:
        """At shutdown: spools stay on disk for the next daemon, not counted lost."""
        for s in [*self.subscribers.values(), *self.groups.values()]:
            if s.spool is not None:
                if s.spool.taps:
                    logger.warning("subscriber %r: %d taps stay in its spool at %s for the "
                                   "next daemon", s.name, s.spool.taps,
                                   s.spool.directory)  # fmt: skip
                s.spool.close()
                s.spool, s.spilling = None, False
        for spool in self._left_spools.values():
            spool.close()

    def expire(self, now: float, timeout: float) -> None:
        for subscriber in list(self.subscribers.values()):
            if subscriber.deliver is None and now - subscriber.last_seen > timeout:
                self.drop_subscriber(subscriber.key, f"was silent for {timeout:g} s")
        # A forwarding daemon killed without a bye: nothing else would remove it.
        silence = max(3 * timeout, _FORWARDER_SILENCE_MIN)
        for emitter in list(self.emitters.values()):
            if emitter.forwarder and not emitter.gone and now - emitter.last_seen > silence:
                logger.info("%s was silent for %g s: forgotten", emitter.name, silence)
                self.emitter_bye(emitter.key)

    # ---- bookkeeping ----------------------------------------------------------------

    def reject(self, reason: str, detail: str) -> None:
        """Count a refused message; log each reason the first time it is seen."""
        self.counters[f"rejected_{reason}"] += 1
        log = logger.warning if self.counters[f"rejected_{reason}"] == 1 else logger.debug
        log("rejected a message (%s): %s (further ones counted, not logged)", reason, detail)

    def idle(self) -> bool:
        """Nothing queued, in flight or parked anywhere."""
        return not any(e.pending for e in self.emitters.values()) and not any(
            s.queue or s.in_flight or s.spilling
            for s in [*self.subscribers.values(), *self.groups.values()]
        )

    def stats(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "emitters": [_emitter_stats(e) for e in self.emitters.values()],
            "subscribers": [_subscriber_stats(s) for s in self.subscribers.values()],
            "groups": [_group_stats(g) for g in self.groups.values()],
            "queue_bytes": self.queue_bytes,  # each subscriber's queue bound
            "time": time.time(),
        }


def _matches(patterns: Sequence[str], consumer: str) -> bool:
    return any(consumer == p or (p.endswith("*") and consumer.startswith(p[:-1])) for p in patterns)


def _same_subscription(
    known: Subscriber, patterns: tuple[str, ...], owner: str | None, group: str | None
) -> bool:
    return known.patterns == patterns and known.fallback_for == owner and known.group_name == group


def _taps_of(delivery: _Delivery) -> list[Message]:
    tap = delivery.tap
    return tap.taps() if isinstance(tap, TapRun) else [tap]


def _batch_piece(delivery: _Delivery) -> BatchTap | BatchRun:
    tap = delivery.tap
    name = _emitter_name(delivery)
    if isinstance(tap, TapRun):
        return tap.batch_piece(delivery.tid, name)
    return BatchTap(tap.header, tap.frames, delivery.tid, name, tap.site)


def _emitter_name(delivery: _Delivery) -> str:
    """The emitter a subscriber is told about: the one named in a forwarded tap (a
    forwarding daemon passes on its emitter's name), else the one that sent it here:
    no other emitter may speak for another."""
    name = delivery.tap.header.get("emitter") if delivery.emitter.forwarder else None
    return name if isinstance(name, str) else delivery.emitter.name


def _emitter_stats(e: Emitter) -> dict[str, Any]:
    return {
        "name": e.name,
        "taps": e.received,
        "bytes": e.received_bytes,
        "delivered": e.delivered,
        "dropped": e.dropped,
        "unrouted": e.unrouted,
        "pending": len(e.pending),
        "parked_bytes": e.parked_bytes,
        "last_handled_time": None if e.last_handled_ns is None else e.last_handled_ns / 1e9,
    }


def _subscriber_stats(s: Subscriber) -> dict[str, Any]:
    return {
        "name": s.name,
        "consumers": list(s.patterns),
        "fallback": list(s.fallback),
        "queued": sum(d.count for d in s.queue),
        "in_flight": s.in_flight_taps,
        "held_bytes": s.held_bytes,
        "delivered": s.delivered,
        "delivered_bytes": s.delivered_bytes,
        "dropped": s.dropped,
        "errors": s.errors,
        "spooled": (s.spool.taps if s.spool else 0) + sum(d.count for d in s.behind),
        "spool_bytes": s.spool.bytes if s.spool else 0,
        # seconds since the epoch, on the emitter's clock (None: nothing handled yet)
        "last_handled_time": None if s.last_handled_ns is None else s.last_handled_ns / 1e9,
        "group": s.group_name,
    }


def _group_stats(g: Subscriber) -> dict[str, Any]:
    """A worker pool: its queue and counts; taps in flight are its members'."""
    members = g.members or []
    handled = [m.last_handled_ns for m in members if m.last_handled_ns is not None]
    return {
        **_subscriber_stats(g),
        "members": sorted(m.name for m in members),  # (their order here changes)
        "in_flight": sum(m.in_flight_taps for m in members),
        "delivered": g.delivered + sum(m.delivered for m in members),
        "delivered_bytes": g.delivered_bytes + sum(m.delivered_bytes for m in members),
        "errors": g.errors + sum(m.errors for m in members),
        "redelivered": g.redelivered,
        "last_handled_time": max(handled) / 1e9 if handled else None,
    }


def summarize(stats: dict[str, Any]) -> Sequence[str]:
    """Human-readable lines for `tapd status`."""
    counters = stats["counters"]
    lines = [", ".join(f"{k}={v}" for k, v in sorted(counters.items())) or "no traffic yet"]
    lines += [f"emitter {e['name']}: {e}" for e in stats["emitters"]]
    lines += [f"subscriber {s['name']}: {s}" for s in stats["subscribers"]]
    lines += [f"{g['name']}: {g}" for g in stats.get("groups", [])]
    lines += [f"ring {r['path']}: {r}" for r in stats.get("rings", [])]
    if forward := stats.get("forward"):
        lines.append(f"forward to {forward['endpoint']}: {forward}")
    if metrics := stats.get("metrics"):
        lines.append(f"Prometheus metrics at {metrics}")
    return lines
