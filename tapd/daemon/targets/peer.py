"""A target that takes deliveries itself and acknowledges them: a socket subscriber or
an in-process one. It holds what it was sent in flight, in delivery-id order, until an
`ack` covers it (docs/PROTOCOL.md, "ack")."""

from __future__ import annotations

import collections
from abc import abstractmethod
from typing import Any

from tapd.daemon.deliveries import Delivery, PeerKey
from tapd.daemon.targets.base import IN_FLIGHT_BYTES, Hold, Queued, Subscription, Terms


class Peer(Queued):
    window: int  # taps in flight at most

    def __init__(self, key: PeerKey, name: str, wants: Subscription, terms: Terms) -> None:
        super().__init__(name, wants, terms)
        self.key = key
        self.last_seen = 0.0  # when its last message came (time.monotonic())
        self.in_flight: collections.deque[Delivery] = collections.deque()
        self.in_flight_taps = 0  # what `window` bounds
        self.in_flight_bytes = 0  # bounded by IN_FLIGHT_BYTES
        # The hold its bytes count in until acknowledged: its own, or its pool's.
        self.owner_hold: Hold = self.hold
        self.delivered = 0
        self.delivered_bytes = 0  # (tapd top: MB/s per subscriber)
        self.errors = 0
        # The emitter's `time` (ns) of the last tap it acknowledged: `tapd top`'s lag.
        self.last_handled_ns: int | None = None
        self.takes_outcomes = False  # its acks say which taps an upstream dropped

    def silent(self, now: float, timeout: float) -> bool:
        """Silent too long: gone (a socket subscriber that died without a bye)."""
        return now - self.last_seen > timeout

    @abstractmethod
    def send_next(self) -> bool:
        """Send the next queued unit (or more); False if the peer is unreachable."""

    # ---- sending ------------------------------------------------------------------------

    def pump(self) -> bool:
        """Send what the window allows; False if the peer is unreachable."""
        queue = self.queue
        while (
            queue
            and self.in_flight_taps < self.window
            and (
                not self.in_flight_bytes
                or self.in_flight_bytes + queue[0].nbytes <= IN_FLIGHT_BYTES
            )
        ):
            if not self.send_next():
                return False
        return True

    def start_delivery(self) -> Delivery:
        delivery = self.queue.popleft()
        delivery.tid = self.ledger.tids(delivery.count)
        self.in_flight.append(delivery)
        self.in_flight_taps += delivery.count
        self.in_flight_bytes += delivery.nbytes
        return delivery

    def deliver_again(self) -> int:
        """Its deliveries in flight back to the front of its queue, in order; how many
        taps they hold."""
        taps = self.in_flight_taps
        self.queue.extendleft(reversed(self.in_flight))
        self.in_flight.clear()
        self.in_flight_taps = self.in_flight_bytes = 0
        self.ledger.count("deliveries_resent", taps)
        return taps

    # ---- acknowledgements -----------------------------------------------------------

    def acked(self, header: dict[str, Any]) -> None:
        """An `ack` (decode checked it): every delivery up to tid `upto` was handled;
        `errors`, tap functions that raised."""
        in_flight = self.in_flight
        ledger = self.ledger
        # Errors go to their emitters at once: an ack may end inside a run, whose
        # delivery then stays in flight until a later ack covers the rest of it.
        for entry in header["errors"]:
            tid = entry.get("tid") if isinstance(entry, dict) else None
            if type(tid) is not int:
                continue
            delivery = next((d for d in in_flight if d.tid <= tid < d.tid + d.count), None)
            if delivery is not None:
                self.errors += 1
                ledger.handler_error(self.name, delivery, tid, str(entry.get("error")))
        upto = header["upto"]
        # An in-process forwarder also says which taps its upstream dropped or had no
        # subscriber for (sets of tids); a socket subscriber's ack cannot.
        dropped, unrouted = (
            (header.get("dropped", ()), header.get("unrouted", ()))
            if self.takes_outcomes
            else ((), ())
        )
        last: Delivery | None = None
        while in_flight and in_flight[0].tid + in_flight[0].count <= upto + 1:
            delivery = last = in_flight.popleft()
            self.owner_hold.bytes -= delivery.nbytes
            self.in_flight_taps -= delivery.count
            self.in_flight_bytes -= delivery.nbytes
            self.delivered += delivery.count
            self.delivered_bytes += delivery.nbytes
            ledger.count("deliveries_acked", delivery.count)
            if delivery.release is not None:
                delivery.release()
            tids = range(delivery.tid, delivery.tid + delivery.count)
            ledger.settle(
                delivery,
                lost=False,
                dropped=sum(t in dropped for t in tids) if dropped else 0,
                unrouted=sum(t in unrouted for t in tids) if unrouted else 0,
            )
        if last is not None:  # once per ack, not per tap: the hot path stays O(1) here
            when = last.time_ns
            if type(when) is int:
                self.last_handled_ns = when
                ledger.handled(last, when)

    # ---- the rest of the interface ----------------------------------------------------

    def lose(self) -> list[Delivery]:
        lost = [*self.in_flight, *self.queue]
        self.in_flight.clear()
        self.queue.clear()
        self.in_flight_taps = self.in_flight_bytes = 0
        return lost

    def busy(self) -> bool:
        return bool(self.queue or self.in_flight)

    def stats(self) -> dict[str, Any]:
        last = self.last_handled_ns
        return {
            "name": self.name,
            "consumers": list(self.subscription.patterns),
            "fallback": list(self.subscription.fallback),
            "queued": sum(d.count for d in self.queue),
            "in_flight": self.in_flight_taps,
            "held_bytes": self.hold.bytes,
            "delivered": self.delivered,
            "delivered_bytes": self.delivered_bytes,
            "dropped": self.dropped,
            "errors": self.errors,
            "spooled": 0,
            "spool_bytes": 0,
            # seconds since the epoch, on the emitter's clock (None: nothing handled yet)
            "last_handled_time": None if last is None else last / 1e9,
            "group": None,
        }
