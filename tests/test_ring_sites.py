"""The ring's site table (ring.h, SiteSlot; docs/PROTOCOL.md, "Dormant and sampled
taps"): what a writer copies, given the daemon's `every` in the slot and the site's own
`every`, and what it counts. Writes through the same C path the FFI handlers and the
portable backend use (WriteLeaves / tapd_ring_write_leaves, tapd_ring_skip)."""

from __future__ import annotations

import ctypes
import itertools
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tapd.native import library
from tapd.native.ring import Ring
from tapd.protocol.ring_format import EVERY_ALL, EVERY_DORMANT, SITE_SLOTS

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

if library.load() is None:
    pytest.skip(f"tapd's native library is unavailable: {library.unavailable_reason()}",
                allow_module_level=True)  # fmt: skip

# Seqs count per (consumer, device) for the whole process: each test its own consumers.
_consumer_ids = itertools.count(0x5173E000)


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Ring]:
    made = Ring.create(tmp_path / "sites.ring", 64 * mmap.PAGESIZE, "drop_newest")
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def consumer() -> int:
    return next(_consumer_ids)


def written_seqs(ring: Ring, site: int) -> list[int]:
    return [r.seq for r in ring.read(0, 100000) if r.site == site]


def test_a_fresh_slot_says_nobody_has_said_and_every_tap_is_copied(
    ring: Ring, consumer: int
) -> None:
    assert ring.site_every(4) == EVERY_ALL
    for i in range(5):
        assert ring.write(4, bytes([i]) * 8, consumer=consumer)
    assert written_seqs(ring, 4) == [0, 1, 2, 3, 4]
    counters = ring.counters()
    assert (counters.skipped, counters.taps, counters.dropped) == (0, 5, 0)
    assert ring.skipped_by_site() == {}


def test_a_dormant_site_copies_nothing_and_counts_each_tap_as_skipped(
    ring: Ring, consumer: int
) -> None:
    ring.set_site_every(9, EVERY_DORMANT)
    assert ring.site_every(9) == EVERY_DORMANT
    head = ring.counters().head
    for _ in range(7):
        assert not ring.write_leaves(9, [np.ones(1000)], consumer=consumer)
    counters = ring.counters()
    assert counters.head == head  # nothing reserved
    assert (counters.skipped, counters.taps, counters.dropped) == (7, 0, 0)
    assert ring.skipped_by_site() == {9: 7}
    # Woken: the seq went on counting while it slept.
    ring.set_site_every(9, 1)
    assert ring.write(9, b"awake!!!", consumer=consumer)
    assert written_seqs(ring, 9) == [7]


def test_the_site_s_own_every_and_the_slot_s_combine(ring: Ring, consumer: int) -> None:
    ring.set_site_every(2, 3)  # the daemon: every 3rd; the site itself: every 2nd
    results = [ring.write_leaves(2, [np.arange(4)], consumer=consumer, every=2) for _ in range(20)]
    assert sum(results) == 4
    assert written_seqs(ring, 2) == [0, 6, 12, 18]
    assert ring.skipped_by_site() == {2: 16}
    assert ring.counters().skipped == 16


def test_an_always_site_ignores_its_slot_but_keeps_its_own_every(ring: Ring, consumer: int) -> None:
    ring.set_site_every(8, EVERY_DORMANT)
    sent = [ring.write_leaves(8, [np.arange(2)], consumer=consumer, always=True) for _ in range(3)]
    assert sent == [True] * 3
    ring.set_site_every(8, 1000)  # a daemon's N is not applied either
    for _ in range(6):
        ring.write_leaves(8, [np.arange(2)], consumer=consumer, always=True, every=2)
    assert written_seqs(ring, 8) == [0, 1, 2, 4, 6, 8]
    assert ring.skipped_by_site() == {8: 3}


def test_sampling_is_per_consumer_and_device_seq(ring: Ring, consumer: int) -> None:
    ring.set_site_every(1, 2)
    for device in (0, 1):
        for _ in range(4):
            ring.write(1, b"01234567", consumer=consumer, device=device)
    records = [(r.device, r.seq) for r in ring.read(0)]
    assert records == [(0, 0), (0, 2), (1, 0), (1, 2)]


def test_sites_without_a_slot_are_always_sent(ring: Ring, consumer: int) -> None:
    ring.set_site_every(SITE_SLOTS, EVERY_DORMANT)  # no slot: ignored
    assert ring.site_every(SITE_SLOTS) == EVERY_ALL
    ring.set_site_every(SITE_SLOTS - 1, EVERY_DORMANT)  # the last slot is one
    assert ring.write(SITE_SLOTS, b"sent....", consumer=consumer)
    assert ring.write(SITE_SLOTS + 1000, b"sent....", consumer=consumer)
    assert not ring.write(SITE_SLOTS - 1, b"skipped.", consumer=consumer)
    assert ring.skipped_by_site() == {SITE_SLOTS - 1: 1}
    with pytest.raises(ValueError, match="every=-1"):
        ring.set_site_every(0, -1)


def test_a_site_without_a_slot_still_samples_by_its_own_every(ring: Ring, consumer: int) -> None:
    """No slot means no dormancy, not no sampling: tap(every=3) copies seqs 0, 3 and the
    others are counted skipped (in the ring's total; there is no slot to count them in)."""
    site = SITE_SLOTS + 7
    written = [ring.write_leaves(site, [np.zeros(2)], consumer=consumer, every=3) for _ in range(6)]
    assert written == [True, False, False, True, False, False]
    assert written_seqs(ring, site) == [0, 3]
    assert ring.counters().skipped == 4 and ring.skipped_by_site() == {}


def test_the_portable_precheck_takes_the_seq_only_when_it_skips(ring: Ring, consumer: int) -> None:
    """tapd_ring_skip: 1 (seq used, skip counted) or 0 (nothing taken: the write that
    follows takes the seq and decides again)."""
    lib = library.load()
    assert lib is not None
    skip = lib.tapd_ring_skip
    ring.set_site_every(6, 4)
    data = np.arange(3, dtype=np.int32)
    pointers = (ctypes.c_void_p * 1)(data.ctypes.data)
    sizes = (ctypes.c_uint64 * 1)(data.nbytes)
    outcomes = []
    for _ in range(8):
        if skip(ring.handle, 6, consumer, 0, 1):
            outcomes.append("skip")
        else:
            status = lib.tapd_ring_write_leaves(
                ring.handle, 6, consumer, 0, 0, 1, 1, pointers, sizes
            )
            outcomes.append(f"write {status}")
    assert outcomes == ["write 0", "skip", "skip", "skip"] * 2
    assert written_seqs(ring, 6) == [0, 4]
    assert ring.skipped_by_site() == {6: 6} and ring.counters().skipped == 6
    # The write decides on its own too: a skipped one returns 3.
    ring.set_site_every(6, EVERY_DORMANT)
    assert lib.tapd_ring_write_leaves(ring.handle, 6, consumer, 0, 0, 1, 1, pointers, sizes) == 3
    assert skip(None, 6, consumer, 0, 1) == 0  # no ring installed: never skips
