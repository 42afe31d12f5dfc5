"""The emitter's socket (tapd/clients/emitter_socket.py), which the sender thread, the
forwarder and the replayer share, against a ROUTER standing in for a daemon over real
ZeroMQ (tcp on 127.0.0.1): the hello goes out first, the link takes the daemon's
messages before the owner sees them, unanswered barriers are kept, said again, and
settled by an answer to a later one, and a malformed message goes to the owner's
callback, not through."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from tapd.clients import emitter_socket
from tapd.clients.emitter_socket import EmitterSocket
from tapd.errors import ProtocolError
from tapd.protocol import Message, decode, encode
from tapd.protocol.link import LinkEvent, Welcomed
from tapd.protocol.tree import LEAF

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

IDENTITY = {"role": "emitter", "host": "h", "pid": 1, "process": 0}
TIMEOUT_MS = 10_000  # bounds a hang only


class FakeDaemon:
    def __init__(self, context: zmq.Context[Any]) -> None:
        self.sock: zmq.Socket[Any] = context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.peer: bytes | None = None

    def take(self) -> dict[str, Any]:
        assert self.sock.poll(TIMEOUT_MS), "the emitter socket sent nothing"
        peer, *frames = self.sock.recv_multipart()
        self.peer = peer
        return decode(frames).header

    def say(self, frames: list[Any]) -> None:
        assert self.peer is not None
        self.sock.send_multipart([self.peer, *frames])


@pytest.fixture
def pair() -> Iterator[tuple[FakeDaemon, EmitterSocket]]:
    context: zmq.Context[Any] = zmq.Context()
    daemon = FakeDaemon(context)
    sock = emitter_socket.connect(context, daemon.endpoint, secure=lambda sock: None)
    connection = EmitterSocket(sock, IDENTITY, time.monotonic())
    try:
        yield daemon, connection
    finally:
        sock.close(linger=0)
        daemon.sock.close()
        context.term()


def received(
    connection: EmitterSocket, malformed: list[ProtocolError] | None = None
) -> list[tuple[Message, LinkEvent | None]]:
    """What the connection yields once the next message has arrived."""
    assert connection.sock.poll(TIMEOUT_MS), "the daemon's message did not arrive"
    bad = [] if malformed is None else malformed
    return list(connection.receive(time.monotonic(), bad.append))


def test_hello_first_then_the_welcome_opens_the_window(
    pair: tuple[FakeDaemon, EmitterSocket],
) -> None:
    daemon, connection = pair
    assert daemon.take() == {"kind": "hello", **IDENTITY, "nonce": 1}
    assert not connection.may_send(1)
    daemon.say(encode("welcome", {"window_bytes": 100, "daemon": "d1", "nonce": 1}))
    [(message, event)] = received(connection)
    assert message.kind == "welcome"
    assert event == Welcomed("d1", lost_bytes=0, first=True)
    assert connection.may_send(100) and connection.link.daemon == "d1"
    tap = encode("tap", _tap_fields(), [np.zeros(60, np.uint8)])
    connection.send(tap, 60)
    assert connection.link.in_flight == 60 and not connection.may_send(41)
    assert daemon.take()["kind"] == "tap"


def test_barriers_are_kept_until_answered_and_said_again_in_order(
    pair: tuple[FakeDaemon, EmitterSocket],
) -> None:
    daemon, connection = pair
    daemon.take()  # hello
    connection.send_barrier(0)
    connection.send_barrier(1, {"ring_position": 64})
    connection.send_barrier(2)
    assert [daemon.take() for _ in range(3)] == [
        {"kind": "barrier", "id": 0},
        {"kind": "barrier", "id": 1, "ring_position": 64},
        {"kind": "barrier", "id": 2},
    ]
    connection.resend_barriers(last_only=True)
    assert daemon.take() == {"kind": "barrier", "id": 2}
    # The answer to barrier 1 settles barrier 0 too: a daemon answers them in order.
    done = {"id": 1, "delivered": 0, "dropped": 0, "unrouted": 0}
    daemon.say(encode("barrier_done", done))
    [(message, event)] = received(connection)
    assert (message.kind, event) == ("barrier_done", None)
    assert connection.barriers == {2: {}}
    connection.resend_barriers()
    assert daemon.take() == {"kind": "barrier", "id": 2}


def test_a_rehello_is_answered_before_the_owner_sees_it_and_junk_goes_to_the_callback(
    pair: tuple[FakeDaemon, EmitterSocket],
) -> None:
    daemon, connection = pair
    daemon.take()  # hello
    daemon.say([b"TAPD\x01", b"\xc1"])  # 0xc1: never valid msgpack
    daemon.say(encode("rehello", {}))
    malformed: list[ProtocolError] = []
    seen = received(connection, malformed)
    while not seen:  # (the two may arrive apart)
        seen = received(connection, malformed)
    assert [message.kind for message, _ in seen] == ["rehello"]
    assert [exc.reason for exc in malformed] == ["bad_header"]
    assert daemon.take() == {"kind": "hello", **IDENTITY, "nonce": 2}  # the link's answer


def _tap_fields() -> dict[str, Any]:
    return {
        "consumer": "c",
        "seq": 0,
        "step": None,
        "device": None,
        "process": 0,
        "host": "h",
        "pid": 1,
        "time": 0,
        "transforms": [],
        "meta": {},
        "tree": LEAF,
    }
