"""Sampling, per taker: which taps of a site each routing target takes.

A tap with seq s of a site that samples itself by K (`tap(x, name, every=K)`, its
header's `every`) goes to a target whose subscription asks `every` n for its consumer
iff s % (K * n) == 0 (docs/PROTOCOL.md, "Sampling"). What the router offers, it thins
here (`keeping`); what the emitter is to copy at all, the wants table works out from the
same numbers (tapd/daemon/wants.py, `taken_every`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tapd.consumers import first_match, matches
from tapd.daemon.targets.base import Subscription, Target
from tapd.protocol import Message
from tapd.protocol.message import site_every


def every_of(subscription: Subscription, consumer: str) -> int:
    """The n a target asks for `consumer`, which it routes: that of the pattern its
    subscriber dispatches the consumer by (the name itself, else the first pattern
    that matches: tapd_client), 1 where it asked for none. A target that said what it
    takes (`wanted`) takes by the finest n among its pairs that match."""
    if subscription.wanted is not None:
        return _wanted_every(subscription.wanted, consumer) or 1
    if not subscription.every:
        return 1
    patterns = subscription.patterns
    pattern = consumer if consumer in patterns else first_match(patterns, consumer)
    return next((n for p, n in subscription.every if p == pattern), 1)


def taken_every(subscription: Subscription, consumer: str) -> int | None:
    """For the wants table: the n a target takes `consumer` by from a site that may
    be dormant, or None if it takes none (a forwarder whose upstream has no taker)."""
    if subscription.wanted is None:
        return every_of(subscription, consumer)
    return _wanted_every(subscription.wanted, consumer)


def _wanted_every(wanted: Sequence[tuple[str, int]], consumer: str) -> int | None:
    """The finest n of the (pattern, n) pairs that match `consumer`; None if none does."""
    asked = [n for pattern, n in wanted if matches(pattern, consumer)]
    return math.gcd(*asked) if asked else None


def samples(targets: Sequence[Target], consumer: str) -> bool:
    """Whether any of `targets` thins `consumer`."""
    return any(every_of(t.subscription, consumer) > 1 for t in targets)


def keeping(targets: Sequence[Target], tap: Message) -> list[Target]:
    """The targets that take `tap` (a single tap with its seq)."""
    seq = tap.header["seq"]
    consumer = tap.header["consumer"]
    k = site_every(tap.header)
    return [t for t in targets if seq % (k * every_of(t.subscription, consumer)) == 0]
