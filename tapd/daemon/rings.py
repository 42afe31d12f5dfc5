"""The daemon's side of the native backend: drain emitters' shared-memory rings.

Each ring record becomes an ordinary tap `Message` (header from the emitter's sites
file, frames viewing the ring memory, so nothing is copied until ZeroMQ sends it) and
goes through the same router as taps that arrived over the socket: subscribers see no
difference. Ring space is released only once the taps in it were delivered, so a
daemon killed and restarted re-reads them from the ring's tail: nothing is lost.
"""

from __future__ import annotations

import bisect
import collections
import errno
import fcntl
import functools
import logging
import mmap
import os
import socket
import stat
import struct
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np

from tapd.daemon.router import Router
from tapd.daemon.runs import Site, TapRun
from tapd.errors import ProtocolError
from tapd.native.ring import Record, Records, Ring, RingError
from tapd.native.ring_format import (  # (ring.h: RingControl)
    EVERY_ALL,
    READER_PID,
    READER_PID_OFFSET,
)
from tapd.protocol import Message
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd.protocol.schema import (
    RING_NAME,
    check_record,
    check_ring_control,
    check_site_entry,
    sites_path_of,
    split_site_entries,
)
from tapd.runtime import RUNTIME_MARKER, SHM_DIR, pid_alive, ring_dir_prefix, runtime_dir_of_rings

logger = logging.getLogger("tapd.daemon")

_RECORDS_PER_POLL = 4096
WAKE_SOCKET = "wake.sock"  # the native library sends to it from the ring's directory
_UNMAP_AFTER = 60.0  # seconds a finished ring stays mapped (see check_writers)
_RUN_BYTES = 128 * 1024  # the most tap bytes in one run (a run goes out in one message)


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
        self.sites_path = sites_path
        self.identity = identity
        self._sites: dict[int, Site | ProtocolError] = {}  # a refused site: why
        self.sites_version = 0  # grows as sites are read (tapd/daemon/wants.py)
        self._sites_offset = 0
        self._sites_broken: ProtocolError | None = None  # the sites file itself is bad
        counters = self.ring.counters()
        self.writer_pid = counters.writer_pid
        self._identity_fields = {
            "process": identity.get("process", 0),
            "host": identity.get("host", "?"),
            "pid": self.writer_pid,
        }
        self.read_position = counters.tail  # a restarted daemon starts where delivery stopped
        self._in_router: collections.deque[tuple[int, int]] = collections.deque()  # (index, end)
        self._barriers: list[tuple[int, int]] = []  # (barrier id, ring position)
        self.writer_gone = False
        self._held: str | None = None  # the reason last written to the ring (say_held)
        self._waiting_for_site = False

    @property
    def path(self) -> Path:
        return self.ring.path

    def _site(self, site_id: int) -> Site | ProtocolError | None:
        """The site a record names; a ProtocolError if its entry (or the whole sites
        file) was refused; None if its entry is not there yet."""
        if site_id not in self._sites and self._sites_broken is None:
            try:
                self._read_sites()
            except ProtocolError as exc:
                self._sites_broken = exc
                logger.error(
                    "sites file %s of ring %s refused: %s; the taps of its unknown "
                    "sites are refused",
                    self.sites_path,
                    self.path,
                    exc,
                )
        found = self._sites.get(site_id)
        return found if found is not None or self._sites_broken is None else self._sites_broken

    def sites(self) -> dict[int, Site]:
        """The sites read so far (refused ones left out), by site id."""
        return {i: site for i, site in self._sites.items() if isinstance(site, Site)}

    def skipped_by_consumer(self) -> dict[str, int]:
        """Taps the writer skipped (dormant site, or sampled out), by consumer."""
        out: dict[str, int] = {}
        for site_id, count in self.ring.skipped_by_site().items():
            site = self._sites.get(site_id)
            consumer = site.consumer if isinstance(site, Site) else f"site {site_id}"
            out[consumer] = out.get(consumer, 0) + count
        return out

    def wake_all_sites(self) -> None:
        """Every site with a slot: send every tap (EVERY_ALL), whatever was written."""
        self.read_new_sites()
        for site_id in self._sites:
            self.ring.set_site_every(site_id, EVERY_ALL)

    def read_new_sites(self) -> None:
        """Read the sites file's entries appended since last time (a refused file is
        reported where its records are: `_site`)."""
        if self._sites_broken is None:
            try:
                self._read_sites()
            except ProtocolError:
                pass

    def _read_sites(self) -> None:
        """Read the entries appended since last time: a regular file, not a link, at most
        `max_sites_bytes` in all; each entry checked (tapd/protocol/schema.py)."""
        limits = DEFAULT_LIMITS
        try:
            fd = os.open(
                self.sites_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            )
        except FileNotFoundError:
            return  # not written yet
        except OSError as exc:
            raise ProtocolError(
                "bad_ring", f"cannot open sites file {self.sites_path}: {exc.strerror}"
            ) from exc
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise ProtocolError(
                    "bad_ring", f"sites file {self.sites_path} is not a regular file of ours"
                )
            if info.st_size > limits.max_sites_bytes:
                raise ProtocolError(
                    "bad_ring",
                    f"sites file {self.sites_path} has "
                    f"{info.st_size} bytes; the limit is "
                    f"{limits.max_sites_bytes}",
                )
            data = os.pread(fd, max(0, info.st_size - self._sites_offset), self._sites_offset)
        finally:
            os.close(fd)
        try:
            entries, used = split_site_entries(data, limits)
        except ProtocolError as exc:
            raise ProtocolError("bad_ring", f"sites file {self.sites_path}: {exc}") from exc
        self._sites_offset += used
        for entry in entries:
            site_id = entry.get("site") if isinstance(entry, dict) else None
            try:
                check_site_entry(entry, limits)
                site: Site | ProtocolError = Site(entry, self._identity_fields)
            except ProtocolError as exc:
                if type(site_id) is not int:
                    raise ProtocolError(
                        "bad_ring",
                        f"sites file {self.sites_path}: an entry without a site id: {exc}",
                    ) from exc
                site = exc
                logger.error("ring %s: tap site %d refused: %s", self.path, site_id, exc)
            assert type(site_id) is int
            self._sites[site_id] = site
        self.sites_version += bool(entries)

    def drain(self, router: Router) -> int:
        """Hand committed records to the router, in order, while it can take them."""
        if not router.takes_from(self.key):
            return 0  # under "block", a full subscriber queue stops us here
        try:
            span, records = self.ring.read_span(self.read_position, _RECORDS_PER_POLL)
        except RingError as exc:
            router.reject("bad_ring", str(exc))
            return 0
        base = self.read_position
        taken = 0
        first = 0
        ends = _run_ends(records)
        while first < len(records):
            record = records[first]
            site = self._site(record.site)
            self._waiting_for_site = site is None and not self.writer_gone
            if self._waiting_for_site:
                break  # its site entry is still being written: read it next time
            if isinstance(site, Site):
                try:
                    check_record(len(record.payload), site.leaf_bytes)
                except ProtocolError as exc:
                    site = exc
            if not isinstance(site, Site):
                why = site or ProtocolError("bad_ring", f"record for unknown site {record.site}")
                self._refuse(router, record, why)
                first += 1
                continue
            # Consecutive small records of this site (and length: the first one's is
            # checked) go to the router as one run.
            most = 1
            if site.nbytes <= _RUN_BYTES // 2:
                most = min(
                    router.run_limit(site.consumer, site.nbytes),
                    _RUN_BYTES // site.nbytes if site.nbytes else len(records),
                )
            end = min(ends[bisect.bisect_right(ends, first)], first + max(1, most))
            last_end = records.ends[end - 1]
            unit: Message | TapRun
            if end - first == 1:
                unit = site.message(record)
            else:
                piece = span[record.start - base : last_end - base]
                unit = TapRun(site, records[first:end], piece, self.ring.header_bytes)
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
            if not router.knows_emitter(self.key):
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
        site = self._sites.get(record.site)
        consumer = site.consumer if isinstance(site, Site) else f"site {record.site}"
        error = f"the tapd daemon refused this tap: {why}"
        index = router.refused(self.key, consumer, record.seq, error)
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
        self.sites_path.unlink(missing_ok=True)

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


class RingSet:
    """Every ring this daemon drains, by emitter key."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self.sources: dict[Hashable, RingSource] = {}
        self._retired: list[tuple[float, RingSource]] = []  # removed, still mapped
        self.skipped_before = 0  # taps skipped (dormant, sampled) in rings now removed
        self._wake: socket.socket | None = None

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

    def open_wake_socket(self) -> socket.socket | None:
        """The datagram socket writers wake this daemon through (`wake.sock` in the
        ring directory), so that an idle daemon can sleep instead of polling rings."""
        if self.directory is None:
            return None
        path = self.directory / WAKE_SOCKET
        path.unlink(missing_ok=True)  # a dead daemon's
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake.bind(str(path))
        self._wake.setblocking(False)
        return self._wake

    def drain_wake_socket(self) -> None:
        assert self._wake is not None
        try:
            while self._wake.recv(64):
                pass
        except BlockingIOError:
            pass

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
            assert self.directory is not None
            (self.directory / WAKE_SOCKET).unlink(missing_ok=True)
        if self.directory is not None:
            if not any(self.directory.glob("*.ring")):
                (self.directory / RUNTIME_MARKER).unlink(missing_ok=True)
            try:
                self.directory.rmdir()  # only if empty: rings waiting for a daemon stay
            except OSError:
                pass


# struct flock (x86-64 and aarch64 Linux): l_type, l_whence, l_start, l_len, l_pid.
_WRITE_LOCK = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


class RingBusy(RingError):
    """Another daemon drains this ring (it holds the ring file's lock)."""


def lock_ring_file(path: Path) -> int:
    """Check a ring file before it is mapped (a regular file of ours, not a link, whose
    control page is sound: tapd/protocol/schema.py, check_ring_control) and take its
    lock, so that no two daemons drain one ring. Returns the locked descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RingError(f"cannot open ring {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise RingError(f"ring {path} is not a regular file of ours")
        try:
            check_ring_control(os.pread(fd, 64, 0), info.st_size, mmap.PAGESIZE)
        except ProtocolError as exc:
            raise RingError(f"ring {path}: {exc.detail}") from exc
        try:
            # An open-file-description lock: the writer holds a flock on the file (its
            # liveness, ring.h), which on Linux never conflicts with this one.
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WRITE_LOCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise RingError(f"cannot lock ring {path}: {exc.strerror}") from exc
            raise RingBusy(f"ring {path} is drained by another tapd daemon") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_stale_rings(*, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the ring directories in /dev/shm whose runtime directory is gone (a killed
    job's, say) and whose rings no live process writes or reads: nobody can drain them
    any more, and shared memory is never freed by itself. Returns each directory
    removed (or that would be, with `dry_run`) and the bytes it held."""
    removed: list[tuple[Path, int]] = []
    if not SHM_DIR.is_dir():
        return removed
    for directory in sorted(SHM_DIR.glob(f"{ring_dir_prefix()}*")):
        runtime = runtime_dir_of_rings(directory)
        try:
            info = directory.lstat()
        except OSError:
            continue
        if (
            runtime is None
            or runtime.exists()
            or not stat.S_ISDIR(info.st_mode)
            or info.st_uid != os.getuid()
        ):
            continue
        held = _stale_bytes(directory)
        if held is None:
            continue
        if not dry_run:
            for entry in directory.iterdir():
                entry.unlink(missing_ok=True)
            try:
                directory.rmdir()
            except OSError:
                continue
            logger.warning(
                "removed the rings of %s (%d bytes): its runtime directory %s is "
                "gone and no process uses them",
                directory,
                held,
                runtime,
            )
        removed.append((directory, held))
    return removed


def _stale_bytes(directory: Path) -> int | None:
    """The bytes of the files in `directory` if no live process writes or reads any of
    its rings, else None."""
    held = 0
    locks = []
    try:
        for entry in directory.iterdir():
            info = entry.lstat()
            held += info.st_size
            if entry.suffix != ".ring" or not stat.S_ISREG(info.st_mode):
                continue
            try:
                fd = lock_ring_file(entry)
            except RingBusy:
                return None  # a daemon drains it
            except RingError:
                continue  # not a ring we can read: nobody else can either
            locks.append(fd)
            page = os.pread(fd, READER_PID_OFFSET + READER_PID.size, 0)
            writer = check_ring_control(page, info.st_size, mmap.PAGESIZE).writer_pid
            (reader,) = READER_PID.unpack_from(page, READER_PID_OFFSET)
            if pid_alive(writer) or (reader != os.getpid() and pid_alive(reader)):
                return None
    except OSError:
        return None
    finally:
        for fd in locks:
            os.close(fd)
    return held


def _run_ends(records: Records) -> list[int]:
    """Where each run of records of one site and one length ends (exclusive), ascending:
    the places a run must stop, found for the whole read at once."""
    if len(records) < 2:
        return [len(records)]
    sites = np.array(records.sites, np.uint64)
    lengths = np.array(records.ends, np.int64) - np.array(records.starts, np.int64)
    changes = (sites[1:] != sites[:-1]) | (lengths[1:] != lengths[:-1])
    return [*(np.flatnonzero(changes) + 1).tolist(), len(records)]
