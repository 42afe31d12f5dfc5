"""The spool policy around a target: what its full queue cannot take goes to its on-disk
log (tapd/daemon/spool.py), and comes back, in order, as it catches up.

`Spooled` wraps any target and is a target itself: the router routes to it and knows
no more of spools. While it is `spilling`, every unit goes to the log (to keep order);
when the log is full or the disk refuses, the fallback policy applies (`block`: units
wait in memory, `behind` the log, and later ones are parked: `room_for`; `drop_newest`:
counted drops). A log an earlier daemon left for a target of the same name is its own.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any

from tapd.daemon.deliveries import Delivery, Emitter
from tapd.daemon.ledger import Ledger
from tapd.daemon.runs import TapRun
from tapd.daemon.spool import Spool, SpoolEntry, SpoolError, SpoolFull, Taken
from tapd.daemon.targets.base import Hold, Offer, Subscription, Target
from tapd.protocol import Message

logger = logging.getLogger("tapd.daemon")

_SPOOL_OVERHEAD = 4096  # bytes a spool record takes beyond its arrays (headers), roughly
_SPOOL_RETRY = 5.0  # seconds after a spool write error (a full disk) before trying again
_NO_TAP = Message({"kind": "tap", "consumer": ""})  # a spooled unit counted lost unread


@dataclasses.dataclass(frozen=True)
class SpoolSettings:
    directory: Path
    limit: int  # bytes per target's spool
    fallback: str  # policy when it is full: "block" or "drop_newest"


class Spooled:
    def __init__(
        self,
        inner: Target,
        settings: SpoolSettings,
        ledger: Ledger,
        before: Emitter,
        left: Spool | None = None,
    ) -> None:
        self.inner = inner  # a SocketSubscriber, LocalTarget or Pool
        self.settings = settings
        self.ledger = ledger
        self._before = before  # owns the records an earlier daemon left
        self.spool: Spool | None = left
        self.spilling = left is not None
        # Units after the spool's that it could not take (full; the fallback is block).
        self.behind: collections.deque[Delivery] = collections.deque()
        self._retry_at = 0.0  # after a write error, not before then
        if left is not None:
            logger.info(
                "subscriber %r gets first the %d taps an earlier daemon spooled for it",
                inner.name,
                left.taps,
            )

    # ---- what it is: the wrapped target's --------------------------------------------

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def subscription(self) -> Subscription:
        return self.inner.subscription

    @property
    def queue(self) -> collections.deque[Delivery]:
        return self.inner.queue

    @property
    def hold(self) -> Hold:
        return self.inner.hold

    def drop(self, count: int) -> None:
        self.inner.drop(count)

    def run_limit(self) -> int:
        return self.inner.run_limit()

    # ---- routing --------------------------------------------------------------------

    def room_for(self, nbytes: int) -> bool:
        if not self.spilling and self.hold.fits(nbytes):
            return True
        if time.monotonic() < self._retry_at:
            return False
        used = self.spool.bytes if self.spool is not None else 0
        return used + nbytes + _SPOOL_OVERHEAD <= self.settings.limit

    def offer(self, delivery: Delivery) -> Offer:
        """To the log if the queue is full (or the log not yet empty, to keep order)."""
        if not self.spilling and self.hold.fits(delivery.nbytes):
            return self.inner.offer(delivery)
        if self._append(delivery):
            self.spilling = True
            return Offer.SPOOLED
        if self.settings.fallback == "drop_newest":
            self.inner.drop(delivery.count)
            self.ledger.count("spool_fallback_dropped", delivery.count)
            return Offer.DROPPED
        # block: in memory, after what is spooled (later units wait, parked: `room_for`)
        if self.spilling:
            self.behind.append(delivery)
        else:
            self.queue.append(delivery)
            self.hold.bytes += delivery.nbytes
        return Offer.QUEUED

    def pump(self) -> bool:
        if self.spilling:
            self._refill()
        return self.inner.pump()

    def _append(self, delivery: Delivery) -> bool:
        if time.monotonic() < self._retry_at:
            return False
        tap = delivery.tap
        settings = self.settings
        try:
            if self.spool is None:
                self.spool = Spool(settings.directory, self.name, settings.limit)
            taps = tap.taps() if isinstance(tap, TapRun) else [tap]
            owner = (delivery.emitter, delivery.index)
            self.spool.append(taps, delivery.emitter_name, delivery.nbytes, owner=owner)
        except (SpoolFull, SpoolError, OSError) as exc:
            full = isinstance(exc, SpoolFull)
            if not full:  # the disk, not the bound: try again in a while
                self._retry_at = time.monotonic() + _SPOOL_RETRY
            counter = "spool_full" if full else "spool_errors"
            if not self.ledger.counters[counter]:
                logger.error(
                    "subscriber %r: %s; falling back to %s (further ones counted in %s)",
                    self.name,
                    exc,
                    settings.fallback,
                    counter,
                )
            self.ledger.count(counter, delivery.count)
            return False
        self.ledger.count("taps_spooled", delivery.count)
        return True

    def _refill(self) -> None:
        """Take spooled units back into the queue, in order, as far as it has room; then
        those held behind; then it is caught up."""
        spool = self.spool
        while True:
            if spool is not None and spool.entries:
                nbytes = spool.entries[0].nbytes
            elif self.behind:
                nbytes = self.behind[0].nbytes
            else:
                self.spilling = False
                if spool is not None and not spool.bytes:
                    spool.remove()
                    self.spool = None
                return
            if not self.hold.fits(nbytes):
                return
            if spool is not None and spool.entries:
                taken = spool.take()
                if taken is not None:
                    self._queue_taken(taken)
            else:
                delivery = self.behind.popleft()
                self.queue.append(delivery)
                self.hold.bytes += delivery.nbytes

    def _owner(self, entry: SpoolEntry) -> tuple[Emitter, int]:
        if entry.owner is None:
            return self._before, -1
        emitter, index = entry.owner
        return emitter, index

    def _queue_taken(self, taken: Taken) -> None:
        entry = taken.entry
        emitter, index = self._owner(entry)
        pending = emitter.pending.get(index)
        count = len(taken.taps)
        if pending is not None and count > 1:  # one delivery per tap now
            pending.remaining += count - 1
            pending.copied += count - 1
        each = entry.nbytes // max(1, count)
        release = functools.partial(self._acknowledge, entry)
        for i, tap in enumerate(taken.taps):
            tap.header.setdefault("emitter", taken.emitter)
            last = i == count - 1
            nbytes = entry.nbytes - each * (count - 1) if last else each
            delivery = Delivery(emitter, index, tap, nbytes, 1, copied=True)
            delivery.release = release if last else None
            self.queue.append(delivery)
            self.hold.bytes += nbytes
        self.ledger.count("taps_unspooled", count)

    def _acknowledge(self, entry: SpoolEntry) -> None:
        if self.spool is not None:
            self.spool.acknowledge(entry)

    # ---- going ------------------------------------------------------------------------

    def lose(self) -> list[Delivery]:
        """What it holds in memory, and deliveries standing for its log's records, all
        counted lost; the log removed."""
        lost: list[Delivery] = [*self.inner.lose(), *self.behind]
        self.behind.clear()
        spool, self.spool, self.spilling = self.spool, None, False
        if spool is None:
            return lost
        for entry in spool.entries:
            emitter, index = self._owner(entry)
            lost.append(Delivery(emitter, index, _NO_TAP, entry.nbytes, entry.count, copied=True))
        spool.remove()
        return lost

    def close(self) -> None:
        """At shutdown: the log stays on disk for the next daemon, not counted lost."""
        spool = self.spool
        if spool is None:
            return
        if spool.taps:
            logger.warning(
                "subscriber %r: %d taps stay in its spool at %s for the next daemon",
                self.name,
                spool.taps,
                spool.directory,
            )
        spool.close()
        self.spool, self.spilling = None, False

    def busy(self) -> bool:
        return self.spilling or self.inner.busy()

    def stats(self) -> dict[str, Any]:
        spool = self.spool
        spooled = (spool.taps if spool else 0) + sum(d.count for d in self.behind)
        return {
            **self.inner.stats(),
            "spooled": spooled,
            "spool_bytes": spool.bytes if spool else 0,
        }
