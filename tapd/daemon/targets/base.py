"""What every routing target does, whatever it is (tapd/daemon/targets/__init__.py).

The router offers each unit to every target that wants its consumer (`offer`), asks
before that whether a target has room under the `block` policy (`room_for`), lets each
send what it can (`pump`), and, when a target goes, has it give up what it holds (`lose`),
counted lost. Acknowledgements go to the peer that sent them (tapd/daemon/targets/peer.py);
what a target finishes it reports to the ledger (tapd/daemon/ledger.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Protocol

from tapd.consumers import matches_any
from tapd.daemon.deliveries import Delivery
from tapd.daemon.ledger import Ledger

UNLIMITED = 2**62  # the message-count window of in-process targets
# Sent but not yet acknowledged, per peer: a window of large taps stays this small.
IN_FLIGHT_BYTES = 64 * 2**20


class Offer(enum.Enum):
    """What a target did with a unit offered to it."""

    QUEUED = "queued"  # held in memory: pending until acknowledged or lost
    SPOOLED = "spooled"  # copied to its spool: pending, but its ring space may go
    DROPPED = "dropped"  # no room (drop_newest): counted, not pending here


@dataclasses.dataclass
class Subscription:
    """Which consumers a target wants. `fallback`: patterns it wants only from emitter
    `fallback_for`, and only while no other target takes them (a JAX process's own tap
    functions, tapd/emitter/local/fallback.py)."""

    patterns: tuple[str, ...]
    fallback: tuple[str, ...] = ()
    fallback_for: str | None = None
    # (pattern, n): sampling, and what it takes from dormant sites (tapd/daemon/sampling.py)
    every: tuple[tuple[str, int], ...] = ()
    wanted: tuple[tuple[str, int], ...] | None = None  # None: `patterns`, every 1

    def wants(self, consumer: str) -> bool:
        """Routed `consumer` by its patterns, and, where it said what it takes (a
        forwarder: what its upstream's takers want), by those too: a tap the upstream
        would only discard stays here."""
        return matches_any(self.patterns, consumer) and (
            self.wanted is None or matches_any((p for p, _ in self.wanted), consumer)
        )

    def takes(self, consumer: str) -> bool:
        """Wants `consumer` by a pattern other than the bare "*" of a watcher (`tapd tail
        '*'`, a forwarder), which takes a copy of everything and no one's place."""
        return matches_any((p for p in self.patterns if p != "*"), consumer)

    def falls_back(self, consumer: str, emitter: str) -> bool:
        return self.fallback_for == emitter and matches_any(self.fallback, consumer)


@dataclasses.dataclass(frozen=True)
class Terms:
    """What every target works under: the ledger it reports to, and the byte bound of
    its queue (`--queue-bytes`)."""

    ledger: Ledger
    bound: int


@dataclasses.dataclass
class Hold:
    """The bytes a target holds (queued and in flight), bounded by the queue bound: a
    unit fits if the target holds nothing or it fits beside what is held."""

    bound: int
    bytes: int = 0

    def fits(self, nbytes: int) -> bool:
        return not self.bytes or self.bytes + nbytes <= self.bound


class Target(Protocol):
    """A routing target, as the router sees it."""

    @property
    def name(self) -> str: ...

    @property
    def subscription(self) -> Subscription: ...

    @property
    def queue(self) -> collections.deque[Delivery]: ...

    @property
    def hold(self) -> Hold: ...

    def room_for(self, nbytes: int) -> bool:
        """Whether a unit of `nbytes` would be taken now, not dropped."""
        ...

    def offer(self, delivery: Delivery) -> Offer: ...

    def drop(self, count: int) -> None:
        """`count` taps dropped for lack of room: counted."""
        ...

    def run_limit(self) -> int:
        """The most taps a ring run routed here may hold."""
        ...

    def pump(self) -> bool:
        """Send what the window allows; False if the target is unreachable."""
        ...

    def lose(self) -> list[Delivery]:
        """The target is gone: give up and return everything it holds."""
        ...

    def busy(self) -> bool:
        """Anything queued, in flight or spooled."""
        ...

    def stats(self) -> dict[str, Any]: ...


class Queued:
    """What every kind of target has: a queue under a byte bound, and what it does with
    a unit that does not fit (dropped, counted: under `block` none is offered then).
    The rest of `Target` (run_limit, pump, lose, busy, stats) each kind says for itself;
    mypy checks it where the kind is used as a Target."""

    def __init__(self, name: str, subscription: Subscription, terms: Terms) -> None:
        self.name = name
        self.subscription = subscription
        self.ledger = terms.ledger
        self.queue: collections.deque[Delivery] = collections.deque()
        self.hold = Hold(terms.bound)
        self.dropped = 0

    def room_for(self, nbytes: int) -> bool:
        return self.hold.fits(nbytes)

    def offer(self, delivery: Delivery) -> Offer:
        if not self.hold.fits(delivery.nbytes):
            self.drop(delivery.count)
            return Offer.DROPPED
        self.queue.append(delivery)
        self.hold.bytes += delivery.nbytes
        return Offer.QUEUED

    def drop(self, count: int) -> None:
        self.dropped += count
        self.ledger.count("deliveries_dropped", count)
