"""The native shared-memory ring (tapd/native/tapd_native.cc) through its ctypes wrapper
(tapd/native/ring.py): wrap-around, records as large as the ring (double mapping), the
drop_newest and block policies, concurrent producers, a reader that restarts, and files
that are not rings. Every ring lives in the test's own tmp_path and is closed by the
`rings` fixture; no assertion depends on timing."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import mmap
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tapd.native import library
from tapd.native.ring import RECORD_HEADER, Record, Ring, RingError

if library.load() is None:
    pytest.skip(
        "tapd's native library is unavailable "
        f"({library.unavailable_reason()}); it needs a C++17 compiler and jaxlib's XLA FFI "
        "headers (pip install . builds it, or tapd.native.library.build())",
        allow_module_level=True,
    )

PAGE = mmap.PAGESIZE
CAPACITY = 2 * PAGE  # small, so that a few records wrap it
HEADER = RECORD_HEADER.itemsize
CONTROL_BYTES = 4096  # the ring file starts with one control page of this size
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


def test_drop_newest_drops_exactly_what_does_not_fit(rings: Rings, consumer: int) -> None:
    ring = rings.create("drop_newest")
    size = 1000
    length = HEADER + align8(size)
    fit = CAPACITY // length
    assert fit * length + HEADER + 800 <= CAPACITY < (fit + 1) * length

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
    assert write(fit + 3, 800)
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
        check_payload(record, bytes([record.seq]) * (800 if record.seq == fit + 3 else size))
    counters = ring.counters()
    assert (counters.taps, counters.dropped) == (fit + 2, 5)
    assert counters.head - counters.tail <= CAPACITY
    # Another device's sequence is its own: the drops above do not show in it.
    ring.release(records[-1].end)
    assert ring.write(1, b"x", consumer=consumer, device=1)
    [other] = ring.read(records[-1].end)
    assert (other.device, other.seq) == (1, 0)


# ---- 5. block: the writer waits for the reader -----------------------------------------


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


def test_threads_tapping_one_consumer_on_one_device_land_in_sequence_order(
    rings: Rings, consumer: int
) -> None:
    """Sequence number and ring position are taken together: whichever thread wins,
    the ring holds seq 0, 1, 2, ... in order for a (consumer, device)."""
    ring = rings.create("block")
    records, _ = run_producers(ring, consumer, per_thread=PER_THREAD // 4, one_device=True)
    assert [r.seq for r in records] == list(range(THREADS * (PER_THREAD // 4)))


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


# ---- 7. reader restart -----------------------------------------------------------------


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
        "",
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_open_refuses_what_is_not_a_ring(rings: Rings, corruption: str) -> None:
    make, reason = CORRUPTIONS[corruption]
    content = make(_valid_ring_bytes(rings))
    path = rings.path("candidate")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(RingError, match=f"cannot open ring .*: .*{reason}"):
        rings.open("candidate")


def test_open_accepts_an_untouched_copy(rings: Rings) -> None:
    rings.path("candidate").write_bytes(_valid_ring_bytes(rings))
    assert rings.open("candidate").counters().capacity == CAPACITY


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


def test_create_error_says_why(rings: Rings) -> None:
    rings.path("plain").write_bytes(b"")
    with pytest.raises(RingError) as raised:
        rings.create(name="plain")
    assert "File exists" in str(raised.value)
