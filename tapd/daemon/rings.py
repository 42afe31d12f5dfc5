"""The daemon's side of the native backend: every emitter's shared-memory ring it drains.

`RingSet` attaches the ring an emitter names in its hello, adopts at start the rings of
emitters that died while no daemon ran, drains each ring into the router
(tapd/daemon/ring_source.py, one `RingSource` per ring), and removes a ring once its
writer is gone and its taps delivered. The ring files themselves are watched in
tapd/daemon/ring_watch.py: the lock, the wake socket, the sweep of stale rings.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from tapd.daemon.ring_source import RingSource
from tapd.daemon.ring_watch import RingBusy, WakeSocket, sweep_stale_rings
from tapd.daemon.router import Router
from tapd.errors import ProtocolError
from tapd.native.ring import RingError
from tapd.protocol.schema import RING_NAME, sites_path_of
from tapd.runtime import RUNTIME_MARKER, make_first_file, mark_ring_dir, pid_alive

logger = logging.getLogger("tapd.daemon")

_UNMAP_AFTER = 60.0  # seconds a finished ring stays mapped (see check_writers)


class RingSet:
    """Every ring this daemon drains, by emitter key."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.sources: dict[Hashable, RingSource] = {}
        self._retired: list[tuple[float, RingSource]] = []  # removed, still mapped
        self.skipped_before = 0  # taps skipped (dormant, sampled) in rings now removed
        self._wake: WakeSocket | None = None
        self._claimed = False

    def start(self, endpoint: str, router: Router) -> WakeSocket | None:
        """Once the daemon holds the endpoint's lock, before it says it is ready: claim
        the ring directory (create it, note in it the socket directory it serves), sweep
        the rings of killed jobs, open the wake socket, adopt the rings of emitters that
        died while no daemon ran. A daemon that lost the race for the lock (eight callers
        autostarting at once) never gets here, so never touches the directory: at close,
        only the daemon that claimed it tidies it. Returns the wake socket, if any."""
        if self.directory is None:
            return None
        directory = self.directory
        make_first_file(directory, lambda: mark_ring_dir(directory, endpoint))
        self._claimed = True
        try:
            sweep_stale_rings()  # rings of killed jobs, whose runtime dirs are gone
        except OSError as exc:
            logger.warning("could not look for stale rings: %s", exc)
        self._wake = WakeSocket(directory)
        self.adopt_orphans(router)
        return self._wake

    def attach(self, key: Hashable, identity: dict[str, Any], router: Router) -> None:
        # (decode checked the names: a '<pid>-<hex>.ring' file and its '.sites' beside
        # it; tapd/protocol/schema.py, check_ring_names.) Here: the directory.
        ring_path = Path(identity["ring"])
        sites_path = Path(sites_path_of(identity["ring"]))
        if self.directory is None or ring_path.parent != self.directory:
            router.reject("bad_field", f"ring {str(ring_path)!r:.200} is not in {self.directory}")
            return
        for source in self.sources.values():
            if source.path == ring_path:
                if source.key != key:  # the emitter reconnected under a new identity
                    router.rekey(source.key, key)
                    del self.sources[source.key]
                    source.key = key
                    self.sources[key] = source
                source.watched_by(router, key)
                return
        try:
            source = RingSource(key, ring_path, sites_path, identity)
        except (RingError, ProtocolError) as exc:
            router.reject("bad_ring", str(exc))
            return
        self.sources[key] = source
        source.watched_by(router, key)
        # (No ring is read in the grace.)
        source.say_held(router, "grace" if router.in_grace() else "not_read")
        logger.info(
            "draining ring %s of emitter pid %d from position %d",
            ring_path,
            source.writer_pid,
            source.read_position,
        )

    def adopt_orphans(self, router: Router) -> None:
        """At start: rings left by emitters that died while no daemon ran are drained
        (their writer is gone) and then removed. Live writers will say hello."""
        if self.directory is None or not self.directory.is_dir():
            return
        for ring_path in sorted(self.directory.glob("*.ring")):
            key = ("ring", str(ring_path))
            if RING_NAME.fullmatch(ring_path.name) is None:
                continue  # not an emitter's ring
            try:
                source = RingSource(key, ring_path, ring_path.with_suffix(".sites"), {})
            except RingBusy as exc:
                logger.info("%s", exc)
                continue
            except (RingError, ProtocolError) as exc:
                logger.warning("removing unreadable ring %s: %s", ring_path, exc)
                ring_path.unlink(missing_ok=True)
                ring_path.with_suffix(".sites").unlink(missing_ok=True)
                continue
            if pid_alive(source.writer_pid):
                # It will say hello. Until then every site of it is wanted (a killed
                # daemon may have left some dormant): the start-up grace's promise.
                source.wake_all_sites()
                source.close(remove=False)
                continue
            source.writer_gone = True
            router.adopt(key, f"dead emitter pid {source.writer_pid}")
            source.watched_by(router, key)
            self.sources[key] = source
            logger.warning(
                "found the ring of dead emitter pid %d: draining %d bytes, then removing it",
                source.writer_pid,
                source.ring.counters().committed - source.read_position,
            )

    def sleep(self) -> bool:
        """Every ring is read to its end and asked to wake us on its next commit."""
        return all(source.ring.sleep(source.read_position) for source in self.sources.values())

    def poll(self, router: Router) -> int:
        moved = 0
        for source in list(self.sources.values()):
            moved += source.drain(router)
            source.release_delivered(router)
            source.say_held(router)
        return moved

    def read_new_sites(self) -> None:
        """Read the sites each live writer appended since. A site traced after its ring
        was met has no record yet to make the daemon read it; read here (each periodic
        check), its slot is written before its first tap, so that a site nobody takes
        copies nothing from its first tap on (tapd/daemon/wants.py)."""
        for source in self.sources.values():
            if not source.writer_gone:
                source.sites.read_new()

    def check_writers(self, router: Router) -> None:
        for key, source in list(self.sources.items()):
            if not source.writer_gone and not pid_alive(source.writer_pid):
                source.writer_gone = True
                logger.info("emitter pid %d is gone; draining what it committed", source.writer_pid)
            if source.finished():
                # Large taps went to ZeroMQ as views of the ring: keep it mapped a while,
                # so that a message still queued for a slow peer never reads unmapped
                # memory.
                source.say_held(router, "detached")  # (a writer still there would say so)
                source.remove_files()
                self.skipped_before += source.ring.counters().skipped
                self._retired.append((time.monotonic(), source))
                del self.sources[key]
                router.emitter_bye(key)
        while self._retired and time.monotonic() - self._retired[0][0] > _UNMAP_AFTER:
            self._retired.pop(0)[1].unmap()

    def barrier(self, key: Hashable, barrier_id: int, position: int, router: Router) -> bool:
        source = self.sources.get(key)
        if source is None:
            return False
        source.barrier(router, barrier_id, position)
        return True

    def idle(self) -> bool:
        """Every committed record was read and handed on."""
        return all(s.read_position >= s.ring.counters().committed for s in self.sources.values())

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for source in self.sources.values():
            counters = source.ring.counters()
            out.append(
                {
                    "path": str(source.path),
                    "writer_pid": source.writer_pid,
                    "committed": counters.committed,
                    "read": source.read_position,
                    "released": counters.tail,
                    "taps": counters.taps,
                    "dropped": counters.dropped,
                    "abandoned": counters.abandoned,
                    "blocked_ns": counters.blocked_ns,
                    "capacity": counters.capacity,
                    "writer_gone": source.writer_gone,
                    "skipped": counters.skipped,
                    "skipped_by_consumer": source.skipped_by_consumer(),
                }
            )
        return out

    def skipped(self) -> int:
        """Taps that emitters skipped (a dormant site, or sampled out), in every ring."""
        live = sum(source.ring.counters().skipped for source in self.sources.values())
        return self.skipped_before + live

    def close(self) -> None:
        for source in self.sources.values():
            source.close(remove=False)
        self.sources.clear()
        for _, source in self._retired:
            source.unmap()
        self._retired.clear()
        if self._wake is not None:
            self._wake.close()
        if self.directory is not None and self._claimed:
            if not any(self.directory.glob("*.ring")):
                (self.directory / RUNTIME_MARKER).unlink(missing_ok=True)
            try:
                self.directory.rmdir()  # only if empty: rings waiting for a daemon stay
            except OSError:
                pass
