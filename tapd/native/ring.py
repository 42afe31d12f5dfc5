"""A shared-memory ring of tap records (layout in tapd/native/ring.h and
docs/PROTOCOL.md). Writers are the FFI handlers, the portable backend's callbacks
(`tapd_ring_write_leaves`), or `write`/`write_leaves` here; the reader is the daemon,
which releases space only once the taps it read were delivered."""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, overload

import numpy as np

from tapd.errors import TapdError
from tapd.native import library
from tapd.protocol.ring_format import (
    EVERY_ALL,
    FLAG_STEP32,
    HELD_REASONS,
    NO_STEP,
    POLICIES,
    RECORD_HEADER,
    RECORD_HEADER_STRUCT,
    RINGS,
    SITE_SLOTS,
    TAG_ABANDONED,
    TAG_COMMITTED,
    TAG_STATE_MASK,
    writer_every,
)

logger = logging.getLogger("tapd.native")

# NO_STEP, POLICIES, RECORD_HEADER and RINGS are the format's (ring_format.py), named here too
# for the emitter and the tests.
__all__ = [
    "NO_STEP",
    "POLICIES",
    "RECORD_HEADER",
    "RINGS",
    "STALL_WARNING_S",
    "Counters",
    "Record",
    "Records",
    "Ring",
    "RingError",
    "round_capacity",
]

STALL_WARNING_S = 30.0  # a reserved record holding the ring back this long is logged
# Records read as numpy columns from this many on (`Ring._read_uniform`); fewer one by one.
COLUMNS_FROM = 24  # (the crossover measured: 16 records 13.5 µs as columns, 10 one by one)


@dataclasses.dataclass(frozen=True)
class Counters:
    head: int  # bytes reserved by writers, ever
    committed: int  # bytes readable
    tail: int  # bytes released by the reader
    taps: int  # records committed
    dropped: int  # taps refused for lack of space (drop_newest, or larger than the ring)
    blocked_ns: int  # time writers spent waiting for space (block)
    writer_pid: int
    capacity: int
    abandoned: int  # records reserved but never to be committed (ring.h): skipped
    skipped: int  # taps not copied: their site dormant or sampled out (ring.h, SiteSlot)


class Record(NamedTuple):  # (a NamedTuple: the daemon makes one per tap, quickly)
    start: int  # ring position of the record
    end: int  # ring position after it
    site: int
    seq: int
    step: int | None
    time_ns: int
    device: int
    payload: memoryview  # the leaves, each padded to 8 bytes


class Records(Sequence[Record]):
    """Records read from a ring, as columns (lists, in ring order); a `Record` is made
    only when one is asked for: the daemon routes runs of thousands of small records by
    their columns (tapd/daemon/ring_source.py, runs.py)."""

    __slots__ = (
        "devices",
        "ends",
        "header_bytes",
        "position",
        "seqs",
        "sites",
        "starts",
        "steps",
        "times",
        "view",
    )

    def __init__(self, view: memoryview, position: int, header_bytes: int) -> None:
        self.view = view  # the ring bytes from `position` on
        self.position = position
        self.header_bytes = header_bytes
        self.starts: list[int] = []  # ring positions
        self.ends: list[int] = []
        self.sites: list[int] = []
        self.seqs: list[int] = []
        self.steps: list[int | None] = []
        self.times: list[int] = []
        self.devices: list[int] = []

    @classmethod
    def empty(cls) -> Records:
        return cls(memoryview(b""), 0, 0)

    def append(
        self, start: int, end: int, site: int, seq: int, step: int | None, time_ns: int, device: int
    ) -> None:
        self.starts.append(start)
        self.ends.append(end)
        self.sites.append(site)
        self.seqs.append(seq)
        self.steps.append(step)
        self.times.append(time_ns)
        self.devices.append(device)

    def payload(self, i: int) -> memoryview:
        """Record i's leaves, each padded to 8 bytes (a view of the ring)."""
        return self.view[
            self.starts[i] - self.position + self.header_bytes : self.ends[i] - self.position
        ]

    def __len__(self) -> int:
        return len(self.starts)

    @overload
    def __getitem__(self, i: int) -> Record: ...
    @overload
    def __getitem__(self, i: slice) -> Records: ...
    def __getitem__(self, i: int | slice) -> Record | Records:
        if isinstance(i, slice):
            part = Records(self.view, self.position, self.header_bytes)
            part.starts, part.ends = self.starts[i], self.ends[i]
            part.sites, part.seqs, part.steps = self.sites[i], self.seqs[i], self.steps[i]
            part.times, part.devices = self.times[i], self.devices[i]
            return part
        i = range(len(self.starts))[i]  # (negative indices; IndexError past the end)
        return Record(
            self.starts[i],
            self.ends[i],
            self.sites[i],
            self.seqs[i],
            self.steps[i],
            self.times[i],
            self.devices[i],
            self.payload(i),
        )


class RingError(TapdError):
    """The ring could not be created or opened, or holds a malformed record."""


def _lib() -> ctypes.CDLL:
    lib = library.load()
    if lib is None:
        raise RingError(f"tapd's native library is unavailable: {library.unavailable_reason()}")
    return lib


def round_capacity(nbytes: int) -> int:
    """`nbytes` rounded up to whole pages (the double mapping needs it)."""
    page = mmap.PAGESIZE
    return max(page, -(-nbytes // page) * page)


class Ring:
    def __init__(self, handle: int, path: Path) -> None:
        self._handle: int | None = handle
        self.path = path
        self._lib = _lib()
        self.header_bytes = int(self._lib.tapd_ring_record_header_bytes())
        self._mapped: tuple[int, memoryview] | None = None  # (capacity, view of both maps)
        # The nonce mixed into every commit tag (ring.h, Tag()), its state bits clear.
        self._nonce = int(self._lib.tapd_ring_nonce(handle)) & ~TAG_STATE_MASK
        self._stalled: tuple[int, float, bool] | None = None  # (position, since, warned)
        self._stall_checked = -float("inf")  # when _check_stall last read the counters
        assert self.header_bytes == RECORD_HEADER.itemsize

    @classmethod
    def create(cls, path: Path, capacity: int, policy: str = "block") -> Ring:
        handle = _lib().tapd_ring_create(
            str(path).encode(), round_capacity(capacity), POLICIES[policy]
        )
        if not handle:
            err = ctypes.get_errno() or 0
            raise RingError(f"cannot create ring {path}: {os.strerror(err) if err else 'failed'}")
        return cls(handle, path)

    @classmethod
    def open(cls, path: Path) -> Ring:
        handle = _lib().tapd_ring_open(str(path).encode())
        if not handle:
            err = ctypes.get_errno()
            why = os.strerror(err) if err else "failed"
            if err == errno.EPROTO:
                why = "not a tapd ring of this version"
            raise RingError(f"cannot open ring {path}: {why}")
        return cls(handle, path)

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise RingError(f"ring {self.path} is closed")
        return self._handle

    def close(self) -> None:
        if self._handle is not None:
            self._mapped = None
            self._lib.tapd_ring_close(self._handle)
            self._handle = None

    def install(self, which: str = "daemon") -> None:
        """Make this the ring the process's taps write to: those whose `ring` attribute
        is RING_DAEMON ("daemon": the one its host's daemon drains) or RING_LOCAL
        ("local": the one this process's receiver drains; tapd.emitter.local.path)."""
        self._lib.tapd_ring_install_at(self.handle, RINGS[which])

    def put_entry(self, entry: bytes, site: int, consumer: int) -> None:
        """The ids its handler's taps find under the site's entry (the custom call's
        `entry` attribute; tapd/emitter/entries.py)."""
        self._lib.tapd_ring_put_entry(self.handle, entry, len(entry), site, consumer)

    def counters(self) -> Counters:
        out = (ctypes.c_uint64 * 10)()
        self._lib.tapd_ring_counters(self.handle, out)
        return Counters(*[int(v) for v in out])

    def settled(self, timeout: float = 10.0) -> int:
        """The writer, for a barrier: `committed` once every record reserved so far is
        committed or abandoned (CUDA commits may land after the computation's token is
        ready); after `timeout` seconds, as it is (saying which record holds it)."""
        return int(self._lib.tapd_ring_settled(self.handle, int(timeout * 1000)))

    # -- the site table (ring.h, SiteSlot): dormant and sampled taps --

    def set_site_every(self, site: int, every: int) -> bool:
        """The daemon: every how many taps of `site` its takers want: EVERY_ALL (0,
        nobody has said: all), EVERY_DORMANT (no taker: copy nothing) or N >= 1. A site
        without a slot (site >= SITE_SLOTS) is always sent: nothing to set. True where
        the emitter relies on the site's dormancy (`site_relied_on`): a wake holds once
        it acknowledges it."""
        if not 0 <= every <= 0xFFFFFFFF:
            raise ValueError(f"site {site}: every={every} is not a u32")
        if 0 <= site < SITE_SLOTS:
            return bool(self._lib.tapd_ring_set_site_every(self.handle, site, every))
        return False

    def site_relied_on(self, site: int) -> bool:
        """Whether the emitter runs calls that skip the site's taps without reading its
        slot (ring.h, SiteSlot::relied_on): a wake is not yet acknowledged."""
        if not 0 <= site < SITE_SLOTS:
            return False
        return bool(self._lib.tapd_ring_site_relied_on(self.handle, site))

    def site_every(self, site: int) -> int:
        """What the site table says of `site` (EVERY_ALL for a site without a slot)."""
        if not 0 <= site < SITE_SLOTS:
            return EVERY_ALL
        return int(self._lib.tapd_ring_site_every(self.handle, site))

    def skipped_by_site(self) -> dict[int, int]:
        """Taps not copied, by site: the sites that skipped any."""
        out = (ctypes.c_uint64 * SITE_SLOTS)()
        self._lib.tapd_ring_skipped_by_site(self.handle, out)
        counts = np.ctypeslib.as_array(out)
        return {int(site): int(counts[site]) for site in np.flatnonzero(counts)}

    def set_reader(self, pid: int) -> None:
        self._lib.tapd_ring_set_reader(self.handle, pid)

    def set_held_reason(self, reason: str) -> None:
        """The daemon: why it holds the oldest record it has not released (a key of
        HELD_REASONS); a writer waiting for space says so."""
        self._lib.tapd_ring_set_held(self.handle, HELD_REASONS[reason])

    def write(
        self,
        site: int,
        payload: bytes,
        *,
        consumer: int = 0,
        device: int = 0,
        step: int | None = None,
    ) -> bool:
        """Append one record from Python (tests, benchmarks). False if dropped or
        skipped (the site table says so)."""
        step_value = NO_STEP if step is None else step
        status: int = self._lib.tapd_ring_write(
            self.handle, site, consumer, device, step_value, payload, len(payload)
        )
        return status == 0

    def write_leaves(
        self,
        site: int,
        arrays: Sequence[Any],
        *,
        consumer: int = 0,
        device: int = 0,
        step: int | None = None,
        every: int = 1,
        always: bool = False,
    ) -> bool:
        """Append one record of several leaves, exactly as the FFI handler writes it
        (through `tapd_ring_write_leaves`, which the portable backend calls directly),
        sampled by the site's own `every` and, unless `always`, the site table. False if
        dropped or skipped."""
        leaves = [np.ascontiguousarray(a) for a in arrays]
        data = (ctypes.c_void_p * len(leaves))(*[a.ctypes.data for a in leaves])
        sizes = (ctypes.c_uint64 * len(leaves))(*[a.nbytes for a in leaves])
        step_value = NO_STEP if step is None else step
        status: int = self._lib.tapd_ring_write_leaves(
            self.handle,
            site,
            consumer,
            device,
            step_value,
            writer_every(every, always),
            len(leaves),
            data,
            sizes,
        )
        return status == 0

    # -- the commit protocol, a step at a time (tests only) --

    def reserve_for_test(
        self,
        site: int,
        payload: bytes,
        *,
        consumer: int = 0,
        device: int = 0,
        step: int | None = None,
    ) -> int | None:
        """Reserve and fill a record without committing it; its position, or None if
        dropped. Commit it (or abandon it) later, from any thread."""
        position = ctypes.c_uint64()
        step_value = NO_STEP if step is None else step
        where = ctypes.byref(position)
        status = self._lib.tapd_ring_reserve_for_test(
            self.handle, site, consumer, device, step_value, payload, len(payload), where
        )
        return None if status else int(position.value)

    def commit_for_test(self, position: int) -> None:
        self._lib.tapd_ring_commit_for_test(self.handle, position)

    def abandon_for_test(self, position: int) -> None:
        self._lib.tapd_ring_abandon_for_test(self.handle, position)

    def device_enqueue_for_test(self, position: int, *, step32: int | None = None) -> None:
        """The host half of a commit a CUDA stream writes (ffi_cuda.cc): the reserved
        record marked so, an int32 `step32` put in the low half of its step as the
        device copies it, the tap counted, a sleeping reader woken."""
        self._lib.tapd_ring_device_enqueue_for_test(
            self.handle, position, step32 is not None, step32 or 0
        )

    def device_store_for_test(self, position: int) -> None:
        """The device half: the commit tag's low 32 bits stored, nothing else."""
        self._lib.tapd_ring_device_store_for_test(self.handle, position)

    def reserve_bare_for_test(self, length: int) -> int | None:
        """Reserve `length` bytes and write nothing, not even a header (a writer that
        dies right after reserving). The position, or None if dropped."""
        position = int(self._lib.tapd_ring_reserve_bare_for_test(self.handle, length))
        return None if position == 2**64 - 1 else position

    def maps(self, owner: object) -> bool:
        """Whether `owner` (a view's `.obj`) is this ring's mapping of its records: a
        frame read from this ring, not from another ring of the same size."""
        return self._mapped is not None and owner is self._mapped[1].obj

    def read(self, position: int, max_records: int = 1024) -> list[Record]:
        """Committed records from `position` on (views into the ring: valid until the
        space is released and rewritten). Abandoned records are skipped: the first
        record may start after `position`, and one may start after the previous one's
        end."""
        return list(self.read_span(position, max_records)[1])

    def readable(self, position: int) -> memoryview | None:
        """A view of the committed ring bytes from `position` on (the ring is mapped
        twice: any span of it is contiguous); None if there are none."""
        pointer = ctypes.c_void_p()
        available = int(self._lib.tapd_ring_readable(self.handle, position, ctypes.byref(pointer)))
        if available == 0:
            self._check_stall(position)
            return None
        self._stalled = None
        if self._mapped is None:  # both mappings, viewed once (a ctypes type per read is slow)
            capacity = self.counters().capacity
            base = (pointer.value or 0) - position % capacity
            array = (ctypes.c_ubyte * (2 * capacity)).from_address(base)
            self._mapped = (capacity, memoryview(array).cast("B"))
        capacity, mapped = self._mapped
        start = position % capacity
        return mapped[start : start + available]

    def read_span(self, position: int, max_records: int = 1024) -> tuple[memoryview, Records]:
        """Like `read`, with a view of the ring bytes from `position` on, which holds the
        records (the ring is mapped twice: any span of it is contiguous), and the records
        as columns (`Records`)."""
        view = self.readable(position)
        if view is None:
            return memoryview(b""), Records.empty()
        available = len(view)
        records = self._read_uniform(view, position, max_records)
        offset = records.ends[-1] - position if records.ends else 0
        nonce = self._nonce
        while offset < available and len(records.starts) < max_records:
            if available - offset < self.header_bytes:
                raise RingError(f"ring {self.path}: truncated record header at {position + offset}")
            length, _, site, seq, step, time_ns, device, flags, tag = (
                RECORD_HEADER_STRUCT.unpack_from(view, offset)
            )
            if flags & FLAG_STEP32:
                step = (step & 0xFFFFFFFF) - ((step & 0x80000000) << 1)
            if length < self.header_bytes or length % 8 or offset + length > available:
                raise RingError(
                    f"ring {self.path}: bad record length {length} at {position + offset}"
                )
            base_tag = ((position + offset) ^ nonce) & ~TAG_STATE_MASK
            if tag != base_tag | TAG_COMMITTED:
                if tag != base_tag | TAG_ABANDONED:
                    raise RingError(
                        f"ring {self.path}: record at {position + offset} is not committed"
                    )
                offset += length  # never to be committed: skipped (counted in `abandoned`)
                continue
            start = position + offset
            step_or_none = None if step == NO_STEP else step
            records.append(start, start + length, site, seq, step_or_none, time_ns, device)
            offset += length
        return view, records

    def _read_uniform(self, view: memoryview, position: int, max_records: int) -> Records:
        """The leading records of `view` that are committed and as long as the first,
        read as columns with numpy: a loop writing one small tap after another fills the
        ring with such records, and one Python step per record header limited the
        daemon's small-tap rate. The rest (other lengths, abandoned or bad records) is
        left to `read_span`'s record-by-record walk, which checks and reports it, and so
        are a few records: numpy's fixed cost (~12 µs here) is more than the walk's
        (~0.5 µs a record) below `COLUMNS_FROM`, and a daemon that taps reach a few
        thousand a second reads a handful at a time."""
        header_bytes = self.header_bytes
        records = Records(view, position, header_bytes)
        uniform = self.uniform_headers(view, position, max_records, COLUMNS_FROM)
        if uniform is None:
            return records
        headers, starts, length = uniform
        count = len(headers)
        records.starts = starts.tolist()
        records.ends = (starts + length).tolist()
        records.sites = headers["site"].tolist()
        records.seqs = headers["seq"].tolist()
        steps = headers["step"]
        step32 = (headers["flags"] & FLAG_STEP32) != 0
        if step32.any():  # committed by a CUDA stream: an int32 step, to sign-extend
            low = (steps & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64)
            steps = np.where(step32, low, steps)
        no_step = steps == NO_STEP
        if no_step.all():  # (an id_tap, a tap without step=: no int made a record)
            records.steps = [None] * count
        elif no_step.any():
            records.steps = [None if step == NO_STEP else step for step in steps.tolist()]
        else:
            records.steps = steps.tolist()
        records.times = headers["time_ns"].tolist()
        records.devices = headers["device"].tolist()
        return records

    def uniform_headers(
        self, view: memoryview, position: int, max_records: int, least: int
    ) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The headers (a strided RECORD_HEADER array viewing the ring) and ring
        positions of the leading records of `view` that are committed and as long as the
        first, and that length; None where fewer than `least` are."""
        header_bytes = self.header_bytes
        if len(view) < header_bytes:
            return None
        length = RECORD_HEADER_STRUCT.unpack_from(view, 0)[0]
        if length < header_bytes or length % 8:
            return None
        count = min(len(view) // length, max_records)
        if count < max(1, least):
            return None
        headers = np.ndarray((count,), RECORD_HEADER, buffer=view, strides=(length,))
        offsets = np.arange(count, dtype=np.uint64) * np.uint64(length)
        tag_bits = np.uint64(~TAG_STATE_MASK % 2**64)
        tags = ((np.uint64(position) + offsets) ^ np.uint64(self._nonce)) & tag_bits
        committed = tags | np.uint64(TAG_COMMITTED)
        good = (headers["length"] == length) & (headers["commit"] == committed)
        if not good.all():
            count = int(good.argmin())  # (the first that is not: read one by one)
            if count < max(1, least):
                return None
            headers, offsets = headers[:count], offsets[:count]
        return headers, offsets.astype(np.int64) + position, length

    def _check_stall(self, position: int) -> None:
        """Nothing readable: say so once if a record has stayed reserved, holding back
        the ring, for STALL_WARNING_S (its writer lives, so it is not skipped). Looked at
        no more often than every STALL_WARNING_S / 8: reading the counters costs more
        than the read that found nothing, which a busy daemon makes every round."""
        now = time.monotonic()
        if now - self._stall_checked < STALL_WARNING_S / 8:
            return
        self._stall_checked = now
        counters = self.counters()
        if counters.head <= counters.committed or position < counters.committed:
            self._stalled = None
            return
        if self._stalled is None or self._stalled[0] != counters.committed:
            self._stalled = (counters.committed, now, False)
        elif not self._stalled[2] and now - self._stalled[1] >= STALL_WARNING_S:
            self._stalled = (counters.committed, self._stalled[1], True)
            logger.warning(
                "ring %s: the record at position %d has been reserved but not committed "
                "for %.0f s, holding back %d bytes after it; its writer (pid %d) still "
                "runs, so it is not skipped (docs/PROTOCOL.md, 'Records never committed')",
                self.path,
                counters.committed,
                now - self._stalled[1],
                counters.head - counters.committed,
                counters.writer_pid,
            )

    def sleep(self, position: int) -> bool:
        """The reader is going idle: ask the next writer to commit for a datagram to
        `wake.sock` beside the ring. False (and nothing asked) if records from
        `position` on are readable already."""
        return not self._lib.tapd_ring_sleep(self.handle, position)

    def gather(self, on: bool = True) -> bool:
        """The reader lets taps gather (`on`): ask writers for a datagram to `wake.sock`
        only once half the ring waits for it. False (and nothing asked) if half of it
        does already. `on` False: the reader is back, nothing is asked any more."""
        return bool(self._lib.tapd_ring_gather(self.handle, int(on)))

    def release(self, position: int) -> None:
        """Everything before `position` was delivered: writers may reuse it."""
        self._lib.tapd_ring_release(self.handle, position)
