"""The emitter link (tapd/protocol/link.py) on its own: no socket, no clock, messages in
and out as the sender thread and the forwarder exchange them with a daemon."""

from __future__ import annotations

from typing import Any

import pytest

from tapd.protocol import decode
from tapd.protocol.link import (
    Credited,
    EmitterLink,
    Looped,
    Refused,
    RehelloAsked,
    Restarted,
    Welcomed,
)

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

IDENTITY = {"role": "emitter", "host": "h", "pid": 1, "process": 0}


def kinds(link: EmitterLink) -> list[str]:
    return [decode(frames).kind for frames in link.outgoing()]


def welcome(daemon: str = "d1", window: int = 1000, **fields: Any) -> dict[str, Any]:
    return {"kind": "welcome", "daemon": daemon, "window_bytes": window, **fields}


def test_nothing_is_sent_before_the_welcome_and_the_window_bounds_bytes_in_flight() -> None:
    link = EmitterLink(IDENTITY, now=0.0)
    [hello] = link.outgoing()
    assert decode(hello).header == {"kind": "hello", **IDENTITY, "nonce": 1}
    assert not link.may_send(1)
    event = link.received(welcome(window=100), now=0.1)
    assert event == Welcomed("d1", lost_bytes=0, first=True)
    assert link.outgoing() == []
    assert link.may_send(500)  # nothing in flight: one tap fits, however large
    link.sent(60)
    assert link.may_send(40) and not link.may_send(41)
    assert link.received({"kind": "credit", "bytes": 50}, now=0.2) == Credited(50)
    assert link.in_flight == 10 and link.may_send(90)
    link.received({"kind": "credit", "bytes": 999}, now=0.3)  # never below zero
    assert link.in_flight == 0


def test_a_welcome_sets_what_is_in_flight_from_held_bytes_and_counts_what_was_lost() -> None:
    link = EmitterLink(IDENTITY, now=0.0)
    link.outgoing()
    link.received(welcome(), now=0.0)
    link.sent(300)
    link.sent(200)
    # The connection dropped; we said hello again and sent 50 more before the answer.
    link.hello(now=5.0)
    assert kinds(link) == ["hello"]
    link.sent(50)
    # The daemon holds 100 of ours (parked, or credit not yet sent) and got the 50.
    event = link.received(welcome(held_bytes=100), now=5.1)
    assert event == Welcomed("d1", lost_bytes=400, first=False)
    assert (link.in_flight, link.lost_bytes) == (150, 400)
    # A welcome saying the daemon holds more than we think is in flight loses nothing.
    link.hello(now=6.0)
    link.received(welcome(held_bytes=900), now=6.1)
    assert (link.in_flight, link.lost_bytes) == (900, 400)


def test_a_welcome_from_another_daemon_closes_the_window_until_it_answers_a_hello() -> None:
    link = EmitterLink(IDENTITY, now=0.0)
    link.outgoing()
    link.received(welcome("old"), now=0.0)
    link.sent(100)
    # The restarted daemon met one of our taps before any hello and welcomed us.
    event = link.received(welcome("new", held_bytes=40), now=1.0)
    assert event == Restarted(previous="old", daemon="new")
    assert kinds(link) == ["hello"] and not link.may_send(1)
    assert link.received(welcome("new", held_bytes=40), now=1.1) == Welcomed("new", 60, False)
    assert link.may_send(1) and link.in_flight == 40 and link.daemon == "new"


def test_a_malformed_welcome_is_refused_and_changes_nothing() -> None:
    link = EmitterLink(IDENTITY, now=0.0)
    link.outgoing()
    for held in (-1, "12", True, 1.5):
        event = link.received(welcome(held_bytes=held), now=0.1)
        assert isinstance(event, Refused) and event.reason == "bad_field"
        assert (link.daemon, link.window) == (None, 0)


def test_a_forwarder_welcomed_by_itself_keeps_its_window_closed() -> None:
    link = EmitterLink({**IDENTITY, "forwarder": "me"}, now=0.0, self_id="me")
    link.outgoing()
    assert link.received(welcome("me"), now=0.1) == Looped("me")
    assert not link.may_send(1)


def test_rehello_and_other_messages() -> None:
    link = EmitterLink(IDENTITY, now=0.0)
    link.outgoing()
    assert link.received({"kind": "rehello"}, now=3.0) == RehelloAsked()
    assert kinds(link) == ["hello"] and link.last_hello == 3.0
    done = {"kind": "barrier_done", "id": 0, "delivered": 0, "dropped": 0, "unrouted": 0}
    assert link.received(done, now=4.0) is None  # the owner's to handle
    assert link.last_heard == 4.0


def test_the_rehello_timer_fires_only_while_waiting_and_backs_off_while_silent() -> None:
    link = EmitterLink(IDENTITY, now=0.0, rehello_after=2.0, rehello_max=8.0)
    link.outgoing()
    assert not link.tick(100.0, waiting=False)  # nothing outstanding: no need
    link.received(welcome(), now=100.0)
    link.sent(10)  # bytes in flight count as waiting
    assert not link.tick(102.0, waiting=False)
    assert link.tick(102.1, waiting=False) and kinds(link) == ["hello"]
    # Still silent: 4 s, then 8 s, then 8 s again.
    assert not link.tick(106.0, waiting=True)
    assert link.tick(106.2, waiting=True)
    assert not link.tick(114.1, waiting=True) and link.tick(114.3, waiting=True)
    assert link.tick(122.4, waiting=True)
    # Any word from the daemon restarts the count at 2 s.
    link.received({"kind": "credit", "bytes": 10}, now=123.0)
    assert link.tick(125.1, waiting=True)
    # Without a maximum, the wait stays the same.
    fixed = EmitterLink(IDENTITY, now=0.0)
    assert fixed.tick(2.1, waiting=True) and fixed.tick(4.2, waiting=True)


def test_a_welcome_answering_an_older_hello_does_not_count_later_bytes_as_lost() -> None:
    """Hellos queue up while a daemon is down (the rehello timer); the restarted daemon
    answers each. Its answer to the first must be read against the bytes sent since the
    first, not since the last (issue 11: 320 taps counted lost for 1 missing)."""
    link = EmitterLink(IDENTITY, now=0.0)
    link.outgoing()
    link.received(welcome("old"), now=0.0)
    link.sent(100)  # the old daemon died holding these: lost
    link.hello(now=2.0)
    link.sent(40)  # queued behind hello 2, read by the new daemon after it
    link.hello(now=4.0)
    link.sent(10)
    nonces = [decode(frames).header["nonce"] for frames in link.outgoing()]
    assert nonces == [2, 3]
    # The new daemon met our queued messages: hello 2, 40 bytes, hello 3, 10 bytes.
    assert isinstance(link.received(welcome("new", held_bytes=0, nonce=2), now=5.0), Restarted)
    link.outgoing()  # (hello 4, after the restart)
    # Its welcome to hello 2: it had none of ours yet; 40 + 10 came after hello 2.
    event = link.received(welcome("new", held_bytes=0, nonce=2), now=5.1)
    assert event == Welcomed("new", lost_bytes=100, first=False)
    assert link.in_flight == 50
    # Its welcome to hello 3 (it had read the 40 by then and holds them): nothing more lost.
    event = link.received(welcome("new", held_bytes=40, nonce=3), now=5.2)
    assert event == Welcomed("new", lost_bytes=0, first=False)
    assert (link.in_flight, link.lost_bytes) == (50, 100)
