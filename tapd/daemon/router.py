"""The daemon's routing: emitters and their credit, the order of their barriers, and
each tap's way to the targets that take it (the table from consumer to target:
tapd/daemon/routes.py; the subscribers, their hellos and acks: tapd/daemon/subscribers.py,
`Router.subscribers`).

No sockets here: the server feeds decoded messages in and the router answers through the
`send(peer, frames)` callable it was given. Every unit (a tap, or a run of ring taps:
tapd/daemon/deliveries.py) gets an index per emitter and is offered to each target that
wants its consumer: a socket subscriber, an in-process one, a worker pool, each wrapped
with its spool under the spool policy (tapd/daemon/targets/). It is "pending" until each
of them has acknowledged it (or lost it), which is what barriers wait for; the ledger
(tapd/daemon/ledger.py) keeps that account.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Container, Mapping
from typing import Any

from tapd.daemon.deliveries import Delivery, Emitter, PeerKey, Pending, Send, Unit, unit_count
from tapd.daemon.ledger import Ledger
from tapd.daemon.routes import Routes
from tapd.daemon.sampling import keeping, samples
from tapd.daemon.subscribers import Subscribers
from tapd.daemon.targets.base import Offer, Target
from tapd.protocol import Message, encode
from tapd.protocol.rules import DEFAULT_LIMITS

logger = logging.getLogger("tapd.daemon")

_HOSTNAME = socket.gethostname()  # emitters that say this host are local: pids checkable
_FORWARDER_SILENCE_MIN = 5.0  # seconds; forwarders send a barrier every second
_TOTALS_EVERY = 0.1  # seconds between totals sent without credit (ring emitters)


class Router:
    def __init__(
        self, send: Send, *, policy: str, queue_bytes: int, window_bytes: int, daemon_id: str
    ) -> None:
        self.send = send
        self.ledger = Ledger(send)  # what became of each unit; the daemon's counters
        self.policy = policy
        self.queue_bytes = queue_bytes
        self.window_bytes = window_bytes
        self.daemon_id = daemon_id
        self.routes = Routes(lambda: self.subscribers.targets())
        self.subscribers = Subscribers(
            self.ledger, queue_bytes=queue_bytes, daemon_id=daemon_id, changed=self.routes.changed
        )
        self.emitter_hellos = 0  # grows with each emitter's hello (wants.py: forwarders)
        # Until then (time.monotonic()), a tap that no subscriber wants waits, in order,
        # instead of counting as unrouted: the daemon's start-up grace, in which the
        # subscribers of a daemon that was down reconnect (and forwarders send backlogs).
        self.hold_unrouted_until = 0.0

    @property
    def emitters(self) -> Mapping[PeerKey, Emitter]:
        return self.ledger.emitters

    @property
    def counters(self) -> Mapping[str, int]:
        return self.ledger.counters

    def set_wanted(self, key: PeerKey, wanted: tuple[tuple[str, int], ...] | None) -> None:
        """What subscriber `key` takes from sites that may be dormant, where it is
        narrower than its patterns (a forwarder: what its upstream's takers want);
        None: its patterns (tapd/daemon/sampling.py, `taken_every`)."""
        peer = self.subscribers.peers.get(key)
        if peer is not None and peer.subscription.wanted != wanted:
            peer.subscription.wanted = wanted
            self.routes.changed()

    def takers(self, consumer: str, key: PeerKey) -> list[Target]:
        """The targets that take `consumer` from emitter `key` (fallbacks included)."""
        return list(self.routes.targets_of(consumer, self.emitters.get(key)))

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
        emitter.hellos += 1
        self.emitter_hellos += 1
        self._welcome(emitter, header.get("nonce"))

    def _welcome(self, emitter: Emitter, nonce: Any = None) -> None:
        fields = {
            "window_bytes": self.window_bytes,
            "daemon": self.daemon_id,
            "held_bytes": emitter.held_bytes,
        }
        if type(nonce) is int:  # which hello this answers (tapd/protocol/link.py)
            fields["nonce"] = nonce
        self.send(emitter.key, encode("welcome", fields))

    def takes_from(self, key: PeerKey) -> bool:
        """Whether emitter `key` is known and none of its taps wait for queue room: a
        ring drain stops reading while one does (policy block)."""
        emitter = self.ledger.emitters.get(key)
        return emitter is not None and not emitter.parked

    def in_grace(self) -> bool:
        """Whether the start-up grace runs: taps no subscriber wants yet wait for one."""
        return time.monotonic() < self.hold_unrouted_until

    def parked_taps(self) -> int:
        return sum(len(e.parked) for e in self.ledger.emitters.values())

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
        count = unit_count(tap)
        emitter.received += count
        emitter.received_bytes += nbytes
        self.ledger.count("taps_received", count)
        self.ledger.count("bytes_received", nbytes)
        credit_bytes = nbytes if credit else 0
        if (
            emitter.parked
            or (self._blocking and not self._has_room(tap, nbytes, emitter))
            or self._held_unrouted(tap, emitter)
        ):
            emitter.parked.append((index, tap, nbytes, credit_bytes))
            emitter.parked_bytes += credit_bytes
            emitter.pending[index] = Pending(remaining=-1, count=count)  # not routed yet
            return index
        self._route(emitter, index, tap, nbytes, credit_bytes)
        return index

    def adopt(self, key: PeerKey, name: str) -> Emitter:
        """State for a new emitter: from its hello, or met without one (a restarted
        daemon seeing its taps, an orphaned ring)."""
        emitter = self.ledger.emitters[key] = Emitter(key, name)
        logger.info("emitter %r connected", name)
        return emitter

    def rekey(self, old: PeerKey, new: PeerKey) -> None:
        """An emitter reconnected under a new socket identity: keep its state."""
        emitters = self.ledger.emitters
        emitter = emitters.pop(old, None)
        if emitter is not None:
            emitters.pop(new, None)
            emitter.key = new
            emitters[new] = emitter

    def barrier(self, key: PeerKey, barrier_id: int) -> None:
        emitter = self.emitters.get(key)
        if emitter is None:
            self.send(key, encode("rehello", {}))
            return
        emitter.last_seen = time.monotonic()
        emitter.barriers.append((barrier_id, emitter.next_index))
        self.ledger.advance(emitter)

    def emitter_bye(self, key: PeerKey) -> None:
        emitter = self.emitters.get(key)
        if emitter is not None:
            emitter.gone = True
            logger.info("emitter %r disconnected", emitter.name)
            self.ledger.advance(emitter)

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
            totals = self.ledger.totals(emitter)
            due = totals != emitter.reported and (
                final or now - emitter.reported_at >= _TOTALS_EVERY
            )
            if emitter.credit_due or due:
                fields = {"bytes": emitter.credit_due}
                if totals != emitter.reported:
                    fields.update(delivered=totals[0], dropped=totals[1], unrouted=totals[2])
                    emitter.reported, emitter.reported_at = totals, now
                self.send(emitter.key, encode("credit", fields))
                emitter.credit_due = 0

    def watch_ring(self, key: PeerKey, give_back: Callable[[], None]) -> None:
        """Emitter `key`'s taps come from a ring: `give_back()` returns the ring space
        of its finished units (and says so: `released`). It is called as they finish,
        and its emitter is told only of taps whose space went back (`Ledger.totals`)."""
        emitter = self.ledger.emitters.get(key)
        if emitter is not None:
            emitter.give_back = give_back

    def released(self, key: PeerKey, first_held: int | None) -> None:
        """The ring of emitter `key` holds no finished unit below index `first_held`
        (None: none at all) any more."""
        emitter = self.ledger.emitters.get(key)
        if emitter is not None:
            bound = emitter.next_index if first_held is None else first_held
            self.ledger.released(emitter, bound)

    def stop_releasing(self) -> None:
        """The daemon stops: ring space stays with what it holds, for the next daemon,
        which delivers and counts those taps (this one tells no one of them)."""
        self.ledger.releasing = False

    def safe_low(self, key: PeerKey) -> int | None:
        """Every unit of emitter `key` below this index is finished, or copied to the
        spools of the targets that still have it: its ring space may be released.
        None for an emitter not known (any more)."""
        emitter = self.ledger.emitters.get(key)
        if emitter is None:
            return None
        if self.subscribers.spool is None:
            return emitter.low
        low = next(iter(emitter.unsafe), emitter.next_index)
        return min(low, emitter.parked[0][0]) if emitter.parked else low

    # ---- routing --------------------------------------------------------------------

    def run_limit(self, consumer: str, tap_bytes: int) -> int:
        """The most taps of `consumer` (`tap_bytes` each) a ring run may hold: half the
        smallest window of the targets it goes to, so that batches still overlap acks
        (1 where one does not batch: its window counts one-tap messages), and half a
        queue, so that queue bounds and drops stay as fine-grained as for single taps."""
        targets = self.routes.targets_of(consumer)
        if self.routes.samples_any() and samples(targets, consumer):
            return 1  # thinned per tap, by seq (tapd/daemon/sampling.py)
        limits = [t.run_limit() for t in targets]
        by_queue = max(1, self.queue_bytes // (2 * max(1, tap_bytes)))
        return min(*limits, by_queue, DEFAULT_LIMITS.max_batch)

    def _has_room(self, tap: Unit, nbytes: int, emitter: Emitter) -> bool:
        targets = self.routes.targets_of(tap.header["consumer"], emitter)
        return all(t.room_for(nbytes) for t in targets)

    @property
    def _blocking(self) -> bool:
        """Whether a tap waits (parked, credit withheld) when a queue has no room."""
        spool = self.subscribers.spool
        return self.policy == "block" or (spool is not None and spool.fallback == "block")

    def _held_unrouted(self, tap: Unit, emitter: Emitter) -> bool:
        """Whether `tap` waits, wanted by no subscriber yet, in the start-up grace."""
        return (
            self.hold_unrouted_until > 0
            and self.in_grace()
            and not self.routes.targets_of(tap.header["consumer"], emitter)
        )

    def _route(
        self, emitter: Emitter, index: int, tap: Unit, nbytes: int, credit_bytes: int
    ) -> None:
        emitter.credit_due += credit_bytes
        targets = self.routes.targets_of(tap.header["consumer"], emitter)
        count = unit_count(tap)
        if targets and self.routes.samples_any() and isinstance(tap, Message):
            kept = keeping(targets, tap)
            self.ledger.count("deliveries_thinned", len(targets) - len(kept))
            if not kept:  # every taker samples it out: to the emitter, an unrouted tap
                self._unrouted(emitter, index, count, "taps_thinned")
                return
            targets = kept
        if not targets:
            self._unrouted(emitter, index, count, "taps_unrouted")
            return
        pending = emitter.pending[index] = Pending(remaining=0, count=count)
        if self.subscribers.spool is not None:
            emitter.unsafe[index] = None
        for target in targets:
            # (drop_newest where it is full: block never gets here while one is)
            offer = target.offer(Delivery(emitter, index, tap, nbytes, count))
            if offer is Offer.DROPPED:
                pending.lost = True
                continue
            pending.remaining += 1
            pending.copied += offer is Offer.SPOOLED
        if pending.remaining == 0:
            self.ledger.finish(emitter, index)
        elif pending.copied >= pending.remaining:  # on disk for all: the ring may go on
            emitter.unsafe.pop(index, None)

    def _unrouted(self, emitter: Emitter, index: int, count: int, counter: str) -> None:
        self.ledger.outcomes(emitter, index, 0, 0, count)
        self.ledger.count(counter, count)
        emitter.pending.pop(index, None)
        self.ledger.outcome(emitter, index, "unrouted")
        self.ledger.advance(emitter)

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

    # ---- subscribers (tapd/daemon/subscribers.py: `subscribers`) ------------------------

    def expire(self, now: float, timeout: float) -> None:
        self.subscribers.expire(now, timeout)
        # A forwarding daemon killed without a bye: nothing else would remove it.
        silence = max(3 * timeout, _FORWARDER_SILENCE_MIN)
        for emitter in list(self.emitters.values()):
            if emitter.forwarder and not emitter.gone and now - emitter.last_seen > silence:
                logger.info("%s was silent for %g s: forgotten", emitter.name, silence)
                self.emitter_bye(emitter.key)

    # ---- bookkeeping ----------------------------------------------------------------

    def reject(self, reason: str, detail: str) -> None:
        """Count a refused message; log each reason the first time it is seen."""
        self.ledger.count(f"rejected_{reason}")
        log = logger.warning if self.counters[f"rejected_{reason}"] == 1 else logger.debug
        log("rejected a message (%s): %s (further ones counted, not logged)", reason, detail)

    def idle(self) -> bool:
        """Nothing queued, in flight or parked anywhere."""
        pending = any(e.pending for e in self.emitters.values())
        return not pending and not self.subscribers.busy()

    def stats(self) -> dict[str, Any]:
        subscribers, groups = self.subscribers.stats()
        return {
            "counters": dict(self.counters),
            "emitters": [e.stats() for e in self.emitters.values()],
            "subscribers": subscribers,
            "groups": groups,
            "queue_bytes": self.queue_bytes,  # each subscriber's queue bound
            "time": time.time(),
        }
