"""A ring emitter is told only of taps whose ring space went back (issue 18, part 5).

What a daemon finished but did not give back to the ring, a daemon started after it
reads again and counts; so the first may not count it in the totals it tells the
emitter, or, after a restart, that tap is in both daemons' totals. An in-process Router
(tests/conftest.py) drains a real ring (tapd/daemon/ring_source.py over
tapd/native/ring.py) that the test writes as an emitter does: records, and their site in
the sites file beside the ring.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import InProcessRouter, MakeRouter, native_unavailable
from tapd.daemon.ring_source import RingSource
from tapd.native.ring import Ring
from tapd.native.sites import encode_entry
from tapd.protocol import decode, encode

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

FIELDS = {
    "consumer": "x",
    "step": None,
    "device": None,
    "process": 0,
    "host": "h",
    "pid": 1,
    "time": 0,
    "transforms": [],
    "meta": {},
    "tree": ["*"],
}
SITE = {"site": 0, "consumer": "x", "consumer_id": 0, "tree": ["*"], "meta": {},
        "transforms": [], "leaves": [["float32", [2], 8]]}  # fmt: skip
RECORD = np.zeros(2, np.float32).tobytes()


def told(box: InProcessRouter) -> tuple[int, int, int]:
    """The last totals the emitter "em" was told (credit or barrier_done)."""
    last = [m.header for m in box.to("em") if m.kind in ("credit", "barrier_done")]
    with_totals = [h for h in last if "delivered" in h]
    if not with_totals:
        return (0, 0, 0)
    h = with_totals[-1]
    return (h["delivered"], h["dropped"], h["unrouted"])


def unreleased(writer: Ring) -> int:
    """Records in the ring not given back to the writer."""
    counters = writer.counters()
    return (counters.committed - counters.tail) // (writer.header_bytes + len(RECORD))


class RingEmitter:
    """An emitter "em" whose taps come from a ring the test writes (`writer`), drained
    by the daemon's `RingSource` (`source`), and a subscriber "sub" of its consumer."""

    def __init__(self, box: InProcessRouter, directory: Path) -> None:
        self.box = box
        stem = directory / f"{os.getpid()}-0a0b0c0d"
        self.ring_path, self.sites_path = stem.with_suffix(".ring"), stem.with_suffix(".sites")
        self.sites_path.write_bytes(encode_entry(SITE))
        self.writer = Ring.create(self.ring_path, 1 << 16)
        box.subscribe("sub", ["x"], window=1)
        box.emitter("em")
        self.source = self.drained_by(box)

    def drained_by(self, box: InProcessRouter) -> RingSource:
        """A daemon's RingSource of this ring, given back to as `box`'s router finishes."""
        source = RingSource("em", self.ring_path, self.sites_path, {"host": "h", "process": 0})
        source.watched_by(box.router, "em")
        return source

    def tap(self, count: int = 1) -> None:
        """The emitter writes `count` taps; the daemon reads them into its router."""
        for _ in range(count):
            assert self.writer.write(0, RECORD)
        assert self.source.drain(self.box.router) == count

    def close(self) -> None:
        self.source.close(remove=False)
        self.writer.close()


@pytest.fixture
def ring_emitter(
    in_process_router: MakeRouter, tmp_path: Path
) -> Iterator[Callable[[], RingEmitter]]:
    if reason := native_unavailable():
        pytest.skip(reason)
    made: list[RingEmitter] = []

    def make() -> RingEmitter:
        made.append(RingEmitter(in_process_router(), tmp_path))
        return made[-1]

    yield make
    for emitter in made:
        emitter.close()


def test_only_taps_given_back_to_the_ring_are_counted_to_the_emitter(
    ring_emitter: Callable[[], RingEmitter],
) -> None:
    em = ring_emitter()
    box = em.box
    em.tap(3)
    assert box.handle_all() == [0, 1, 2]
    box.router.flush_credit(final=True)
    assert told(box) == (3, 0, 0) and unreleased(em.writer) == 0

    # Handled but still in the ring (the daemon is stopping): not told, not given back.
    box.router.stop_releasing()
    em.tap(2)
    assert box.handle_all() == [3, 4]
    box.router.flush_credit(final=True)
    assert box.router.emitters["em"].delivered == 5  # (the daemon's own count: all)
    assert told(box) == (3, 0, 0) and unreleased(em.writer) == 2
    # Given back later (as a ring poll does): told then.
    em.source.release_delivered(box.router)
    box.router.flush_credit(final=True)
    assert told(box) == (5, 0, 0) and unreleased(em.writer) == 0


def test_a_stopping_daemon_tells_nothing_of_what_it_leaves_in_the_ring(
    ring_emitter: Callable[[], RingEmitter], in_process_router: MakeRouter
) -> None:
    em = ring_emitter()
    box = em.box
    em.tap()
    assert box.handle_all() == [0]
    em.tap()  # in flight when the daemon stops
    box.router.subscribers.pump()
    box.router.stop_releasing()
    box.router.subscribers.drop_all("was still connected at shutdown")
    box.router.flush_credit(final=True)
    assert box.router.emitters["em"].dropped == 1  # lost here ...
    assert told(box) == (1, 0, 0) and unreleased(em.writer) == 1
    em.source.close(remove=False)

    # ... the next daemon reads it again, delivers it and counts it.
    after = in_process_router()
    after.subscribe("sub", ["x"], window=1)
    after.emitter("em")
    em.box, em.source = after, em.drained_by(after)
    assert em.source.drain(after.router) == 1
    assert after.handle_all() == [1]
    after.router.flush_credit(final=True)
    assert told(after) == (1, 0, 0) and unreleased(em.writer) == 0


def test_a_socket_emitter_is_told_everything_finished(in_process_router: MakeRouter) -> None:
    box = in_process_router()
    box.subscribe("sub", ["x"], window=1)
    box.emitter("em")
    message = decode(encode("tap", {**FIELDS, "seq": 0}, [np.zeros(1, np.int8)]))
    box.router.tap("em", message)
    box.handle_all()
    box.router.flush_credit(final=True)
    assert told(box) == (1, 0, 0)
