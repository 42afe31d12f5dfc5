"""The native shared-memory ring (tapd/native/ring.cc) through its ctypes wrapper
(tapd/native/ring.py): wrap-around, records as large as the ring (double mapping), the
drop_newest and block policies, concurrent producers, a reader that restarts, files
that are not rings, the portable backend's one-call write (the FFI handler's record),
commits out of reservation order, and writers that die between reserving and
committing. Every ring lives in the test's own tmp_path and is closed by the `rings`
fixture; no assertion depends on timing."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import mmap
import os
import queue
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tapd.native import build, library
from tapd.native import ring as ring_module
from tapd.native.ring import RECORD_HEADER, Record, Ring, RingError
from tapd.protocol import ring_format

if library.load() is None:
    pytest.skip(
        "tapd's native library is unavailable "
        f"({library.unavailable_reason()}); it needs a C++17 compiler "
        "(`python -m tapd.native.build` says what is found)",
        allow_module_level=True,
    )

PAGE = mmap.PAGESIZE
CAPACITY = 2 * PAGE  # small, so that a few records wrap it
HEADER = RECORD_HEADER.itemsize
# The ring file starts with its header area (control page and site table) of this size.
CONTROL_BYTES = max(PAGE, ring_format.HEADER_BYTES)
JOIN_TIMEOUT = 30.0  # only bounds a hang (failing the test then); never decides a pass

# Sequence numbers are kept per (consumer, device) for the whole process, not per ring:
# each test takes consumer ids no other test (or module) uses, so its seqs start at 0.
_consumer_ids = itertools.count(0x7E570000)


def align8(n: int) -> int:
    return (n + 7) & ~7


@dataclasses.dataclass(frozen=True)
class Copied:
    """A record copied out of the ring (a Record's payload is only a view into it)."""

    start: int
    end: int
    site: int
    seq: int
    step: int | None
    time_ns: int
    device: int
    payload: bytes

    @classmethod
    def of(cls, record: Record) -> Copied:
        return cls(
            record.start,
            record.end,
            record.site,
            record.seq,
            record.step,
            record.time_ns,
            record.device,
            bytes(record.payload),
        )


def copy_all(records: list[Record]) -> list[Copied]:
    return [Copied.of(record) for record in records]


def check_payload(record: Copied | Record, expected: bytes) -> None:
    """The payload is the written bytes, padded to 8 (padding bytes are unspecified)."""
    assert len(record.payload) == align8(len(expected)), (record, len(expected))
    assert bytes(record.payload[: len(expected)]) == expected, record


class Rings:
    """Creates and opens rings in one directory; the fixture closes them all."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.opened: list[Ring] = []

    def path(self, name: str = "ring") -> Path:
        return self.directory / name

    def create(self, policy: str = "block", capacity: int = CAPACITY, name: str = "ring") -> Ring:
        ring = Ring.create(self.path(name), capacity, policy)
        self.opened.append(ring)
        assert ring.counters().capacity == capacity
        return ring

    def open(self, name: str = "ring") -> Ring:
        ring = Ring.open(self.path(name))
        self.opened.append(ring)
        return ring


# Threads these tests start. A ring is never unmapped while one of them may still be
# inside a ring call (that would crash the process instead of failing the test).
_threads: list[threading.Thread] = []


@pytest.fixture
def rings(tmp_path: Path) -> Iterator[Rings]:
    made = Rings(tmp_path)
    first_thread = len(_threads)
    yield made
    stuck = [thread.name for thread in _threads[first_thread:] if thread.is_alive()]
    if stuck:  # only after a failure: leave the rings mapped rather than crash
        pytest.fail(f"threads still running, rings left mapped: {stuck}")
    for ring in made.opened:
        ring.close()  # idempotent: closing twice is a no-op


@pytest.fixture
def consumer() -> int:
    return next(_consumer_ids)


class Worker(threading.Thread):
    """A thread that keeps its target's result or exception for the test to look at."""

    def __init__(self, target: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._target_fn = target
        self.result: Any = None
        self.error: BaseException | None = None
        _threads.append(self)

    def run(self) -> None:
        try:
            self.result = self._target_fn()
        except BaseException as exc:
            self.error = exc


class Drainer(threading.Thread):
    """The reader: reads and releases until `expected` records arrived, keeping copies.
    If reading fails it keeps releasing everything committed until told to stop, so that
    blocked writers can finish; `finish()` re-raises the error."""

    def __init__(self, ring: Ring, expected: int, position: int = 0, batch: int = 64) -> None:
        super().__init__(daemon=True)
        self.ring = ring
        self.expected = expected
        self.position = position
        self.batch = batch
        self.records: list[Copied] = []
        self.error: BaseException | None = None
        self._done = threading.Event()  # all records arrived, or reading failed
        self._halt = threading.Event()
        _threads.append(self)

    def run(self) -> None:
        try:
            while len(self.records) < self.expected and not self._halt.is_set():
                records = self.ring.read(self.position, self.batch)
                if not records:
                    self._halt.wait(0.0002)  # pacing only
                    continue
                for record in records:
                    assert record.start == self.position, (record.start, self.position)
                    self.records.append(Copied.of(record))
                    self.position = record.end
                self.ring.release(self.position)
        except BaseException as exc:
            self.error = exc
            self._done.set()
            while not self._halt.is_set():
                self.ring.release(self.ring.counters().committed)
                self._halt.wait(0.001)
        self._done.set()

    def abandon(self) -> None:
        self._halt.set()
        self.join(timeout=JOIN_TIMEOUT)

    def finish(self) -> list[Copied]:
        """Call once the writers are done: the records, after every one arrived."""
        arrived = self._done.wait(timeout=JOIN_TIMEOUT)
        self._halt.set()
        self.join(timeout=JOIN_TIMEOUT)
        assert not self.is_alive(), "the reader thread did not stop"
        if self.error is not None:
            raise self.error
        assert arrived, (
            f"only {len(self.records)} of {self.expected} records arrived; "
            f"reader at {self.position}, {self.ring.counters()}"
        )
        return self.records


def join_writers(ring: Ring, writers: list[Worker]) -> None:
    """Join the writers. Should some be stuck (blocked on a ring nobody frees), release
    everything committed so that they return before the ring is unmapped, then fail."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    for writer in writers:
        writer.join(timeout=max(0.0, deadline - time.monotonic()))
    stuck = [writer for writer in writers if writer.is_alive()]
    if stuck:
        counters = ring.counters()
        rescue = time.monotonic() + 10
        while any(w.is_alive() for w in stuck) and time.monotonic() < rescue:
            ring.release(ring.counters().committed)
            stuck[0].join(timeout=0.001)
        pytest.fail(
            f"{len(stuck)} writer thread(s) still blocked after {JOIN_TIMEOUT} s: {counters}"
        )
    for writer in writers:
        if writer.error is not None:
            raise writer.error


def bounded_write(ring: Ring, site: int, payload: bytes, **fields: Any) -> bool:
    """`ring.write` from a helper thread: on a block ring, a write that never returns (a
    bug) then fails the test instead of hanging the session in C, out of pytest-timeout's
    reach."""
    writer = Worker(functools.partial(ring.write, site, payload, **fields))
    writer.start()
    join_writers(ring, [writer])
    return bool(writer.result)


# ---- 1. wrap-around ------------------------------------------------------------------


@pytest.mark.fast
def test_many_varied_records_wrap_a_small_ring_intact(rings: Rings, consumer: int) -> None:
    # drop_newest: were the test's own space arithmetic wrong, write returns False
    # (and fails the test) instead of blocking forever.
    ring = rings.create("drop_newest")
    rng = random.Random(20240601)
    total = 700
    expected: list[tuple[int, int, int | None, int, bytes]] = []  # site, seq, step, dev, data
    seqs = dict.fromkeys(range(3), 0)
    received: list[Copied] = []
    position = 0

    def consume(max_records: int) -> None:
        nonlocal position
        records = ring.read(position, max_records)
        assert records, "the ring is full but the reader sees nothing"
        assert len(records) <= max_records
        for record in records:
            site, seq, step, device, data = expected[len(received)]
            assert record.start == position  # contiguous, monotonic positions
            assert record.end == record.start + HEADER + align8(len(data))
            assert (record.site, record.seq, record.step, record.device) == (
                site,
                seq,
                step,
                device,
            )
            assert record.time_ns > 0
            check_payload(record, data)
            received.append(Copied.of(record))
            position = record.end
        ring.release(position)
        assert ring.counters().tail == position

    for n in range(total):
        size = rng.choice([0, 1, 7, 8, 9, rng.randrange(0, 200), rng.randrange(200, CAPACITY // 3)])
        length = HEADER + align8(size)
        counters = ring.counters()
        while counters.head + length - counters.tail > CAPACITY:
            consume(rng.randint(1, 4))
            counters = ring.counters()
        device = rng.randrange(3)
        step = rng.choice([None, n, -n, 0, 2**62])
        data = rng.randbytes(size)
        site = n * 31 + 5
        assert ring.write(site, data, consumer=consumer, device=device, step=step)
        expected.append((site, seqs[device], step, device, data))
        seqs[device] += 1
        after = ring.counters()
        assert after.head == counters.head + length
        assert after.committed == after.head  # one writer: committed at once
        assert 0 <= after.head - after.tail <= CAPACITY  # capacity never exceeded
    while len(received) < total:
        consume(rng.randint(1, 8))

    assert ring.read(position) == []
    final = ring.counters()
    assert (final.head, final.committed, final.tail) == (position,) * 3
    assert (final.taps, final.dropped) == (total, 0)
    assert final.head > 20 * CAPACITY  # it wrapped many times
    assert any(r.start // CAPACITY != (r.end - 1) // CAPACITY for r in received)


# ---- 2. records larger than half the ring ----------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("policy", ["block", "drop_newest"])
def test_records_larger_than_half_the_ring(rings: Rings, consumer: int, policy: str) -> None:
    ring = rings.create(policy)
    size = CAPACITY * 3 // 4
    position = 0
    crossing = 0
    for i in range(12):
        data = random.Random(i).randbytes(size)
        assert bounded_write(ring, 7, data, consumer=consumer, device=2, step=i)
        records = ring.read(position)
        assert len(records) == 1
        [record] = records
        assert (record.start, record.end) == (position, position + HEADER + size)
        assert (record.site, record.seq, record.step, record.device) == (7, i, i, 2)
        check_payload(record, data)
        if record.start // CAPACITY != (record.end - 1) // CAPACITY:
            crossing += 1  # contiguous only thanks to the double mapping
        position = record.end
        ring.release(position)
    assert crossing >= 5

    # A record of exactly the ring's size fits an empty ring, even starting mid-ring.
    assert position % CAPACITY != 0
    data = random.Random(99).randbytes(CAPACITY - HEADER)
    assert bounded_write(ring, 8, data, consumer=consumer, device=2, step=None)
    [record] = ring.read(position)
    assert (record.start, record.end, record.seq, record.step) == (
        position,
        position + CAPACITY,
        12,
        None,
    )
    check_payload(record, data)
    ring.release(record.end)
    counters = ring.counters()
    assert (counters.taps, counters.dropped) == (13, 0)
    assert counters.head == counters.committed == counters.tail == record.end


@pytest.mark.fast
def test_a_second_large_record_waits_for_space_under_drop_newest(
    rings: Rings, consumer: int
) -> None:
    ring = rings.create("drop_newest")
    size = CAPACITY * 3 // 4
    first = b"\x01" * size
    assert ring.write(1, first, consumer=consumer)
    assert not ring.write(2, b"\x02" * size, consumer=consumer)  # does not fit beside it
    [record] = ring.read(0)
    check_payload(record, first)
    ring.release(record.end)
    assert ring.write(3, b"\x03" * size, consumer=consumer)
    [record] = ring.read(record.end)
    assert (record.site, record.seq) == (3, 2)
    check_payload(record, b"\x03" * size)
    assert ring.counters().dropped == 1


# ---- 3. a record larger than the ring --------------------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize("policy", ["block", "drop_newest"])
def test_record_larger_than_the_ring_is_dropped_and_counted(
    rings: Rings, consumer: int, policy: str
) -> None:
    ring = rings.create(policy)
    assert bounded_write(ring, 1, b"before", consumer=consumer, step=1)
    before = ring.counters()
    # Larger than the ring by the header, and by one byte (padded to 8) over the maximum.
    assert not bounded_write(ring, 2, bytes(CAPACITY), consumer=consumer, step=2)
    assert not bounded_write(ring, 2, bytes(CAPACITY - HEADER + 1), consumer=consumer, step=2)
    after = ring.counters()
    assert after.dropped == 2
    assert (after.head, after.committed, after.tail, after.taps) == (
        before.head,
        before.committed,
        before.tail,
        before.taps,
    )
    assert after.blocked_ns == before.blocked_ns == 0

    assert bounded_write(ring, 3, b"after", consumer=consumer, step=3)
    records = ring.read(0)
    # Drops count in the sequence too: the gap (seqs 1 and 2) is visible.
    assert [(r.site, r.seq, r.step) for r in records] == [(1, 0, 1), (3, 3, 3)]
    check_payload(records[0], b"before")
    check_payload(records[1], b"after")
    assert records[1].start == records[0].end
    final = ring.counters()
    assert (final.taps, final.dropped) == (2, 2)


# ---- 4. drop_newest on a full ring -----------------------------------------------------


@pytest.mark.fast
def test_drop_newest_drops_exactly_what_does_not_fit(rings: Rings, consumer: int) -> None:
    ring = rings.create("drop_newest")
    size = 1000
    length = HEADER + align8(size)
    fit = CAPACITY // length
    small = CAPACITY - fit * length - HEADER - 8  # fits what is left, leaving 8 bytes
    assert 0 < small < size

    def write(seq_expected: int, nbytes: int) -> bool:
        return ring.write(seq_expected, bytes([seq_expected]) * nbytes, consumer=consumer)

    for seq in range(fit):
        assert write(seq, size)
    full = ring.counters()
    for seq in range(fit, fit + 3):
        assert not write(seq, size)
    counters = ring.counters()
    assert counters.dropped == 3
    assert (counters.head, counters.committed, counters.taps) == (
        full.head,
        full.committed,
        full.taps,
    )

    # A smaller record still fits what is left; after it, not even an empty one does.
    assert write(fit + 3, small)
    assert CAPACITY - ring.counters().head < HEADER
    assert not write(fit + 4, 0)
    assert ring.counters().dropped == 4

    # Releasing one record makes room for exactly one more of that size.
    [oldest] = ring.read(0, max_records=1)
    ring.release(oldest.end)
    assert write(fit + 5, size)
    assert not write(fit + 6, size)

    records = ring.read(oldest.end)
    accepted = [*range(1, fit), fit + 3, fit + 5]
    assert [r.seq for r in records] == accepted  # gaps where records were dropped
    for record in records:
        assert record.site == record.seq  # the site encodes the seq it was written with
        check_payload(record, bytes([record.seq]) * (small if record.seq == fit + 3 else size))
    counters = ring.counters()
    assert (counters.taps, counters.dropped) == (fit + 2, 5)
    assert counters.head - counters.tail <= CAPACITY
    # Another device's sequence is its own: the drops above do not show in it.
    ring.release(records[-1].end)
    assert ring.write(1, b"x", consumer=consumer, device=1)
    [other] = ring.read(records[-1].end)
    assert (other.device, other.seq) == (1, 0)


# ---- 5. block: the writer waits for the reader -----------------------------------------


@pytest.mark.fast
def test_block_policy_writer_waits_until_the_reader_frees_space(
    rings: Rings, consumer: int
) -> None:
    ring = rings.create("block")
    size = 1000
    fit = CAPACITY // (HEADER + size)
    total = 40

    def data(i: int) -> bytes:
        return struct.pack("<I", i) * (size // 4)

    def write_rest() -> list[bool]:
        return [ring.write(i, data(i), consumer=consumer, step=i) for i in range(fit, total)]

    for i in range(fit):
        assert bounded_write(ring, i, data(i), consumer=consumer, step=i)
    full = ring.counters()

    writer = Worker(write_rest)
    writer.start()
    reader = Drainer(ring, expected=total, batch=3)
    try:
        writer.join(timeout=0.5)
        # Not a timing assertion: a write into a full ring must not return at all until
        # space is released, however long we wait.
        assert writer.is_alive(), f"write returned on a full ring: {writer.result!r}"
        now = ring.counters()
        assert (now.head, now.committed, now.taps, now.dropped) == (
            full.head,
            full.committed,
            full.taps,
            0,
        )
    finally:
        reader.start()
        try:
            join_writers(ring, [writer])
        except BaseException:
            reader.abandon()
            raise
    records = reader.finish()

    assert writer.result == [True] * (total - fit)
    assert [r.seq for r in records] == list(range(total))
    assert [r.site for r in records] == list(range(total))
    assert [r.step for r in records] == list(range(total))
    for record in records:
        check_payload(record, data(record.seq))
    counters = ring.counters()
    assert (counters.taps, counters.dropped) == (total, 0)
    assert counters.head == counters.committed == counters.tail == records[-1].end


# ---- 6. concurrent producers -----------------------------------------------------------

THREADS = 8
PER_THREAD = 2000


def producer_payload(tid: int, i: int) -> bytes:
    """(tid, i) repeated, so a torn or interleaved record shows; lengths vary and are
    not all multiples of 8."""
    words = 2 + (i * 37 + tid) % 512  # up to 4 KiB: records up to half the ring
    return (struct.pack("<II", tid, i) * words)[: 8 * words - (i + tid) % 8]


def run_producers(
    ring: Ring, consumer: int, *, per_thread: int = PER_THREAD, one_device: bool = False
) -> tuple[list[Copied], list[list[bool]]]:
    """THREADS writers at once, each on its own device (or all on device 0)."""
    start = threading.Barrier(THREADS)

    def produce(tid: int) -> list[bool]:
        start.wait(timeout=JOIN_TIMEOUT)
        device = 0 if one_device else tid
        return [
            ring.write(1000 + tid, producer_payload(tid, i), consumer=consumer, device=device,
                       step=i)
            for i in range(per_thread)
        ]  # fmt: skip

    writers = [Worker(functools.partial(produce, tid)) for tid in range(THREADS)]
    reader = Drainer(ring, expected=THREADS * per_thread)
    reader.start()
    try:
        for writer in writers:
            writer.start()
        join_writers(ring, writers)
    except BaseException:
        reader.abandon()
        raise
    if ring.counters().dropped:  # drop_newest: fewer records will come
        reader.expected = ring.counters().taps
    records = reader.finish()
    return records, [writer.result for writer in writers]


def check_record_is_whole(record: Copied) -> tuple[int, int]:
    tid, i = struct.unpack_from("<II", record.payload)
    expected = producer_payload(tid, i)
    check_payload(record, expected)  # no torn or interleaved bytes
    assert (record.device, record.site, record.step) == (tid, 1000 + tid, i), record
    return tid, i


@pytest.mark.fast
def test_concurrent_producers_lose_nothing_tear_nothing_keep_order(
    rings: Rings, consumer: int
) -> None:
    ring = rings.create("block")
    records, results = run_producers(ring, consumer)

    assert all(all(result) for result in results)
    assert len(records) == THREADS * PER_THREAD
    assert records[0].start == 0
    for previous, record in itertools.pairwise(records):
        assert record.start == previous.end  # back to back, nothing skipped
    by_thread: dict[int, list[int]] = {tid: [] for tid in range(THREADS)}
    seqs: dict[int, list[int]] = {tid: [] for tid in range(THREADS)}
    for record in records:
        tid, i = check_record_is_whole(record)
        by_thread[tid].append(i)
        seqs[record.device].append(record.seq)
    for tid in range(THREADS):
        assert by_thread[tid] == list(range(PER_THREAD)), f"producer {tid} out of order"
        assert seqs[tid] == list(range(PER_THREAD)), f"device {tid} seqs"
    counters = ring.counters()
    assert (counters.taps, counters.dropped) == (THREADS * PER_THREAD, 0)
    assert counters.head == counters.committed == counters.tail == records[-1].end
    assert counters.head > 100 * CAPACITY  # wrapped many times


@pytest.mark.fast
def test_concurrent_producers_under_drop_newest_account_for_every_record(
    rings: Rings, consumer: int
) -> None:
    ring = rings.create("drop_newest")
    records, results = run_producers(ring, consumer)

    refused = sum(result.count(False) for result in results)
    counters = ring.counters()
    assert counters.dropped == refused
    assert counters.taps == len(records) == THREADS * PER_THREAD - refused
    accepted = {tid: [i for i, ok in enumerate(results[tid]) if ok] for tid in range(THREADS)}
    by_thread: dict[int, list[int]] = {tid: [] for tid in range(THREADS)}
    for previous, record in itertools.pairwise(records):
        assert record.start == previous.end
    for record in records:
        tid, i = check_record_is_whole(record)
        assert record.seq == i  # seqs count drops: each record keeps its own number
        by_thread[tid].append(i)
    assert by_thread == accepted  # exactly the accepted ones, in order
    assert counters.head == counters.committed == counters.tail


@pytest.mark.fast
def test_threads_tapping_one_consumer_on_one_device_land_in_sequence_order(
    rings: Rings, consumer: int
) -> None:
    """Sequence number and ring position are taken together: whichever thread wins,
    the ring holds seq 0, 1, 2, ... in order for a (consumer, device)."""
    ring = rings.create("block")
    records, _ = run_producers(ring, consumer, per_thread=PER_THREAD // 4, one_device=True)
    assert [r.seq for r in records] == list(range(THREADS * (PER_THREAD // 4)))


@pytest.mark.fast
def test_an_idle_reader_is_woken_by_the_next_commit_not_before(rings: Rings) -> None:
    """The reader asks to be woken (`sleep`); the next writer to commit sends one
    datagram to `wake.sock` beside the ring, and only then."""
    writer = rings.create("block")
    reader = rings.open()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
        wake.bind(str(rings.path("wake.sock")))
        wake.settimeout(10)
        assert writer.write(1, b"first")  # nobody asked: no datagram
        assert reader.sleep(0) is False  # records are readable: no need to sleep
        end = reader.read(0)[-1].end
        assert reader.sleep(end) is True  # read to the end: asleep, wake me
        assert writer.write(1, b"second")
        assert wake.recv(16) == b"\x01"
        assert writer.write(1, b"third")  # the flag was taken: no second datagram
        wake.settimeout(0.05)
        with pytest.raises(TimeoutError):
            wake.recv(16)
    assert [r.payload[:6].tobytes() for r in reader.read(end)] == [b"second", b"third\0"]


@pytest.mark.fast
def test_a_gathering_reader_is_woken_once_half_the_ring_waits_not_before(rings: Rings) -> None:
    """A reader letting taps gather (`gather`) is not woken by each commit, as an idle
    one is, but by the first that leaves half the ring waiting for it; it is not asked
    for at all where half waits already; back (`gather(False)`), it asks nothing."""
    writer = rings.create("block")
    reader = rings.open()
    size = 1000
    length = HEADER + align8(size)
    below_half = (CAPACITY // 2 - 1) // length
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
        wake.bind(str(rings.path("wake.sock")))
        assert reader.gather() is True
        wake.settimeout(0.05)
        for i in range(below_half):
            assert writer.write(i % 200, bytes(size))
        with pytest.raises(TimeoutError):
            wake.recv(16)
        assert writer.write(7, bytes(size))  # half the ring now waits
        wake.settimeout(10)
        assert wake.recv(16) == b"\x01"
        assert writer.write(8, bytes(size))  # the flag was taken: no second datagram
        assert reader.gather() is False  # half waits already: not asked
        assert writer.write(9, bytes(size))
        wake.settimeout(0.05)
        with pytest.raises(TimeoutError):
            wake.recv(16)
        end = reader.read(0)[-1].end
        reader.release(end)
        assert reader.gather() is True
        assert reader.gather(False) is True  # back: nothing asked any more
        for i in range(below_half + 2):
            assert writer.write(i % 200, bytes(size))
        with pytest.raises(TimeoutError):
            wake.recv(16)


# ---- 7. reader restart -----------------------------------------------------------------


@pytest.mark.fast
def test_reader_restart_rereads_what_it_did_not_release(rings: Rings, consumer: int) -> None:
    writer = rings.create("drop_newest")
    size = 500
    length = HEADER + align8(size)

    def data(i: int) -> bytes:
        return bytes([i]) * size

    for i in range(10):
        assert writer.write(i, data(i), consumer=consumer, step=i)

    reader = rings.open()
    first = copy_all(reader.read(0))
    assert [r.seq for r in first] == list(range(10))
    reader.release(first[3].end)  # delivered 0..3; 4..9 read but not delivered
    reader.close()

    # The writer goes on while no reader is attached, across the wrap point.
    more = (CAPACITY - (first[-1].end - first[3].end)) // length
    assert first[-1].end + more * length > CAPACITY
    for i in range(10, 10 + more):
        assert writer.write(i, data(i), consumer=consumer, step=i)
    assert not writer.write(99, data(99), consumer=consumer)  # full again

    restarted = rings.open()
    counters = restarted.counters()
    assert counters.tail == first[3].end
    assert counters.head == counters.committed == first[-1].end + more * length
    again = copy_all(restarted.read(counters.tail))
    assert again[:6] == first[4:]  # the same records, bytes, positions and times
    assert [r.seq for r in again] == list(range(4, 10 + more))
    for record in again:
        assert record.site == record.step == record.seq
        check_payload(record, data(record.seq))
    restarted.release(again[-1].end)
    assert writer.counters().tail == again[-1].end  # the writer's mapping sees it
    assert writer.write(11, data(11), consumer=consumer)
    [last] = restarted.read(again[-1].end)
    assert last.seq == 10 + more + 1  # seq 10 + more was the dropped one
    check_payload(last, data(11))


# ---- 8. files that are not rings -------------------------------------------------------


def _valid_ring_bytes(rings: Rings) -> bytes:
    ring = Ring.create(rings.path("template"), CAPACITY, "block")
    ring.close()
    return rings.path("template").read_bytes()


NOT_A_RING = "not a tapd ring"
CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes | None], str]] = {
    "missing": (lambda good: None, "No such file"),
    "empty": (lambda good: b"", NOT_A_RING),
    "shorter than the control page": (lambda good: good[:100], NOT_A_RING),
    "zeros of a ring's size": (lambda good: bytes(len(good)), NOT_A_RING),
    "random bytes of a ring's size": (
        lambda good: random.Random(3).randbytes(len(good)),
        NOT_A_RING,
    ),
    "truncated by a page": (lambda good: good[:-PAGE], NOT_A_RING),
    "extended by a page": (lambda good: good + bytes(PAGE), NOT_A_RING),
    "extended by a byte": (lambda good: good + b"\0", NOT_A_RING),
    "other version": (lambda good: good[:8] + struct.pack("<I", 1) + good[12:], NOT_A_RING),
    "capacity field disagrees with size": (
        lambda good: good[:16] + struct.pack("<Q", 4 * CAPACITY) + good[24:],
        NOT_A_RING,
    ),
    # Size and capacity agree, but the record area cannot be mapped twice.
    "capacity not whole pages": (
        lambda good: good[:16] + struct.pack("<Q", 100) + good[24 : CONTROL_BYTES + 100],
        NOT_A_RING,
    ),
    # Size and capacity agree on an empty record area (every position would divide by 0).
    "capacity zero": (
        lambda good: good[:16] + struct.pack("<Q", 0) + good[24:CONTROL_BYTES],
        NOT_A_RING,
    ),
}


@pytest.mark.fast
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_open_refuses_what_is_not_a_ring(rings: Rings, corruption: str) -> None:
    make, reason = CORRUPTIONS[corruption]
    content = make(_valid_ring_bytes(rings))
    path = rings.path("candidate")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RingError, match=f"cannot open ring .*: .*{reason}"):
        rings.open("candidate")


@pytest.mark.fast
def test_open_accepts_an_untouched_copy(rings: Rings) -> None:
    rings.path("candidate").write_bytes(_valid_ring_bytes(rings))
    assert rings.open("candidate").counters().capacity == CAPACITY


@pytest.mark.fast
def test_create_refuses_an_existing_path_and_leaves_it_alone(rings: Rings, consumer: int) -> None:
    ring = rings.create("drop_newest")
    assert ring.write(5, b"keep me", consumer=consumer)
    ring_bytes = rings.path().read_bytes()
    with pytest.raises(RingError, match="cannot create ring"):
        rings.create("block")
    assert rings.path().read_bytes() == ring_bytes
    [record] = rings.open().read(0)  # still the same ring
    check_payload(record, b"keep me")

    plain = rings.path("plain")
    plain.write_bytes(b"not a ring")
    with pytest.raises(RingError, match="cannot create ring"):
        rings.create(name="plain")
    assert plain.read_bytes() == b"not a ring"


@pytest.mark.fast
def test_create_error_says_why(rings: Rings) -> None:
    rings.path("plain").write_bytes(b"")
    with pytest.raises(RingError) as raised:
        rings.create(name="plain")
    assert "File exists" in str(raised.value)


# ---- 9. the portable backend's one-call write ----------------------------------------


@pytest.mark.fast
def test_write_leaves_writes_one_record_of_padded_leaves(rings: Rings, consumer: int) -> None:
    ring = rings.create("drop_newest")
    leaves = [
        np.arange(5, dtype=np.float32),  # 20 bytes: padded to 24
        np.array(7, dtype=np.int64),
        np.zeros((0, 3), dtype=np.float64),  # an empty leaf takes no room
        np.arange(6, dtype=np.uint8).reshape(2, 3)[:, ::2],  # not contiguous: copied so
    ]
    assert ring.write_leaves(11, leaves, consumer=consumer, device=3, step=-4)
    assert ring.write(12, b"one leaf", consumer=consumer, device=3)  # the same seq counter
    first, second = ring.read(0)
    assert (first.site, first.seq, first.step, first.device) == (11, 0, -4, 3)
    assert (second.site, second.seq, second.step) == (12, 1, None)
    assert first.end - first.start == HEADER + 24 + 8 + 0 + 8
    payload = bytes(first.payload)
    assert payload[:20] == leaves[0].tobytes()
    assert payload[24:32] == leaves[1].tobytes()
    assert payload[32:36] == np.ascontiguousarray(leaves[3]).tobytes()
    header = np.frombuffer(rings.path().read_bytes(), RECORD_HEADER, 1, CONTROL_BYTES)[0]
    assert (header["nleaves"], header["length"], header["flags"]) == (4, first.end, 0)


_NO_RING_SCRIPT = """
import ctypes, json, sys
from pathlib import Path
import numpy as np
from tapd.native import library
from tapd.native.ring import NO_STEP, Ring

lib = library.load()
data = np.arange(3, dtype=np.int32)
pointers = (ctypes.c_void_p * 1)(data.ctypes.data)
sizes = (ctypes.c_uint64 * 1)(data.nbytes)
before = lib.tapd_ring_write_leaves(None, 1, 2, 0, NO_STEP, 1, 1, pointers, sizes)
ring = Ring.create(Path(sys.argv[1]), 8192)
ring.install()
installed = lib.tapd_ring_write_leaves(None, 1, 2, 0, 9, 1, 1, pointers, sizes)
[record] = ring.read(0)
step, payload = record.step, bytes(record.payload[:12]).hex()
ring.close()  # (no longer installed)
after = lib.tapd_ring_write_leaves(None, 1, 2, 0, NO_STEP, 1, 1, pointers, sizes)
print(json.dumps([before, installed, after, step, payload]))
"""


def test_write_leaves_to_the_installed_ring_or_none(tmp_path: Path) -> None:
    """NULL means the process's installed ring; with none installed, 2 (in a fresh
    process: this one may have an emitter's ring installed)."""
    result = subprocess.run(
        [sys.executable, "-c", _NO_RING_SCRIPT, str(tmp_path / "ring")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    before, installed, after, step, payload = json.loads(result.stdout)
    assert (before, installed, after, step) == (2, 0, 2, 9)
    assert payload == np.arange(3, dtype=np.int32).tobytes().hex()


_FFI_SCRIPT = """
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from tapd.native import library
from tapd.native.ring import Ring

ring = Ring.create(Path(sys.argv[1]), 65536)
ring.install()
jax.ffi.register_ffi_target(
    "tapd_ring_test_tap", jax.ffi.pycapsule(library.handler("cpu")), platform="cpu")
leaves = (jnp.arange(5, dtype=jnp.float32), jnp.array([[1, 2], [3, 4]], jnp.int16))

ring.put_entry(b"tapd1:test-site", 5, 77)  # (the ids lowering would have put)

@jax.jit
def tap(a, b, step):
    jax.ffi.ffi_call("tapd_ring_test_tap", (), has_side_effect=True)(
        a, b, step, entry="tapd1:test-site", has_step=np.int64(1),
        every=np.int64(1), ring=np.int64(0))
    return a

tap(*leaves, jnp.int32(-3)).block_until_ready()
ring.write_leaves(5, [np.asarray(x) for x in leaves], consumer=77, device=0, step=-3)
records = ring.read(0)
print(json.dumps([[r.start, r.end, r.site, r.seq, r.step, r.device, bytes(r.payload).hex()]
                  for r in records]))
"""


def test_write_leaves_writes_what_the_ffi_handler_writes(tmp_path: Path) -> None:
    """The same tap through the CPU FFI handler (under jit) and through
    tapd_ring_write_leaves: the same record, but for its time and seq."""
    if not library.has_handler("cpu"):
        pytest.skip(f"no CPU FFI handler here: {library.handler_reason('cpu')}")
    result = subprocess.run(
        [sys.executable, "-c", _FFI_SCRIPT, str(tmp_path / "ring")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    by_ffi, by_call = json.loads(result.stdout)
    assert by_ffi[3:] == [0, -3, 0, by_call[6]]  # seq 0, step, device, the same bytes
    assert by_call[3] == 1  # the next seq of (consumer 77, device 0)
    assert by_ffi[1] - by_ffi[0] == by_call[1] - by_call[0] == HEADER + 24 + 8
    assert by_ffi[1] == by_call[0]


# ---- 10. commits out of reservation order ----------------------------------------------


@pytest.mark.fast
def test_a_record_is_readable_once_it_and_all_before_it_are_committed(
    rings: Rings, consumer: int
) -> None:
    ring = rings.create("drop_newest")
    reader = rings.open()
    positions = []
    for i in range(4):
        position = ring.reserve_for_test(i, bytes([i]) * 10, consumer=consumer, step=i)
        assert position is not None
        positions.append(position)
    ends = [*positions[1:], ring.counters().head]

    def readable() -> list[int]:
        return [r.site for r in reader.read(0)]

    ring.commit_for_test(positions[2])
    ring.commit_for_test(positions[3])
    assert readable() == []
    assert reader.counters().committed == 0
    ring.commit_for_test(positions[0])  # the first: it alone is readable
    assert readable() == [0]
    assert ring.counters().committed == ends[0]
    ring.commit_for_test(positions[1])  # fills the gap: 2 and 3 were waiting on it
    assert readable() == [0, 1, 2, 3]
    counters = reader.counters()
    assert (counters.committed, counters.taps, counters.abandoned) == (ends[3], 4, 0)
    assert [r.seq for r in reader.read(0)] == [0, 1, 2, 3]  # seq is the reservation's


@pytest.mark.fast
def test_an_abandoned_record_is_skipped_counted_and_its_space_reused(
    rings: Rings, consumer: int
) -> None:
    """Writers that give up records (a failed device copy): readers step over them,
    `abandoned` counts them, and their space comes back as the ring wraps. Never does
    `committed` stop on an abandoned record: a reader that has read to `committed`
    has just read a record."""
    ring = rings.create("drop_newest")
    rng = random.Random(8)
    position = 0
    kept: list[int] = []
    received: list[int] = []
    abandoned = 0
    sizes: dict[int, int] = {}
    for n in range(600):
        size = sizes[n] = rng.randrange(0, 600)
        while ring.counters().head + HEADER + align8(size) - ring.counters().tail > CAPACITY:
            records = ring.read(position)
            assert records, f"nothing readable in a full ring: {ring.counters()}"
            received += [r.site for r in records]
            for record in records:
                check_payload(record, bytes([record.site % 251]) * sizes[record.site])
            position = records[-1].end
            assert position == ring.counters().committed
            ring.release(position)
        at = ring.reserve_for_test(n, bytes([n % 251]) * size, consumer=consumer)
        assert at is not None
        if rng.random() < 0.3:
            ring.abandon_for_test(at)
            abandoned += 1
        else:
            ring.commit_for_test(at)
            kept.append(n)
    ring.write(10**6, b"last", consumer=consumer)  # so that no abandoned record trails
    kept.append(10**6)
    while True:
        records = ring.read(position)
        if not records:
            break
        received += [r.site for r in records]
        position = records[-1].end
        ring.release(position)
    assert received == kept
    counters = ring.counters()
    assert (counters.abandoned, counters.taps, counters.dropped) == (abandoned, len(kept), 0)
    assert counters.head == counters.committed == counters.tail == position
    assert counters.head > 10 * CAPACITY


STREAMS = 4
PER_STREAM = 1500


@pytest.mark.fast
def test_streams_committing_out_of_order_deliver_each_record_once_in_ring_order(
    rings: Rings, consumer: int
) -> None:
    """As several CUDA streams would: for each stream, one thread reserves records (the
    host thread that runs the handler) and another commits them, in that stream's
    order but whenever it gets there (the driver's host-function thread), so records
    commit out of ring order across streams. The reader sees every record exactly once,
    in ring order, whole. (Under `block`, a full ring holds back the reserving threads
    only: the committing ones go on, as a stream does.)"""
    ring = rings.create("block", capacity=8 * PAGE)
    start = threading.Barrier(2 * STREAMS + 1)
    done = object()

    def payload(tid: int, i: int) -> bytes:
        return producer_payload(tid, i)[: 8 + (i * 13) % 300]

    def reserve(tid: int, commits: queue.SimpleQueue[Any]) -> None:
        start.wait(timeout=JOIN_TIMEOUT)
        for i in range(PER_STREAM):
            at = ring.reserve_for_test(1000 + tid, payload(tid, i), consumer=consumer,
                                       device=tid, step=i)  # fmt: skip
            assert at is not None
            commits.put(at)
        commits.put(done)

    def commit(tid: int, commits: queue.SimpleQueue[Any]) -> int:
        rng = random.Random(tid)
        start.wait(timeout=JOIN_TIMEOUT)
        count = 0
        while (at := commits.get(timeout=JOIN_TIMEOUT)) is not done:
            if rng.random() < 0.05:
                time.sleep(0.0005)  # pacing only: lets other streams' commits overtake
            ring.commit_for_test(at)
            count += 1
        return count

    threads = []
    for tid in range(STREAMS):
        commits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threads.append(Worker(functools.partial(reserve, tid, commits)))
        threads.append(Worker(functools.partial(commit, tid, commits)))
    reader = Drainer(ring, expected=STREAMS * PER_STREAM)
    reader.start()
    try:
        for thread in threads:
            thread.start()
        start.wait(timeout=JOIN_TIMEOUT)
        join_writers(ring, threads)
    except BaseException:
        reader.abandon()
        raise
    records = reader.finish()  # asserts contiguity: each record starts where one ended

    assert [t.result for t in threads[1::2]] == [PER_STREAM] * STREAMS
    per_stream: dict[int, list[int]] = {tid: [] for tid in range(STREAMS)}
    for record in records:
        tid, i = struct.unpack_from("<II", record.payload)
        check_payload(record, payload(tid, i))
        assert (record.device, record.site, record.step, record.seq) == (tid, 1000 + tid, i, i)
        per_stream[tid].append(i)
    assert per_stream == {tid: list(range(PER_STREAM)) for tid in range(STREAMS)}
    counters = ring.counters()
    assert (counters.taps, counters.dropped, counters.abandoned) == (len(records), 0, 0)
    assert counters.head == counters.committed == counters.tail == records[-1].end
    assert counters.head > 20 * 8 * PAGE


@pytest.mark.fast
def test_a_sleeping_reader_is_woken_when_an_out_of_order_commit_completes(
    rings: Rings,
) -> None:
    """The reader sleeps on a ring whose first record is reserved, the second
    committed; the commit of the first makes both readable and must wake it."""
    writer = rings.create("block")
    reader = rings.open()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as wake:
        wake.bind(str(rings.path("wake.sock")))
        first = writer.reserve_for_test(1, b"first")
        second = writer.reserve_for_test(2, b"second")
        assert first is not None and second is not None
        writer.commit_for_test(second)
        assert reader.read(0) == []
        assert reader.sleep(0) is True  # nothing readable: asleep
        writer.commit_for_test(first)
        wake.settimeout(10)
        assert wake.recv(16) == b"\x01"
        assert [r.site for r in reader.read(0)] == [1, 2]


# ---- 11. a writer that dies between reserving and committing --------------------------

_DYING_WRITER = """
import json, sys
from pathlib import Path
from tapd.native.ring import Ring

ring = Ring.create(Path(sys.argv[1]), 4 * 4096, "drop_newest")
def payload(i):
    return bytes([i]) * (10 + 8 * i)
out = {"committed": [], "reserved": []}
for i in range(int(sys.argv[2])):
    kind = sys.argv[3][i]
    if kind == "c":  # committed
        assert ring.write(i, payload(i), step=i)
        out["committed"].append(i)
    elif kind == "r":  # reserved, filled, never committed
        assert ring.reserve_for_test(i, payload(i), step=i) is not None
        out["reserved"].append(i)
    elif kind == "b":  # reserved, not even a header written
        assert ring.reserve_bare_for_test(200) is not None
        out["reserved"].append(i)
print(json.dumps(out), flush=True)
sys.stdin.readline()  # until the test says: die, with no cleanup at all
import os
os._exit(0)
"""


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param("crcrcc", id="reserved-between-committed"),
        pytest.param("ccbcrc", id="no-header-between-committed"),
        pytest.param("cccrr", id="reserved-at-the-end"),
        pytest.param("rbc", id="nothing-committed-before"),
    ],
)
def test_records_of_a_dead_writer_are_skipped_counted_and_the_rest_delivered(
    rings: Rings, pattern: str
) -> None:
    """A record reserved but never committed holds back every record after it while its
    writer lives (it may be copying still), and is skipped, counted in `abandoned`,
    once the writer is gone (nobody holds the ring's writer lock any more)."""
    path = rings.path()
    with subprocess.Popen(
        [sys.executable, "-c", _DYING_WRITER, str(path), str(len(pattern)), pattern],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as process:  # fmt: skip
        try:
            assert process.stdout is not None and process.stdin is not None
            written = json.loads(process.stdout.readline())
            reader = rings.open()
            first_unfinished = min(pattern.find(k) for k in "rb" if k in pattern)
            alive = [r.site for r in reader.read(0)]
            assert alive == list(range(first_unfinished))  # held back while the writer lives
            assert reader.counters().abandoned == 0
            process.stdin.write("die\n")
            process.stdin.flush()
            assert process.wait(timeout=JOIN_TIMEOUT) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()

    records = reader.read(0)
    assert [r.site for r in records] == written["committed"]
    for record in records:
        assert record.step == record.site
        check_payload(record, bytes([record.site]) * (10 + 8 * record.site))
    counters = reader.counters()
    assert counters.abandoned == len(written["reserved"])
    assert counters.taps == len(written["committed"])
    end = records[-1].end if records else 0
    assert counters.committed == end  # never onto a trailing abandoned record
    reader.release(end)
    trailing = len(pattern) - 1 - pattern.rindex("c")  # unfinished records after the last
    assert (counters.head > end) == (trailing > 0)


# ---- 12. the libraries: what builds where, and nothing raises --------------------------


def test_the_ring_builds_and_runs_with_a_compiler_alone(tmp_path: Path) -> None:
    """Without jaxlib's headers the ring library still builds (no FFI handler in it)
    and works."""
    built = build.compile_ring(tmp_path / "libring.so", None)
    script = """
import ctypes, sys
from pathlib import Path
from tapd.native import library
lib = library._bind(ctypes.CDLL(sys.argv[1]))
assert not hasattr(lib, "TapdTap")
ring = lib.tapd_ring_create(sys.argv[2].encode(), 4096, 0)
assert ring
assert lib.tapd_ring_write(ring, 1, 2, 3, 4, b"payload", 7) == 0
out = (ctypes.c_uint64 * 10)()
lib.tapd_ring_counters(ring, out)
print(out[3], out[1])
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(built), str(tmp_path / "ring")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", str(HEADER + 8)]


_BROKEN_INSTALL = """
import json, os, sys
from pathlib import Path
from tapd.native import build, library
from tapd.protocol import ring_format
library._packaged = lambda stem="_tapd_native": None  # as if the install built nothing
if sys.argv[1] == "no-sources":
    build.SOURCE_DIR = Path(sys.argv[2])  # as if the wheel lacked them
lib = library.load()
print(json.dumps({
    "loaded": lib is not None,
    "reason": library.unavailable_reason(),
    "cpu": library.has_handler("cpu"),
    "cpu_reason": library.handler_reason("cpu"),
    "cuda_reason": library.handler_reason("cuda"),
    "status": library.status(),
}))
"""


@pytest.mark.parametrize("broken", ["no-compiler", "no-sources"])
def test_a_library_that_cannot_be_had_is_a_reason_never_an_exception(
    tmp_path: Path, broken: str
) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    if broken == "no-compiler":
        env["CXX"] = "/nonexistent/c++"
    result = subprocess.run(
        [sys.executable, "-c", _BROKEN_INSTALL, broken, str(tmp_path / "empty")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    found = json.loads(result.stdout)
    assert found["loaded"] is False and found["cpu"] is False
    assert found["reason"], found
    assert ("compiler" if broken == "no-compiler" else "sources") in found["reason"]
    assert found["reason"] in found["cpu_reason"] and found["reason"] in found["cuda_reason"]
    assert found["status"]["ring library"].startswith("unavailable: ")


@pytest.mark.fast
def test_the_cuda_handler_library_builds_and_exports_its_handler() -> None:
    """Where the CUDA runtime wheels and jaxlib's headers are (scripts/setup installs
    them, so CI compiles and links the handler on every commit), the CUDA handler
    library is built, loads without a GPU, exports its handler, and attaches to the
    ring library."""
    missing = None
    if build.ffi_include_dir() is None:
        missing = "jaxlib's XLA FFI headers are not installed"
    elif build.cuda_runtime() is None:
        missing = build.cuda_missing()
    if missing is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the CUDA handler (scripts/setup), but {missing}")
        pytest.skip(missing)
    assert library.has_handler("cuda"), library.handler_reason("cuda")
    assert library.handler_reason("cuda") is None
    function = library.handler("cuda")
    assert function.__name__ == "TapdTapCuda"
    assert library.status()["CUDA handler"] == "built"


def _toolkit_with(major: int) -> Path | None:
    """A CUDA toolkit on this machine whose runtime is libcudart.so.<major>, or None."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and any((Path(root) / d / f"libcudart.so.{major}").is_file()
                        for d in ("lib", "lib64")):  # fmt: skip
            return Path(root)
    return None


@pytest.mark.fast
def test_the_cuda_runtime_found_is_the_major_of_jaxs_plugin_or_the_one_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layouts as pip's wheels lay them out (CUDA 12: nvidia/cuda_runtime with crt/ in
    nvidia/cuda_nvcc; CUDA 13: nvidia/cu13), made on disk: JAX's plugin decides the
    major, TAPD_CUDA_RUNTIME_DIR wins over everything, a CUDA 12 runtime without crt/
    is not a runtime."""
    site = tmp_path / "site"
    for lib, include in (("cuda_runtime/lib", "cuda_runtime/include"),
                         ("cu13/lib", "cu13/include")):  # fmt: skip
        major = "13" if lib.startswith("cu13") else "12"
        (site / "nvidia" / lib).mkdir(parents=True)
        (site / "nvidia" / lib / f"libcudart.so.{major}").write_bytes(b"")
        (site / "nvidia" / include).mkdir(parents=True, exist_ok=True)
        (site / "nvidia" / include / "cuda_runtime_api.h").write_text(
            f"#define CUDART_VERSION {major}000\n"
        )
    for crt in ("cu13/include/crt", "cuda_nvcc/include/crt"):
        (site / "nvidia" / crt).mkdir(parents=True)
        (site / "nvidia" / crt / "host_defines.h").write_text("")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("TAPD_CUDA_RUNTIME_DIR", raising=False)
    for major in (12, 13):  # no plugin stands in: the test says which major JAX has
        monkeypatch.setattr(build, "_plugin_major", lambda major=major: major)
        found = build.cuda_runtime()
        assert found is not None and found.soname == f"libcudart.so.{major}", found
        # (this environment's own wheels may be found before the ones made here)
        wheel_dir = "cu13" if major == 13 else "cuda_runtime"
        assert found.lib_dir.parent.name == wheel_dir, found
        assert (found.includes[-1] / "crt" / "host_defines.h").is_file()
    monkeypatch.setenv("TAPD_CUDA_RUNTIME_DIR", str(site / "nvidia" / "cu13"))
    monkeypatch.setattr(build, "_plugin_major", lambda: 12)
    found = build.cuda_runtime()
    assert found is not None and found.soname == "libcudart.so.13", found
    monkeypatch.setenv("TAPD_CUDA_RUNTIME_DIR", str(site / "nvidia" / "cuda_runtime"))
    assert build.cuda_runtime() is None  # no crt/ anywhere it may look


def test_the_cuda_handler_compiles_against_a_cuda_13_toolkit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JAX's CUDA 13 plugin: the handler builds against CUDA 13's runtime too and
    links libcudart.so.13 (the local toolkit's headers and library, compiled for real)."""
    toolkit = _toolkit_with(13)
    include = build.ffi_include_dir()
    if toolkit is None or include is None:
        pytest.skip("needs a CUDA 13 toolkit (CUDA_HOME or /usr/local/cuda) and jaxlib")
    monkeypatch.setenv("TAPD_CUDA_RUNTIME_DIR", str(toolkit))
    cuda = build.cuda_runtime()
    assert cuda is not None and cuda.soname == "libcudart.so.13"
    output = build.compile_cuda(tmp_path / "libtapd_cuda13.so", include, cuda)
    needed = subprocess.run(["readelf", "-d", str(output)], capture_output=True, text=True)
    assert "[libcudart.so.13]" in needed.stdout, needed.stdout


@pytest.mark.fast
def test_a_record_held_reserved_by_a_live_writer_is_logged_not_skipped(
    rings: Rings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(ring_module, "STALL_WARNING_S", 0.0)
    writer = rings.create("drop_newest")
    reader = rings.open()
    held = writer.reserve_for_test(1, b"held")
    assert held is not None and writer.write(2, b"after")
    with caplog.at_level(logging.WARNING, logger="tapd.native"):
        for _ in range(3):
            assert reader.read(0) == []
    warnings = [r.getMessage() for r in caplog.records if "not committed" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per stall
    assert reader.counters().abandoned == 0  # the writer lives: nothing skipped
    writer.commit_for_test(held)
    assert [r.site for r in reader.read(0)] == [1, 2]


@pytest.mark.fast
def test_runs_of_a_read_end_where_the_site_or_the_record_length_changes() -> None:
    """The daemon cuts a read into runs of one site and one record length, from the
    read's columns at once (numpy): the cuts are where a Python loop would put them."""
    from tapd.daemon import ring_source
    from tapd.native.record_columns import RecordColumns
    from tapd.native.ring import Records

    rng = random.Random(7)
    for count in (1, 2, 3, 5, 23, 24, 40):
        records = Records(memoryview(b""), 0, 0)
        position = 0
        for _ in range(count):
            length = rng.choice((64, 64, 64, 128))
            records.append(position, position + length, rng.choice((1, 1, 1, 2)), 0, None, 0, 0)
            position += length
        cuts = ring_source._run_ends(RecordColumns.of_records(records))
        expected = [
            i
            for i in range(1, count)
            if (records.sites[i], records.ends[i] - records.starts[i])
            != (records.sites[i - 1], records.ends[i - 1] - records.starts[i - 1])
        ] + [count]
        assert cuts == expected, (count, cuts)
