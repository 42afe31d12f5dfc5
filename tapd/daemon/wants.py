"""The wants table: what this daemon's takers want of each tap site, told to emitters.

For each site of each ring it drains (from the ring's `.sites` file) the daemon writes
N into the site's slot of the ring (tapd/protocol/ring_format.py): the gcd of the `every`
its takers ask (a taker that asked none: 1), EVERY_DORMANT where none takes it, so the
emitter copies nothing (docs/PROTOCOL.md, "Dormant taps"). A taker is any routing
target of the site's consumer, the emitter's own fallbacks included (Router.takers).
EVERY_ALL (send every execution) where the site says `always`, while the start-up grace
runs (subscribers of a daemon that was down come back), and with dormancy off; and on a
clean exit, in every slot this daemon wrote.

The same numbers go to each forwarding daemon connected here, as `wants` ([pattern, n]
pairs, or "everything"), so that it makes its own emitters' sites dormant or wakes them
(tapd/daemon/forward.py).

Recomputed only when something it depends on changed (the router's targets, the grace,
sites read): per consumer once, memoized.

An emitter may rely on a site's dormancy without reading its slot before each call (a
dormant computation's twin, compiled without its taps: tapd/emitter/dormant_twin.py);
it marks the slot `relied_on` first. A wake written into such a slot holds once the
emitter acknowledges it (clears the mark, within milliseconds): until then the site is
said dormant in the stats, and subscribers' welcomes wait (`awaiting`), so that a tap
run after a subscriber's welcome reaches it. An emitter that does not acknowledge within
`ack_wait` seconds (`--wake-ack-timeout`, 2 by default) is named in the log, and waited
for no more.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Hashable, Mapping
from typing import Any

import zmq

from tapd.daemon.deliveries import PeerKey
from tapd.daemon.ring_source import RingSource
from tapd.daemon.rings import RingSet
from tapd.daemon.router import Router
from tapd.daemon.sampling import every_of, taken_every
from tapd.native.sites import Site
from tapd.protocol import encode
from tapd.protocol.ring_format import EVERY_ALL, EVERY_DORMANT, SITE_SLOTS
from tapd.protocol.rules import DEFAULT_LIMITS

logger = logging.getLogger("tapd.daemon")

# What a forwarder is told: None for "everything", else sorted (pattern, n) pairs.
Told = tuple[tuple[str, int], ...] | None


class WantsTable:
    def __init__(self, router: Router, rings: RingSet, dormant: bool, ack_wait: float) -> None:
        self.router = router
        self.rings = rings
        self.dormant = dormant  # False: every site always wanted (TAPD_DORMANT=0)
        self._state: tuple[int, bool] | None = None  # (router generation, in grace)
        self._memo: dict[tuple[str, str | None], int] = {}  # (consumer, emitter) -> N
        # Per ring: the source, the sites version it was written for, what was written.
        self._rings: dict[Hashable, tuple[RingSource, int, dict[int, int]]] = {}
        # Forwarders: what each was last told, after which of its hellos.
        self._told: dict[PeerKey, tuple[int, Told]] = {}
        self._hellos = 0  # emitter hellos the router had seen when forwarders were told
        self._pairs: Told = None
        self.writes = 0  # slots written (a test reads it: recomputing must stay cheap)
        self.ack_wait = ack_wait  # seconds a wake waits for its acknowledgment
        # Wakes not yet acknowledged: (ring key, site) -> (its source, the deadline).
        self._unacknowledged: dict[tuple[Hashable, int], tuple[RingSource, float]] = {}

    def update(self) -> None:
        """Write what changed since the last call (cheap when nothing did)."""
        sources = self.rings.sources
        state = (self.router.routes.generation, self.router.in_grace())
        changed = state != self._state
        if changed:
            self._state = state
            self._memo.clear()
            self._pairs = self._upstream_pairs()
        for key in [k for k, (source, _, _) in self._rings.items() if sources.get(k) is not source]:
            del self._rings[key]  # finished, or rekeyed (seen again below)
        for key, source in sources.items():
            known = self._rings.get(key)
            if known is None:
                source.sites.read_new()  # a ring met now: every site it has, not just read ones
            if changed or known is None or known[1] != source.sites.version:
                written = known[2] if known is not None else {}
                self._write(source, written)
                self._rings[key] = (source, source.sites.version, written)
        if changed or self._hellos != self.router.emitter_hellos:
            # (a forwarder that says hello again, reconnected, is told anew)
            self._hellos = self.router.emitter_hellos
            self._tell_forwarders()

    def _write(self, source: RingSource, written: dict[int, int]) -> None:
        emitter = self.router.emitters.get(source.key)
        name = None if emitter is None else emitter.name
        for site_id, site in source.sites.known().items():
            if site_id >= SITE_SLOTS:
                continue  # no slot: always sent
            every = self._every(site, source.key, name)
            if written.get(site_id) != every:
                relied_on = source.ring.set_site_every(site_id, every)
                written[site_id] = every
                self.writes += 1
                if relied_on and every != EVERY_DORMANT:
                    deadline = time.monotonic() + self.ack_wait
                    self._unacknowledged[(source.key, site_id)] = (source, deadline)
                else:
                    self._unacknowledged.pop((source.key, site_id), None)

    def awaiting(self) -> bool:
        """Whether a wake waits for its emitter's acknowledgment (see the module
        docstring); one from a ring that is gone, or past its deadline, waits no more."""
        if not self._unacknowledged:
            return False
        now, sources = time.monotonic(), self.rings.sources
        for (key, site_id), (source, deadline) in list(self._unacknowledged.items()):
            if sources.get(key) is not source or not source.ring.site_relied_on(site_id):
                del self._unacknowledged[(key, site_id)]
            elif now > deadline:
                del self._unacknowledged[(key, site_id)]
                logger.warning(
                    "ring %s: its emitter did not acknowledge the wake of %s within %g s; "
                    "its calls may skip that site's taps until it does",
                    source.path,
                    source.sites.consumer_of(site_id),
                    self.ack_wait,
                )
        return bool(self._unacknowledged)

    def _every(self, site: Site, key: Hashable, emitter: str | None) -> int:
        if site.always or not self.dormant or self.router.in_grace():
            return EVERY_ALL
        memo = (site.consumer, emitter)
        every = self._memo.get(memo)
        if every is None:
            asked = [
                n
                for target in self.router.takers(site.consumer, key)
                if (n := taken_every(target.subscription, site.consumer)) is not None
            ]
            every = self._memo[memo] = math.gcd(*asked) if asked else EVERY_DORMANT
        return every

    def _upstream_pairs(self) -> Told:
        """What this daemon's takers want, for its forwarders: None (everything) in the
        grace, with dormancy off, or past the protocol's bound on patterns."""
        if not self.dormant or self.router.in_grace():
            return None
        asked: dict[str, int] = {}
        for target in self.router.subscribers.targets():
            subscription = target.subscription
            pairs = subscription.wanted
            if pairs is None:
                pairs = tuple((p, every_of(subscription, p)) for p in subscription.patterns)
            for pattern, n in pairs:
                asked[pattern] = math.gcd(asked.get(pattern, 0), n)
        if asked.get("*") == 1 or len(asked) > DEFAULT_LIMITS.max_patterns:
            return None
        return tuple(sorted(asked.items()))

    def _tell_forwarders(self) -> None:
        """Each forwarding daemon connected: what our takers want, after its hello and
        whenever it changes."""
        for key, emitter in self.router.emitters.items():
            if emitter.forwarder and not emitter.gone and _socket_peer(key):
                said = emitter.hellos, self._pairs
                if self._told.get(key) != said and self.router.send(
                    key, encode("wants", wants_fields(self._pairs))
                ):
                    self._told[key] = said  # (not sent: told at its next hello or change)
        for key in [k for k in self._told if k not in self.router.emitters]:
            del self._told[key]

    def release(self) -> None:
        """On a clean exit: every slot written goes back to EVERY_ALL (nobody has said),
        so an emitter whose daemon is gone sends every tap, for the next one; and each
        forwarder is told "everything", so that what it gets meanwhile waits for the
        next daemon here instead of being skipped."""
        for source, _, written in self._rings.values():
            for site_id, every in written.items():
                if every != EVERY_ALL:
                    source.ring.set_site_every(site_id, EVERY_ALL)
            written.clear()
        self._pairs = None
        try:
            self._tell_forwarders()
        except zmq.ZMQError:  # (the daemon is going: its sockets may be too)
            pass

    def stats(self, router_stats: dict[str, Any]) -> dict[str, Any]:
        """The router's stats (`tapd status --json`) with the table's: `wants`, per ring
        path [site, consumer, N written]; `site_slot_writes` (few: only what changed is
        written); and in the counters `taps_skipped`, by the emitters (dormant sites,
        or sampled out)."""
        self.update()  # (a hello read with the stats request counts)
        out = {}
        self.awaiting()
        for source, _, written in self._rings.values():
            sites = source.sites.known()
            out[str(source.path)] = [
                # (a wake not yet acknowledged does not hold yet: still dormant)
                [site_id, sites[site_id].consumer, every]
                if (source.key, site_id) not in self._unacknowledged
                else [site_id, sites[site_id].consumer, EVERY_DORMANT]
                for site_id, every in sorted(written.items())
                if site_id in sites
            ]
        router_stats["counters"]["taps_skipped"] = self.rings.skipped()
        return {**router_stats, "wants": out, "site_slot_writes": self.writes}


def _socket_peer(key: PeerKey) -> bool:
    """A peer on one of the daemon's sockets, (index, identity); not the emitter of
    spooled taps or of an orphaned ring."""
    return isinstance(key, tuple) and len(key) == 2 and type(key[0]) is int


def wants_fields(pairs: Told) -> dict[str, Any]:
    """A `wants` message's fields (docs/PROTOCOL.md)."""
    if pairs is None:
        return {"patterns": [], "everything": True}
    return {"patterns": [[pattern, n] for pattern, n in pairs]}


def parse_wants(header: Mapping[str, Any]) -> Told:
    """A `wants` message (checked by decode) as what a forwarder's target takes."""
    if header.get("everything") is True:
        return None
    asked: dict[str, int] = {}
    for pattern, n in header["patterns"]:
        asked[pattern] = math.gcd(asked.get(pattern, 0), n)
    return tuple(sorted(asked.items()))
