"""What became of each routed unit: the daemon's counters, each emitter's pending units,
and the barriers those finish.

A unit is "pending" until every target it was routed to has acknowledged it, lost it
or dropped it (`settle`); then it is finished, counted in its emitter's totals, and the
barriers behind it are answered (docs/PROTOCOL.md, "Barrier"). The router and every
kind of target (tapd/daemon/targets/) report here; the ledger knows neither.
"""

from __future__ import annotations

import collections
import heapq
from typing import Any

from tapd.daemon.deliveries import Delivery, Emitter, PeerKey, Send
from tapd.protocol import encode
from tapd.protocol.link import outcome_ranges


class Ledger:
    def __init__(self, send: Send) -> None:
        self.send = send
        self.emitters: dict[PeerKey, Emitter] = {}
        self.counters: collections.Counter[str] = collections.Counter()
        self._next_tid = 0  # delivery ids, one per tap, for every target
        # Whether finished ring units give their space back (`advance`): not once the
        # daemon stops, so that what it could not deliver stays for the next one.
        self.releasing = True

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def tids(self, count: int) -> int:
        """The first of `count` new delivery ids."""
        first = self._next_tid
        self._next_tid += count
        return first

    # ---- from the targets -------------------------------------------------------------

    def settle(
        self, delivery: Delivery, *, lost: bool, dropped: int = 0, unrouted: int = 0
    ) -> None:
        """A target is done with `delivery`: handled (of its taps, `dropped` and
        `unrouted` by a forwarder's upstream), or `lost`."""
        emitter = delivery.emitter
        pending = emitter.pending.get(delivery.index)
        if pending is None:
            return
        pending.lost |= lost
        if not lost:
            pending.dropped = max(pending.dropped, dropped)
            pending.unrouted = (
                unrouted if pending.unrouted is None else min(pending.unrouted, unrouted)
            )
        pending.remaining -= 1
        pending.copied -= delivery.copied
        if pending.remaining == 0:
            self.finish(emitter, delivery.index)
        elif emitter.unsafe and pending.copied >= pending.remaining:
            emitter.unsafe.pop(delivery.index, None)

    def handler_error(self, target: str, delivery: Delivery, tid: int, error: str) -> None:
        """A tap function raised for tap `tid` of `delivery`: its emitter is told (its
        barrier_wait raises)."""
        self.counters["handler_errors"] += 1
        emitter = delivery.emitter
        if emitter.gone:
            return
        header = delivery.header_of(tid)
        fields = {
            "consumer": header["consumer"],
            "seq": header["seq"],
            "error": error,
            "subscriber": target,
            # which tap, for a forwarder that has to pass the error on to its emitter
            "emitter": delivery.emitter_name,
            "device": header.get("device"),
        }
        self.send(emitter.key, encode("error", fields))

    def handled(self, delivery: Delivery, when: int) -> None:
        """A target handled `delivery`, whose last tap ran at `when` (ns, the emitter's
        clock): `tapd top`'s lag."""
        emitter = delivery.emitter
        if emitter.last_handled_ns is None or when > emitter.last_handled_ns:
            emitter.last_handled_ns = when

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
        reported (the peer had its share of errors: tapd/daemon/bounds.py). -1: an
        emitter not known."""
        emitter = self.emitters.get(key)
        if emitter is None:
            return -1
        index = emitter.next_index
        if tap:
            emitter.next_index += 1
            emitter.received += 1
            self.outcomes(emitter, index, 0, 1, 0)
            self.count("taps_refused")
        emitter.credit_due += credit_bytes
        if not report:
            self.count("refusals_unreported")
        elif not emitter.gone:
            fields = {
                "consumer": consumer,
                "seq": seq,
                "error": error,
                "subscriber": "tapd daemon",
                "emitter": emitter.name,
                "device": None,
            }
            self.send(emitter.key, encode("error", fields))
        self.advance(emitter)
        return index

    # ---- finishing --------------------------------------------------------------------

    def finish(self, emitter: Emitter, index: int) -> None:
        pending = emitter.pending.pop(index)
        emitter.unsafe.pop(index, None)
        count = pending.count
        dropped = count if pending.lost else pending.dropped
        unrouted = min(pending.unrouted or 0, count - dropped)
        self.outcomes(emitter, index, count - dropped - unrouted, dropped, unrouted)
        # (a forwarder's taps are single taps: one of the three)
        outcome = "dropped" if dropped else "unrouted" if unrouted else "delivered"
        self.outcome(emitter, index, outcome)
        self.advance(emitter)

    def outcomes(
        self, emitter: Emitter, index: int, delivered: int, dropped: int, unrouted: int
    ) -> None:
        """Count what became of the taps of unit `index`, finished."""
        emitter.delivered += delivered
        emitter.dropped += dropped
        emitter.unrouted += unrouted
        if emitter.give_back is not None:  # told once its ring space is given back
            heapq.heappush(emitter.unreleased, (index, delivered, dropped, unrouted))

    def totals(self, emitter: Emitter) -> tuple[int, int, int]:
        """What the emitter is told this daemon finished (delivered, dropped, unrouted):
        of a ring's taps, only those whose space went back to the ring, which no daemon
        reads again. So after a restart each tap is in one daemon's totals only."""
        if emitter.give_back is None:
            return emitter.delivered, emitter.dropped, emitter.unrouted
        return emitter.released

    def released(self, emitter: Emitter, bound: int) -> None:
        """The ring space of every finished unit of `emitter` below index `bound` went
        back to its ring."""
        heap = emitter.unreleased
        delivered, dropped, unrouted = emitter.released
        while heap and heap[0][0] < bound:
            _, more_delivered, more_dropped, more_unrouted = heapq.heappop(heap)
            delivered += more_delivered
            dropped += more_dropped
            unrouted += more_unrouted
        emitter.released = (delivered, dropped, unrouted)

    def outcome(self, emitter: Emitter, index: int, outcome: str) -> None:
        fid = emitter.fids.pop(index, None) if emitter.fids else None
        if fid is not None:
            emitter.outcomes.append((index, fid, outcome))

    def advance(self, emitter: Emitter) -> None:
        """Move the emitter's `low` on; answer the barriers it passed."""
        # `pending` is keyed by index in insertion order, which is index order: its first
        # key is the oldest unit not yet finished.
        emitter.low = next(iter(emitter.pending), emitter.next_index)
        if emitter.give_back is not None and self.releasing:
            emitter.give_back()  # (before the totals below are told)
        while emitter.barriers and emitter.barriers[0][1] <= emitter.low:
            barrier_id, bound = emitter.barriers.popleft()
            delivered, dropped, unrouted = self.totals(emitter)
            fields: dict[str, Any] = {
                "id": barrier_id,
                "delivered": delivered,
                "dropped": dropped,
                "unrouted": unrouted,
            }
            if emitter.forwarder:  # what became of each tap it sent before the barrier
                fields["outcomes"] = _outcomes_before(emitter, bound)
            self.send(emitter.key, encode("barrier_done", fields))
        if emitter.gone and not emitter.pending:
            self.emitters.pop(emitter.key, None)


def _outcomes_before(emitter: Emitter, bound: int) -> list[list[Any]]:
    final = [(fid, outcome) for index, fid, outcome in emitter.outcomes if index < bound]
    if not final:
        return []
    ranges, left = outcome_ranges(final)
    later = [entry for entry in emitter.outcomes if entry[0] >= bound]
    emitter.outcomes = [(-1, fid, outcome) for fid, outcome in left] + later
    return ranges
