"""A ring emitter is told only of taps whose ring space went back (issue 18, part 5).

What a daemon finished but did not give back to the ring, a daemon started after it
reads again and counts; so the first may not count it in the totals it tells the
emitter, or, after a restart, that tap is in both daemons' totals. In-process Router
(tests/conftest.py), with the ring played by the test.
"""

from __future__ import annotations

import numpy as np

from conftest import InProcessRouter, MakeRouter
from tapd.protocol import decode, encode

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


class Ring:
    """What rings.py does for the router: hold units by index, give back those below
    the router's `safe_low`, and say so."""

    def __init__(self, box: InProcessRouter, key: str) -> None:
        self.box, self.key = box, key
        self.held: list[int] = []
        self.stuck = False  # a ring that cannot give back (the daemon is being killed)
        box.router.watch_ring(key, self.give_back)

    def give_back(self) -> None:
        if self.stuck:
            return
        low = self.box.router.safe_low(self.key)
        assert low is not None
        self.held = [index for index in self.held if index >= low]
        self.box.router.released(self.key, self.held[0] if self.held else None)

    def tap(self, seq: int) -> None:
        message = decode(encode("tap", {**FIELDS, "seq": seq}, [np.zeros(1, np.int8)]))
        self.held.append(self.box.router.tap(self.key, message, credit=False))


def told(box: InProcessRouter) -> tuple[int, int, int]:
    """The last totals the emitter "em" was told (credit or barrier_done)."""
    last = [m.header for m in box.to("em") if m.kind in ("credit", "barrier_done")]
    with_totals = [h for h in last if "delivered" in h]
    if not with_totals:
        return (0, 0, 0)
    h = with_totals[-1]
    return (h["delivered"], h["dropped"], h["unrouted"])


def ring_emitter(make: MakeRouter) -> tuple[InProcessRouter, Ring]:
    """A subscriber "sub" of "x" and an emitter "em" whose taps come from a ring."""
    box = make()
    box.subscribe("sub", ["x"], window=1)
    box.emitter("em")
    return box, Ring(box, "em")


def test_only_taps_given_back_to_the_ring_are_counted_to_the_emitter(
    in_process_router: MakeRouter,
) -> None:
    box, ring = ring_emitter(in_process_router)
    for seq in range(3):
        ring.tap(seq)
    assert box.handle_all() == [0, 1, 2]
    box.router.flush_credit(final=True)
    assert told(box) == (3, 0, 0) and not ring.held

    # Handled but still in the ring (the daemon is stopping): not told, not given back.
    ring.stuck = True
    for seq in range(3, 5):
        ring.tap(seq)
    assert box.handle_all() == [3, 4]
    box.router.flush_credit(final=True)
    assert box.router.emitters["em"].delivered == 5  # (the daemon's own count: all)
    assert told(box) == (3, 0, 0) and len(ring.held) == 2
    # Given back later: told then.
    ring.stuck = False
    ring.give_back()
    box.router.flush_credit(final=True)
    assert told(box) == (5, 0, 0)


def test_a_stopping_daemon_tells_nothing_of_what_it_leaves_in_the_ring(
    in_process_router: MakeRouter,
) -> None:
    box, ring = ring_emitter(in_process_router)
    ring.tap(0)
    assert box.handle_all() == [0]
    ring.tap(1)  # in flight when the daemon stops
    box.router.pump()
    box.router.stop_releasing()
    box.router.drop_all_subscribers("was still connected at shutdown")
    box.router.flush_credit(final=True)
    assert box.router.emitters["em"].dropped == 1  # lost here ...
    assert told(box) == (1, 0, 0) and ring.held == [1]  # ... the next daemon reads it again


def test_a_socket_emitter_is_told_everything_finished(in_process_router: MakeRouter) -> None:
    box = in_process_router()
    box.subscribe("sub", ["x"], window=1)
    box.emitter("em")
    message = decode(encode("tap", {**FIELDS, "seq": 0}, [np.zeros(1, np.int8)]))
    box.router.tap("em", message)
    box.handle_all()
    box.router.flush_credit(final=True)
    assert told(box) == (1, 0, 0)
