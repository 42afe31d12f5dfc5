"""The gathered path's bulk write (issue 63): a gathered log's records written into the
ring in runs (`tapd_ring_write_gathered_runs`: seqs and room taken for many records
at once, one commit), as tapd/emitter/gathered/host.py writes every log.

The reference is the writer it replaced, `tapd_ring_write_gathered`, which writes each
record as the tap's own host callback would (WriteLeaves: the seq lock, TakeTap, a
reservation, a commit, one record at a time). The same packed log, written by each into
a ring of its own, must leave the same records (site, seq, step, device, bytes) in the
same order and the same counts (taps, dropped, skipped, each site's skipped, the next
seq of each consumer); and the records' bytes must be the values put in the log (the
eager values). Then what only a bulk write can get wrong: a ring too small for the log
under `drop_newest` (what fits is written, the rest dropped and counted, seqs used up)
and `block` (the writer waits for a reader and loses nothing), threads writing one
consumer at once (ring order is seq order), runs longer than a chunk, a bad log (nothing
written). End to end, a JAX loop's thousands of small taps, gathered, reach subscribers
as the per-tap path delivers them."""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import mmap
import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src import core

from conftest import Daemon, SubscriberProcess, run_emitter
from tapd.emitter.gathered import host
from tapd.native import library
from tapd.native.ring import Ring
from tapd.protocol.ring_format import EVERY_ALWAYS_BIT, EVERY_DORMANT

if library.load() is None:
    pytest.skip(
        f"tapd's native library is unavailable: {library.unavailable_reason()}",
        allow_module_level=True,
    )

PAGE = mmap.PAGESIZE
JOIN_TIMEOUT = 60.0  # only bounds a hang (failing the test then); never decides a pass
_consumer_ids = itertools.count(0x60B0000)  # (each test its own consumers)


@dataclasses.dataclass
class Site:
    """A tapped site as `host._Tables` reads a `SiteWriter`: its leaves' avals (and the
    step's dtype, or None), its ids, its own `every` (K, with EVERY_ALWAYS_BIT for
    id_tap's)."""

    leaves: list[tuple[str, tuple[int, ...]]]
    step_dtype: str | None = "int32"
    site_id: int = 1
    consumer_id: int = 0
    every: int = 1
    ring: int | None = None
    ringed: bool = True  # False: the sender's path (no ring), left to the caller

    @property
    def tapped(self) -> list[int]:
        return list(range(len(self.leaves)))

    @property
    def step(self) -> int | None:
        """The step's operand (after the leaves), or None."""
        return len(self.leaves) if self.step_dtype else None

    @property
    def avals(self) -> list[core.ShapedArray]:
        dtypes = [*self.leaves, *([(self.step_dtype, ())] if self.step_dtype else [])]
        return [core.ShapedArray(shape, np.dtype(dtype)) for dtype, shape in dtypes]


@dataclasses.dataclass(frozen=True)
class Written:
    site: int
    seq: int
    step: int | None
    device: int
    payload: bytes


class Log:
    """A packed log made on the host (`host.packed_layout`): `records` in log order, each
    (site index, place: its tap's index among its site's taps since the last flush),
    `skipped`: each site's taps not kept on the device. Row r of site i, leaf j holds
    `value(i, j, r)`, its step the record's place."""

    def __init__(self, sites: list[Site], records: list[tuple[int, int]], skipped: list[int]):
        self.sites, self.records = sites, records
        self.capacity = max(len(records), 1)
        self.layout = host.packed_layout(len(sites), self.capacity, [s.avals for s in sites])
        self.packed = np.zeros(host.packed_size(self.layout), np.uint8)
        self._piece(host.COUNT)[...] = len(records)
        self._piece(host.LOG)[: len(records)] = [i for i, _ in records]
        self._piece(host.ORDER)[: len(records)] = [place for _, place in records]
        self._piece(host.SKIPPED)[:] = skipped
        self.rows: list[list[tuple[int, int]]] = [[] for _ in sites]  # (record, place)
        for r, (i, place) in enumerate(records):
            self.rows[i].append((r, place))
        piece = host.BUFFERS
        for i, site in enumerate(sites):
            for j, (dtype, shape) in enumerate(site.leaves):
                column = self._piece(piece + j)
                for row in range(len(self.rows[i])):
                    column[row] = value(i, j, row, dtype, shape)
            if site.step is not None:
                steps = self._piece(piece + site.step)
                steps[: len(self.rows[i])] = [place for _, place in self.rows[i]]
            piece += len(site.avals)

    def _piece(self, index: int) -> np.ndarray:
        dtype, shape, offset = self.layout[index]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return self.packed[offset : offset + size].view(dtype).reshape(shape)

    def write(self, function: str, rings: Sequence[Ring | None], device: int = 0) -> int:
        """The log written by `function` of the ring library, site i into rings[i]."""
        for site, ring in zip(self.sites, rings, strict=True):
            site.ring = ring.handle if ring is not None and site.ringed else None
        tables = host._Tables(self.sites, self.layout)  # type: ignore[arg-type]
        offsets = [ctypes.c_uint64(piece[2]) for piece in self.layout[: host.BUFFERS]]
        return int(
            getattr(library.load(), function)(
                self.packed.ctypes.data,
                device,
                len(self.sites),
                *tables.arguments,
                *offsets,
                self.capacity,
            )
        )

    def eager(self, i: int, row: int) -> list[bytes]:
        """Record `row` of site i's leaves' bytes as the tap would have copied them."""
        return [
            np.asarray(value(i, j, row, dtype, shape), dtype).tobytes()
            for j, (dtype, shape) in enumerate(self.sites[i].leaves)
        ]


def value(i: int, j: int, row: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    base = np.arange(count) + 1000 * row + 100 * j + 7 * i
    return base.astype(dtype).reshape(shape)


def read_all(ring: Ring) -> list[Written]:
    """Every committed record from the ring's tail on, released as read."""
    out: list[Written] = []
    position = ring.counters().tail
    while records := ring.read(position, 100000):
        for record in records:
            # (padding bytes are unspecified: compared up to the leaves' own length)
            payload = bytes(record.payload)
            out.append(Written(record.site, record.seq, record.step, record.device, payload))
        position = records[-1].end
        ring.release(position)
    return out


def counts(ring: Ring, consumers: Sequence[int], device: int = 0) -> dict[str, Any]:
    c = ring.counters()
    lib = library.load()
    assert lib is not None
    return {
        "taps": c.taps,
        "dropped": c.dropped,
        "skipped": c.skipped,
        "abandoned": c.abandoned,
        "by_site": ring.skipped_by_site(),
        "next_seq": [lib.tapd_ring_next_seq(ring.handle, k, device) for k in consumers],
    }


def leaves_of(payload: bytes, sizes: list[int]) -> list[bytes]:
    """A record's leaves (each padded to 8 in the ring; the padding is unspecified)."""
    out, at = [], 0
    for size in sizes:
        out.append(payload[at : at + size])
        at += size + (-size % 8)
    assert at == len(payload)
    return out


def check_eager(written: list[Written], log: Log, device: int = 0) -> None:
    """Each record's leaves are a row of its site's, rows in the log's order (skipped
    ones aside), and its step that row's place: the values the log holds."""
    index = {site.site_id: i for i, site in enumerate(log.sites)}
    next_row = [0] * len(log.sites)
    for record in written:
        i = index[record.site]
        sizes = [len(leaf) for leaf in log.eager(i, 0)]
        leaves = leaves_of(record.payload, sizes)
        row = next(r for r in range(next_row[i], len(log.rows[i])) if log.eager(i, r) == leaves)
        next_row[i] = row + 1
        place = log.rows[i][row][1]
        assert record.step == (place if log.sites[i].step is not None else None)
        assert record.device == device


Outcome = tuple[list[Written], list[Written], dict[str, Any], dict[str, Any]]


def both(
    tmp_path: Path,
    log: Log,
    capacity: int,
    policy: str = "block",
    every: dict[int, int] | None = None,
) -> Outcome:
    """The log written by the reference and by runs, each into a fresh ring (`every`:
    slots set first); their records and counts."""
    consumers = sorted({site.consumer_id for site in log.sites})
    out = []
    for function in ("tapd_ring_write_gathered", "tapd_ring_write_gathered_runs"):
        ring = Ring.create(tmp_path / f"{function}.ring", capacity, policy)
        try:
            for site, slot in (every or {}).items():
                ring.set_site_every(site, slot)
            assert log.write(function, [ring] * len(log.sites)) == len(log.records)
            out.append((read_all(ring), counts(ring, consumers)))
        finally:
            ring.close()
        (tmp_path / f"{function}.ring").unlink(missing_ok=True)
    (reference, reference_counts), (runs, runs_counts) = out
    return reference, runs, reference_counts, runs_counts


# ---- the same records and counts as the per-record writer ------------------------------


def consumer() -> int:
    return next(_consumer_ids)


def test_one_site_of_5000_small_records_is_the_reference_s_and_the_eager_values(
    tmp_path: Path,
) -> None:
    log = Log(
        [Site([("float32", (16,))], consumer_id=consumer())], [(0, k) for k in range(5000)], [0]
    )
    reference, runs, reference_counts, runs_counts = both(tmp_path, log, 1024 * PAGE)
    assert runs == reference and runs_counts == reference_counts
    assert [(r.seq, r.step) for r in runs] == [(k, k) for k in range(5000)]
    check_eager(runs, log)


def test_runs_longer_than_a_chunk_of_several_sites_and_consumers(tmp_path: Path) -> None:
    """3000 records of 1 KiB and odd-sized ones interleaved (more than one chunk of
    1024 records or 256 KiB), three sites of two consumers, steps of int64 and none."""
    a, b = consumer(), consumer()
    sites = [
        Site([("float32", (256,))], site_id=3, consumer_id=a),
        Site([("int8", (5,)), ("float64", (2, 3))], "int64", site_id=4, consumer_id=a),
        Site([("bool", (3,))], None, site_id=5, consumer_id=b),
    ]
    order = [0] * 3000 + [1] * 700 + [2] * 300
    random.Random(5).shuffle(order)
    places = [0, 0, 0]
    records = []
    for i in order:
        records.append((i, places[i]))
        places[i] += 1
    log = Log(sites, records, [0, 0, 0])
    reference, runs, reference_counts, runs_counts = both(tmp_path, log, 2048 * PAGE)
    assert runs == reference and runs_counts == reference_counts
    assert [r.seq for r in runs if r.site != 5] == list(range(3700))  # (a's, in order)
    assert [r.seq for r in runs if r.site == 5] == list(range(300))
    check_eager(runs, log)


@settings(max_examples=60, deadline=None)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 3)), min_size=0, max_size=60
    ),  # (site, taps skipped on the device before it)
    after=st.lists(st.integers(0, 4), min_size=3, max_size=3),
    slots=st.lists(st.sampled_from([0, 1, 2, 3, EVERY_DORMANT]), min_size=3, max_size=3),
    own=st.lists(
        st.sampled_from([1, 2, 3 | EVERY_ALWAYS_BIT, 1 | EVERY_ALWAYS_BIT]), min_size=3, max_size=3
    ),
    unringed=st.booleans(),
    same_consumer=st.booleans(),
)
def test_any_log_leaves_the_reference_s_records_and_counts(
    tmp_path_factory: pytest.TempPathFactory,
    plan: list[tuple[int, int]],
    after: list[int],
    slots: list[int],
    own: list[int],
    unringed: bool,
    same_consumer: bool,
) -> None:
    """Sites interleaved, taps skipped on the device between records and after the last
    (sampled out, dormant at dispatch), slots that sample or say dormant, sites' own
    every=K and id_tap's always, a site without a ring among them."""
    tmp_path = tmp_path_factory.mktemp("runs")
    first = consumer()
    sites = [
        Site([("float32", (4,))], site_id=10, consumer_id=first, every=own[0]),
        Site(
            [("uint16", (3,))],
            "int64",
            site_id=11,
            consumer_id=first if same_consumer else consumer(),
            every=own[1],
        ),
        Site(
            [("float32", ())],
            None,
            site_id=12,
            consumer_id=consumer(),
            every=own[2],
            ringed=not unringed,
        ),
    ]
    taps = [0, 0, 0]
    records = []
    for i, gap in plan:
        taps[i] += gap
        records.append((i, taps[i]))
        taps[i] += 1
    log = Log(
        sites,
        records,
        [taps[i] - sum(1 for k, _ in records if k == i) + after[i] for i in range(3)],
    )
    every = {site.site_id: slot for site, slot in zip(sites, slots, strict=True)}
    reference, runs, reference_counts, runs_counts = both(tmp_path, log, 64 * PAGE, every=every)
    assert runs == reference
    assert runs_counts == reference_counts
    check_eager(runs, log)


def test_a_bad_log_writes_nothing(tmp_path: Path) -> None:
    """A place before its site's last, or a site index out of range: -1, and the ring
    untouched (the reference writes the records before the bad one)."""
    k = consumer()
    ring = Ring.create(tmp_path / "bad.ring", 64 * PAGE, "block")
    try:
        site = Site([("float32", (2,))], consumer_id=k)
        backwards = Log([site], [(0, 0), (0, 1), (0, 1)], [0])
        assert backwards.write("tapd_ring_write_gathered_runs", [ring]) == -1
        beyond = Log([site], [(0, 0)], [0])
        beyond._piece(host.LOG)[0] = 1
        assert beyond.write("tapd_ring_write_gathered_runs", [ring]) == -1
        assert read_all(ring) == []
        left = counts(ring, [k])
        assert (left["taps"], left["skipped"], left["dropped"], left["next_seq"]) == (0, 0, 0, [0])
    finally:
        ring.close()


# ---- a full ring ---------------------------------------------------------------------------


def test_a_full_ring_under_drop_newest_writes_what_fits_and_counts_the_rest(
    tmp_path: Path,
) -> None:
    """No reader: 200 records of 120 bytes into 8 KiB. What fits is written, in order,
    the rest dropped and counted, their seqs used up (a gap), as the reference does;
    once the space is released the next log goes on from seq 200."""
    k = consumer()
    log = Log([Site([("float32", (16,))], consumer_id=k)], [(0, p) for p in range(200)], [0])
    reference, runs, reference_counts, runs_counts = both(tmp_path, log, 2 * PAGE, "drop_newest")
    fits = 2 * PAGE // 120
    assert runs == reference and runs_counts == reference_counts
    assert [r.seq for r in runs] == list(range(fits))
    assert runs_counts["dropped"] == 200 - fits and runs_counts["next_seq"] == [200]
    check_eager(runs, log)

    ring = Ring.create(tmp_path / "again.ring", 2 * PAGE, "drop_newest")
    try:
        assert log.write("tapd_ring_write_gathered_runs", [ring]) == 200
        read_all(ring)  # (released: room for the next log)
        again = Log(log.sites, [(0, 0), (0, 1)], [3])
        assert again.write("tapd_ring_write_gathered_runs", [ring]) == 2
        assert [(r.seq, r.step) for r in read_all(ring)] == [(200, 0), (201, 1)]
        assert counts(ring, [k])["next_seq"] == [205]
    finally:
        ring.close()


def test_a_full_ring_under_block_waits_for_the_reader_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """3000 records of 1 KiB through a ring of 4 pages, a reader releasing as it reads:
    every record arrives whole, in order, its seq and bytes the eager ones."""
    k = consumer()
    log = Log([Site([("float32", (256,))], consumer_id=k)], [(0, p) for p in range(3000)], [0])
    ring = Ring.create(tmp_path / "block.ring", 4 * PAGE, "block")
    got: list[Written] = []
    writing = threading.Thread(
        target=lambda: log.write("tapd_ring_write_gathered_runs", [ring]), daemon=True
    )
    try:
        writing.start()
        while writing.is_alive() or ring.counters().committed > ring.counters().tail:
            got += read_all(ring)
        writing.join(JOIN_TIMEOUT)
        got += read_all(ring)
        assert [(r.seq, r.step) for r in got] == [(p, p) for p in range(3000)]
        check_eager(got, log)
        assert (ring.counters().dropped, ring.counters().taps) == (0, 3000)
    finally:
        writing.join(JOIN_TIMEOUT)
        ring.close()


def test_threads_writing_one_consumer_at_once_land_in_seq_order(tmp_path: Path) -> None:
    """Two threads writing logs in runs and one writing taps one by one, all of one
    consumer and device: the ring holds each seq once, in seq order."""
    k = consumer()
    log = Log([Site([("float32", (16,))], consumer_id=k)], [(0, p) for p in range(2000)], [0])
    ring = Ring.create(tmp_path / "threads.ring", 4096 * PAGE, "block")

    def runs() -> None:
        for _ in range(5):
            log.write("tapd_ring_write_gathered_runs", [ring])

    def one_by_one() -> None:
        for _ in range(3000):
            ring.write_leaves(1, [np.zeros(16, np.float32)], consumer=k)

    threads = [threading.Thread(target=t, daemon=True) for t in (runs, runs, one_by_one)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_TIMEOUT)
        seqs = [r.seq for r in read_all(ring)]
        assert seqs == list(range(2 * 5 * 2000 + 3000))
    finally:
        ring.close()


# ---- end to end: a JAX loop's small taps, gathered, as the per-tap path delivers them ------


def test_a_loop_s_thousands_of_small_taps_arrive_as_the_per_tap_path_delivers_them(
    start_daemon: Any, start_subscriber: Any
) -> None:
    """emitter_app's `loop_pytree` (3000 steps, two sites of two consumers interleaved:
    a pytree with a bfloat16 leaf, and a scalar) gathered into runs on the portable
    backend, and on the per-tap path: a per-tap and a batch subscriber get the same
    records of each consumer, every seq once and in order."""
    daemon: Daemon = start_daemon()
    per_tap: SubscriberProcess = start_subscriber(daemon, "tree", "loss")
    batched: SubscriberProcess = start_subscriber(daemon, "tree", "loss", batch=True)
    count = 3000
    for gather in ("off", "on"):  # (one after the other: its barrier waits for both)
        env = {"TAPD_GATHER": gather, "TAPD_BACKEND": "portable"}
        result = run_emitter(daemon.endpoint, "loop_pytree", str(count), env=env)
        assert result["stats"]["dropped"] == 0 and result["stats"]["skipped"] == 0
    for subscriber in (per_tap, batched):
        by_emitter: dict[str, list[dict[str, Any]]] = {}
        for row in subscriber.records():
            assert row.pop("time_matches", True)  # (a batch's time column: its metas')
            row.pop("batch_size", None)
            by_emitter.setdefault(row.pop("emitter"), []).append(row)
        reference, gathered = by_emitter.values()  # (in the order they ran)
        for name in ("tree", "loss"):  # (in order per consumer; two consumers interleave)
            rows = [r for r in gathered if r["consumer"] == name]
            assert rows == [r for r in reference if r["consumer"] == name]
            assert [(r["seq"], r["step"]) for r in rows] == [(s, s) for s in range(count)]
