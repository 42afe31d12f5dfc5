"""A worker pool (hello `group`): one routing target, whose members share its work.

Taps queue here as for any subscriber (same bound, same policy, same spool), and go from
this queue to the member with the most free credit; what a member leaves
unacknowledged comes back to this queue for another (docs/PROTOCOL.md, "Worker pools").
The members are socket subscribers that the router knows by peer key (their acks come
to them) but never routes to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tapd.daemon.deliveries import Delivery, PeerKey
from tapd.daemon.targets.base import IN_FLIGHT_BYTES, Queued, Subscription, Terms
from tapd.daemon.targets.socket import SocketSubscriber

logger = logging.getLogger("tapd.daemon")


class Pool(Queued):
    def __init__(
        self,
        group: str,
        patterns: tuple[str, ...],
        terms: Terms,
        drop_member: Callable[[PeerKey, str], None],
    ) -> None:
        # Named with its consumers: it is also the name of its spool, which another
        # group of this name but other consumers must not share.
        super().__init__(f"group {group} ({', '.join(patterns)})", Subscription(patterns), terms)
        self.key = (group, patterns)
        self.group = group
        self.members: list[SocketSubscriber] = []
        self._drop_member = drop_member  # one that is unreachable (the router's table)
        # What routing reads of it (`run_limit`), from its members: `size`.
        self.window = 1
        self.batch = False
        # Of members that left: what they handled.
        self.delivered = self.delivered_bytes = self.errors = 0
        self.redelivered = 0  # taps a member left unacknowledged, sent again

    def join(self, member: SocketSubscriber) -> None:
        member.owner_hold = self.hold  # (its taps' bytes are the pool's all along)
        self.members.append(member)
        self.size()

    def size(self) -> None:
        """A run must fit any member, and only batch-taking members may get batches."""
        assert self.members
        self.window = min(m.window for m in self.members)
        self.batch = all(m.batch for m in self.members)

    def leave(self, member: SocketSubscriber, why: str, *, shutdown: bool = False) -> str | None:
        """A member is gone: what it had not acknowledged goes back to the front of the
        queue, for the others (at least once: it may have handled some). Returns why
        the pool itself is gone, if that was its last member."""
        self.members.remove(member)
        back = member.lose()
        taps = sum(d.count for d in back)
        self.queue.extendleft(reversed(back))
        self.delivered += member.delivered
        self.delivered_bytes += member.delivered_bytes
        self.errors += member.errors
        if not self.members:
            return f"lost its last member, {member.name!r}, which {why}"
        if shutdown:  # the others go too; the last one counts what was held, once
            return None
        if taps:
            self.redelivered += taps
            self.ledger.count("deliveries_redelivered", taps)
            logger.warning(
                "subscriber %r of group %r %s; the %d taps it had not acknowledged "
                "go to the other members (%d)",
                member.name,
                self.group,
                why,
                taps,
                len(self.members),
            )
        else:
            logger.info(
                "subscriber %r of group %r %s; %d members remain",
                member.name,
                self.group,
                why,
                len(self.members),
            )
        self.size()
        return None

    def run_limit(self) -> int:
        return max(1, self.window // 2) if self.batch else 1

    def pump(self) -> bool:
        """Hand queued taps to the members: each unit to the member with the most free
        credit (a slow one, holding unacknowledged taps, gets fewer), as many as one
        batch to it would hold; ties go round. The rest waits here, under the bound and
        the policy, as in a subscriber's queue."""
        queue, members = self.queue, self.members
        while queue and members:
            nbytes = queue[0].nbytes
            best, free = None, 0
            for m in members:
                room = m.window - m.in_flight_taps
                if (
                    room > free
                    and not m.queue
                    and (not m.in_flight_bytes or m.in_flight_bytes + nbytes <= IN_FLIGHT_BYTES)
                ):
                    best, free = m, room
            if best is None:
                break
            limit = min(free, max(1, best.window // 2)) if best.batch else 1
            taps = 0
            while queue and (not taps or taps + queue[0].count <= limit):
                delivery = queue.popleft()
                best.queue.append(delivery)
                taps += delivery.count
            members.remove(best)  # to the back: the next tie goes to another member
            members.append(best)
            if not best.pump():  # (dropped: its taps back in `queue`)
                self._drop_member(best.key, "is unreachable")
        return True

    def lose(self) -> list[Delivery]:
        lost = list(self.queue)
        self.queue.clear()
        return lost

    def busy(self) -> bool:
        return bool(self.queue)

    def stats(self) -> dict[str, Any]:
        """Its queue and counts; taps in flight are its members'."""
        members = self.members
        handled = [m.last_handled_ns for m in members if m.last_handled_ns is not None]
        return {
            "name": self.name,
            "consumers": list(self.subscription.patterns),
            "fallback": [],
            "queued": sum(d.count for d in self.queue),
            "in_flight": sum(m.in_flight_taps for m in members),
            "held_bytes": self.hold.bytes,
            "delivered": self.delivered + sum(m.delivered for m in members),
            "delivered_bytes": self.delivered_bytes + sum(m.delivered_bytes for m in members),
            "dropped": self.dropped,
            "errors": self.errors + sum(m.errors for m in members),
            "spooled": 0,
            "spool_bytes": 0,
            "last_handled_time": max(handled) / 1e9 if handled else None,
            "group": self.group,
            "members": sorted(m.name for m in members),  # (their order here changes)
            "redelivered": self.redelivered,
        }
