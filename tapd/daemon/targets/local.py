"""A subscriber inside the daemon's own process: the forwarder (tapd/daemon/forward.py).

It takes each delivery as a call, `deliver(tid, tap, emitter name, nbytes)`, instead of
frames on a socket, and acknowledges through `Subscribers.ack` like any subscriber, saying
besides which taps its upstream dropped or had no subscriber for. It has no message
window (its bytes are still bounded by the queue bound and the policy) and never
expires.
"""

from __future__ import annotations

from collections.abc import Callable

from tapd.daemon.deliveries import PeerKey
from tapd.daemon.targets.base import UNLIMITED, Subscription, Terms
from tapd.daemon.targets.peer import Peer
from tapd.protocol import Message

Deliver = Callable[[int, Message, str, int], None]


class LocalTarget(Peer):
    def __init__(
        self, key: PeerKey, name: str, wants: Subscription, terms: Terms, deliver: Deliver
    ) -> None:
        super().__init__(key, name, wants, terms)
        self.window = UNLIMITED
        self.deliver = deliver
        self.takes_outcomes = True

    def silent(self, now: float, timeout: float) -> bool:
        return False  # (it sends no heartbeats: it is part of this daemon)

    def run_limit(self) -> int:
        return UNLIMITED

    def send_next(self) -> bool:
        delivery = self.start_delivery()
        name = delivery.emitter_name
        size = delivery.nbytes // delivery.count
        for i, tap in enumerate(delivery.taps()):
            self.deliver(delivery.tid + i, tap, name, size)
        return True
