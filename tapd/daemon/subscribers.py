"""The daemon's subscribers: every peer that acknowledges, and the routing targets they
make (tapd/daemon/targets/): a subscriber on its own is one target, a worker pool of them
is one; under the spool policy each target is wrapped with its spool.

Hellos, acks and heartbeats come here through the router; the router asks here which
targets there are (`targets`), and is told when they change (`changed`), to rebuild its
table from consumer to target.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

from tapd.daemon.deliveries import Emitter, PeerKey
from tapd.daemon.ledger import Ledger
from tapd.daemon.spool import Spool, find_spools
from tapd.daemon.subscriptions import Hello
from tapd.daemon.targets.base import Subscription, Target, Terms
from tapd.daemon.targets.local import Deliver, LocalTarget
from tapd.daemon.targets.peer import Peer
from tapd.daemon.targets.pool import Pool
from tapd.daemon.targets.shm import RingReaders, subscriber_for
from tapd.daemon.targets.socket import SocketSubscriber
from tapd.daemon.targets.spooled import Spooled, SpoolSettings
from tapd.protocol import encode

logger = logging.getLogger("tapd.daemon")


class Subscribers:
    def __init__(
        self, ledger: Ledger, *, queue_bytes: int, daemon_id: str, changed: Callable[[], None]
    ) -> None:
        self.ledger = ledger
        self._send = ledger.send
        self.terms = Terms(ledger, queue_bytes)
        self.daemon_id = daemon_id
        self._changed = changed  # the router's table is stale
        # Every peer that acknowledges, by key (pool members too); the routing target of
        # each that is not in a pool; the pools, and their targets.
        self.peers: dict[PeerKey, Peer] = {}
        self._targets: dict[PeerKey, Target] = {}
        self._pools: dict[Hashable, Pool] = {}
        self._pool_targets: dict[Hashable, Target] = {}
        self._pool_of: dict[PeerKey, Pool] = {}  # members
        self.spool: SpoolSettings | None = None  # set under policy "spool"
        self.rings: RingReaders | None = None  # set where subscribers may read rings
        self._left_spools: dict[str, Spool] = {}  # found at start, by subscriber name
        # The emitter of taps an earlier daemon spooled: named by each tap's `emitter`.
        self._spooled_before = Emitter(("spool",), "spooled before a restart", forwarder=True)
        # Subscribers to welcome once the wants table has woken what they take, and every
        # emitter that relies on a site's dormancy has acknowledged the wake
        # (tapd/daemon/wants.py): taps run after the welcome reach them (`send_welcomes`).
        self._welcomes_due: list[PeerKey] = []

    def targets(self) -> list[Target]:
        """The routing targets: subscribers on their own, in the order they came, then
        the pools."""
        return [*self._targets.values(), *self._pool_targets.values()]

    def pump(self) -> None:
        """Let each target send what its window allows (a subscriber whose welcome is
        held, nothing yet: its welcome comes first)."""
        for key, peer in list(self.peers.items()):
            if key in self._welcomes_due:
                continue
            target = self._targets.get(key, peer)  # (a pool member: fed by its pool)
            if not target.pump():
                self.drop(key, "is unreachable")
        for target in list(self._pool_targets.values()):
            target.pump()

    def hello(self, key: PeerKey, header: dict[str, Any], now: float) -> None:
        hello = Hello.of(header)
        known = self.peers.get(key)
        if hello.update:  # more consumers, same session: nothing in flight lost
            if known is None:  # e.g. this daemon restarted: a full hello, please
                self._send(key, encode("rehello", {}))
                return
            if key in self._pool_of or hello.group is not None:
                assert isinstance(known, SocketSubscriber)
                if known.group == hello.group and known.subscription.patterns == hello.patterns:
                    known.last_seen = now
                    self._welcome_subscriber(key)
                    return
                # Other consumers make another group (they key it): it leaves this one,
                # and what it held goes to the other members.
                self.drop(key, "changed its consumers or group")
                known = None
        if hello.update and known is not None:
            known.subscription = hello.subscription
            known.last_seen = now
            self._changed()
            logger.info("subscriber %r now wants %r", known.name, hello.consumers)
            self._welcome_subscriber(key)
            return
        if isinstance(known, SocketSubscriber) and known.same_subscription(hello):
            # The same subscription again (it answered two rehellos, say): it starts its
            # delivery ids afresh, so what it had in flight goes to it again, same seq.
            again = known.deliver_again()
            known.window, known.batch, known.last_seen = hello.window, hello.batch, now
            pool = self._pool_of.get(key)
            if pool is not None:
                pool.size()
            logger.info(
                "subscriber %r said hello again; the %d taps it had in flight go to it again",
                known.name,
                again,
            )
            self._welcome_subscriber(key)
            return
        if known is not None:
            self.drop(key, "said hello again")
        self._changed()
        subscriber = subscriber_for(key, hello, header, self.terms, now, self.rings)
        self.peers[key] = subscriber
        if hello.group is not None:
            self._join(subscriber, hello.group)
        else:
            logger.info("subscriber %r connected for %r", subscriber.name, hello.consumers)
            self._targets[key] = self._spooled(subscriber)
        self._welcome_subscriber(key)

    def _welcome_subscriber(self, key: PeerKey) -> None:
        if key not in self._welcomes_due:
            self._welcomes_due.append(key)

    def welcomes_due(self) -> bool:
        return bool(self._welcomes_due)

    def send_welcomes(self, unless: Callable[[], bool]) -> None:
        """Welcome each subscriber whose hello is answered, unless `unless()` (a wake
        not yet acknowledged: tapd/daemon/wants.py); the daemon's loop calls it after
        writing the wants table."""
        if not self._welcomes_due or unless():
            return
        due, self._welcomes_due = self._welcomes_due, []
        for key in due:
            if key in self.peers:
                self._send(key, encode("welcome", {"window_bytes": 0, "daemon": self.daemon_id}))

    def _join(self, member: SocketSubscriber, group: str) -> None:
        """A member of the worker pool (`group`, its patterns), formed by its first."""
        patterns = member.subscription.patterns
        pool = self._pools.get((group, patterns))
        if pool is None:
            pool = Pool(group, patterns, self.terms, self.drop)
            self._pools[pool.key] = pool
            self._pool_targets[pool.key] = self._spooled(pool)
        self._pool_of[member.key] = pool
        pool.join(member)
        logger.info(
            "subscriber %r joined group %r (%d members) for %r",
            member.name,
            group,
            len(pool.members),
            list(patterns),
        )

    def add_local(self, key: PeerKey, name: str, patterns: Sequence[str], deliver: Deliver) -> None:
        """An in-process subscriber (tapd/daemon/targets/local.py)."""
        self._changed()
        target = LocalTarget(key, name, Subscription(tuple(patterns)), self.terms, deliver)
        self.peers[key] = target
        self._targets[key] = self._spooled(target)

    def _spooled(self, target: Target) -> Target:
        """Under the spool policy, `target` with its spool (one an earlier daemon left
        for its name, if any); otherwise `target` itself."""
        if self.spool is None:
            return target
        left = self._left_spools.pop(target.name, None)
        return Spooled(target, self.spool, self.ledger, self._spooled_before, left)

    def ack(self, key: PeerKey, header: dict[str, Any], now: float) -> None:
        subscriber = self.peers.get(key)
        if subscriber is None:
            self._send(key, encode("rehello", {}))
            return
        subscriber.last_seen = now
        subscriber.acked(header)

    def heartbeat(self, key: PeerKey, now: float) -> None:
        subscriber = self.peers.get(key)
        if subscriber is None:
            self._send(key, encode("rehello", {}))
        else:
            subscriber.last_seen = now

    def drop(self, key: PeerKey, why: str, *, shutdown: bool = False) -> None:
        """A subscriber is gone. At `shutdown` a pool member's taps go back to its pool
        without being counted as redelivered: the others are going too, and the last
        one's going counts what the pool held as lost, once."""
        subscriber = self.peers.pop(key, None)
        self._changed()
        if subscriber is None:
            return
        pool = self._pool_of.pop(key, None)
        if pool is None:
            self._lose(self._targets.pop(key), why)
            return
        assert isinstance(subscriber, SocketSubscriber)
        empty = pool.leave(subscriber, why, shutdown=shutdown)
        if empty is not None:
            del self._pools[pool.key]
            self._lose(self._pool_targets.pop(pool.key), empty)

    def drop_all(self, why: str) -> None:
        """At shutdown: every subscriber is gone, what they held counted lost once."""
        for key in list(self.peers):
            self.drop(key, why, shutdown=True)

    def _lose(self, target: Target, why: str) -> None:
        """A target is gone: what it held is lost, and counted."""
        lost = target.lose()
        taps = sum(delivery.count for delivery in lost)
        if lost:
            logger.warning(
                "subscriber %r %s; %d taps it had not processed are lost", target.name, why, taps
            )
        else:
            logger.info("subscriber %r %s", target.name, why)
        self.ledger.count("deliveries_lost", taps)
        for delivery in lost:
            self.ledger.settle(delivery, lost=True)

    def expire(self, now: float, timeout: float) -> None:
        for key, subscriber in list(self.peers.items()):
            if subscriber.silent(now, timeout):
                self.drop(key, f"was silent for {timeout:g} s")

    # ---- the spool policy (tapd/daemon/targets/spooled.py) -----------------------------

    def configure_spool(self, directory: Path, limit: int, fallback: str) -> None:
        """Policy "spool": full queues spill to logs under `directory` (`limit` bytes
        each; then `fallback`). Logs an earlier daemon left wait for their subscribers."""
        self.spool = SpoolSettings(directory, limit, fallback)
        for name in find_spools(directory):
            self._left_spools[name] = Spool(directory, name, limit)

    def close_spools(self) -> None:
        """At shutdown: spools stay on disk for the next daemon, not counted lost."""
        for target in [*self._targets.values(), *self._pool_targets.values()]:
            if isinstance(target, Spooled):
                target.close()
        for spool in self._left_spools.values():
            spool.close()

    def busy(self) -> bool:
        """Anything queued, in flight or spooled anywhere."""
        return any(s.busy() for s in self.peers.values()) or any(t.busy() for t in self.targets())

    def stats(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Of each subscriber (pool members too) and of each pool."""
        subscribers = [self._targets.get(key, s).stats() for key, s in self.peers.items()]
        return subscribers, [t.stats() for t in self._pool_targets.values()]
