"""One emitter's shared-memory ring, drained by the daemon into the router.

Each ring record becomes an ordinary tap `Message` (header from the emitter's sites
file, tapd/daemon/ring_sites.py; frames viewing the ring memory, so nothing is copied
until ZeroMQ sends it), or consecutive small records of one site a `TapRun`, and goes
through the same router as taps that arrived over the socket: subscribers see no
difference. Ring space is released only once the taps in it were delivered, so a
daemon killed and restarted re-reads them from the ring's tail: nothing is lost.
"""

from __future__ import annotations

import bisect
import collections
import functools
import logging
import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from tapd.daemon.ring_sites import RingSites
from tapd.daemon.ring_watch import lock_ring_file
from tapd.daemon.router import Router
from tapd.daemon.runs import TapRun
from tapd.errors import ProtocolError
from tapd.native.record_columns import RecordColumns, read_columns
from tapd.native.ring import Record, Ring, RingError
from tapd.native.sites import Site
from tapd.protocol import Message
from tapd.protocol.ring_checks import check_record
from tapd.protocol.ring_format import EVERY_ALL  # (ring.h: RingControl)

logger = logging.getLogger("tapd.daemon")

_RECORDS_PER_POLL = 4096
# The most tap bytes in one run. Per unit the router pays a routing, a pending entry and
# an acknowledgement: 64 KiB taps go 16 to a run. (A run of small taps goes out in one
# message; of large ones, a tap message each or, to a subscriber that reads rings,
# described: targets/socket.py, targets/shm.py.)
_RUN_BYTES = 1024 * 1024


class RingSource:
    """One emitter's ring, its sites, and what of it the router still has to finish."""

    def __init__(
        self, key: Hashable, ring_path: Path, sites_path: Path, identity: dict[str, Any]
    ) -> None:
        self.key = key
        self._lock_fd = lock_ring_file(ring_path)
        try:
            self.ring = Ring.open(ring_path)
        except RingError:
            os.close(self._lock_fd)
            raise
        self.ring.set_reader(os.getpid())
        self.identity = identity
        counters = self.ring.counters()
        self.writer_pid = counters.writer_pid
        identity_fields = {
            "process": identity.get("process", 0),
            "host": identity.get("host", "?"),
            "pid": self.writer_pid,
        }
        self.sites = RingSites(sites_path, self.ring.path, identity_fields)
        self.read_position = counters.tail  # a restarted daemon starts where delivery stopped
        self._in_router: collections.deque[tuple[int, int]] = collections.deque()  # (index, end)
        self._barriers: list[tuple[int, int]] = []  # (barrier id, ring position)
        self.writer_gone = False
        self._held: str | None = None  # the reason last written to the ring (say_held)
        self._waiting_for_site = False

    @property
    def path(self) -> Path:
        return self.ring.path

    def skipped_by_consumer(self) -> dict[str, int]:
        """Taps the writer skipped (dormant site, or sampled out), by consumer."""
        out: dict[str, int] = {}
        for site_id, count in self.ring.skipped_by_site().items():
            consumer = self.sites.consumer_of(site_id)
            out[consumer] = out.get(consumer, 0) + count
        return out

    def wake_all_sites(self) -> None:
        """Every site with a slot: send every tap (EVERY_ALL), whatever was written."""
        self.sites.read_new()
        for site_id in self.sites.ids():
            self.ring.set_site_every(site_id, EVERY_ALL)

    def drain(self, router: Router) -> int:
        """Hand committed records to the router, in order, while it can take them: each
        run of consecutive records of one site as one unit, found and cut from the
        records' columns (no Python step per record)."""
        if not router.takes_from(self.key):
            return 0  # under "block", a full subscriber queue stops us here
        try:
            span, records = read_columns(self.ring, self.read_position, _RECORDS_PER_POLL)
        except RingError as exc:
            router.reject("bad_ring", str(exc))
            return 0
        base = self.read_position
        taken = 0
        first = 0
        count = len(records)
        ends = _run_ends(records)
        starts, record_ends = records.starts, records.ends
        while first < count:
            site_id = int(records.sites[first])
            site = self.sites.site(site_id)
            self._waiting_for_site = site is None and not self.writer_gone
            if self._waiting_for_site:
                break  # its site entry is still being written: read it next time
            if isinstance(site, Site):
                try:
                    payload_bytes = int(record_ends[first] - starts[first]) - records.header_bytes
                    check_record(payload_bytes, site.leaf_bytes)
                except ProtocolError as exc:
                    site = exc
            if not isinstance(site, Site):
                why = site or ProtocolError("bad_ring", f"record for unknown site {site_id}")
                self._refuse(router, records.record(first), why)
                first += 1
                continue
            # Consecutive small records of this site (and length: the first one's is
            # checked) go to the router as one run.
            most = 1
            if site.nbytes <= _RUN_BYTES // 2:
                most = min(
                    router.run_limit(site.consumer, site.nbytes),
                    _RUN_BYTES // site.nbytes if site.nbytes else count,
                )
            end = min(ends[bisect.bisect_right(ends, first)], first + max(1, most))
            last_end = int(record_ends[end - 1])
            unit: Message | TapRun
            if end - first == 1:
                unit = site.message(records.record(first))
            else:
                piece = span[int(starts[first]) - base : last_end - base]
                unit = TapRun(site, records.part(first, end), piece)
            index = router.tap(self.key, unit, credit=False, nbytes=site.nbytes * (end - first))
            self._in_router.append((index, last_end))
            self.read_position = last_end
            taken += end - first
            first = end
            if not router.takes_from(self.key):
                break
        self._release_barriers(router)
        return taken

    def say_held(self, router: Router, reason: str | None = None) -> None:
        """Tell a writer that waits for ring space why the oldest record not released
        is held (written to the ring's control page when it changes; ring.h, kHeld*)."""
        if reason is None:
            if self.key not in router.emitters:
                reason = "not_read"
            elif not router.takes_from(self.key):  # its taps wait for queue room
                reason = "grace" if router.in_grace() else "queue_full"
            elif self._in_router:
                reason = "unacked"
            else:
                reason = "site_unknown" if self._waiting_for_site else "nothing"
        if reason != self._held:
            self._held = reason
            self.ring.set_held_reason(reason)

    def _refuse(self, router: Router, record: Record, why: ProtocolError) -> None:
        """A record the daemon cannot pass on: counted by reason, reported to the
        emitter (its barrier_wait raises), and its ring space released in turn."""
        router.reject(why.reason, f"ring {self.path}: {why.detail}")
        consumer = self.sites.consumer_of(record.site)
        error = f"the tapd daemon refused this tap: {why}"
        index = router.ledger.refused(self.key, consumer, record.seq, error)
        self._in_router.append((index, record.end))
        self.read_position = record.end

    def barrier(self, router: Router, barrier_id: int, position: int) -> None:
        """A barrier covering the ring up to `position`: it joins the router's queue of
        barriers once every record before `position` has been handed over."""
        self._barriers.append((barrier_id, position))
        self._release_barriers(router)

    def _release_barriers(self, router: Router) -> None:
        ready = [b for b in self._barriers if b[1] <= self.read_position]
        self._barriers = [b for b in self._barriers if b[1] > self.read_position]
        for barrier_id, _ in ready:
            router.barrier(self.key, barrier_id)

    def watched_by(self, router: Router, key: Hashable) -> None:
        """Have `router` give this ring's space back as it finishes units of `key`."""
        router.watch_ring(key, functools.partial(self.release_delivered, router))

    def release_delivered(self, router: Router) -> None:
        """Give writers back the space of every tap the router has finished."""
        # (under the spool policy, also taps copied to the spools of the subscribers
        # that still have them: `Router.safe_low`)
        low = router.safe_low(self.key)
        end = None
        while self._in_router and (low is None or self._in_router[0][0] < low):
            end = self._in_router.popleft()[1]
        if end is not None:
            self.ring.release(end)
        # (finished units below the first one it still holds: none in the ring any more)
        router.released(self.key, self._in_router[0][0] if self._in_router else None)

    def finished(self) -> bool:
        """The writer is gone and everything it committed was read and delivered."""
        if not self.writer_gone:
            return False
        counters = self.ring.counters()
        return self.read_position >= counters.committed and not self._in_router

    def remove_files(self) -> None:
        """The writer is gone and its taps delivered: remove the ring and sites files
        (the mapping stays until `close`)."""
        counters = self.ring.counters()
        uncommitted = counters.head - counters.committed
        if uncommitted:
            logger.error(
                "emitter pid %d died while writing %d bytes of taps to %s; they are lost",
                self.writer_pid,
                uncommitted,
                self.path,
            )
        self.path.unlink(missing_ok=True)
        self.sites.path.unlink(missing_ok=True)

    def close(self, *, remove: bool) -> None:
        if remove:
            self.remove_files()
        else:
            self.ring.set_reader(0)
        self.unmap()

    def unmap(self) -> None:
        self.ring.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # another daemon may drain it now
            self._lock_fd = -1


def _run_ends(records: RecordColumns) -> list[int]:
    """Where each run of records of one site and one length ends (exclusive), ascending:
    the places a run must stop, found for the whole read at once."""
    count = len(records)
    if count < 2:
        return [count]
    sites = records.sites
    lengths = records.ends - records.starts
    changes = (sites[1:] != sites[:-1]) | (lengths[1:] != lengths[:-1])
    return [*(np.flatnonzero(changes) + 1).tolist(), count]
