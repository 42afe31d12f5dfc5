"""The daemon's sockets pass whole messages only, each from the one thread that owns it
(tapd/channel.py; issue 18, part 5: libzmq's `!_more` abort, fq.cpp)."""

from __future__ import annotations

import ast
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tapd.channel import Channel, WrongThread

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

DAEMON = Path(__file__).parent.parent / "tapd" / "daemon"
# What sends or receives by the frame, or a message in other shapes than a list of frames.
RAW = {
    *("send_multipart", "recv_multipart", "send_string", "recv_string", "send_json"),
    *("recv_json", "send_pyobj", "recv_pyobj", "send_serialized", "recv_serialized"),
}


def raw_socket_uses(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("SNDMORE", "RCVMORE"):
            found.append(f"{path.name}:{node.lineno} {node.attr}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, ast.unparse(node.func.value)
        if name in RAW or (name in ("send", "recv") and "sock" in owner):
            found.append(f"{path.name}:{node.lineno} {owner}.{name}")
    return found


def test_no_daemon_module_sends_or_receives_on_a_socket_but_through_a_channel() -> None:
    # And the emitter's socket, which the sender thread, the forwarder and replay share.
    modules = [*DAEMON.rglob("*.py"), DAEMON.parent / "clients" / "emitter_socket.py"]
    assert len(modules) > 10
    assert [use for path in modules for use in raw_socket_uses(path)] == []


@pytest.fixture
def pair() -> Iterator[tuple[Channel, zmq.Socket[bytes]]]:
    context = zmq.Context()
    ours, theirs = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    ours.bind("inproc://channel-test")
    theirs.connect("inproc://channel-test")
    yield Channel(ours, "test"), theirs
    ours.close(linger=0)
    theirs.close(linger=0)
    context.term()


def test_a_message_with_a_frame_that_cannot_go_fails_whole(
    pair: tuple[Channel, zmq.Socket[bytes]],
) -> None:
    channel, peer = pair
    released = memoryview(bytearray(b"ring bytes"))
    released.release()
    with pytest.raises(ValueError):
        channel.send([b"first", released, b"last"], copy=False)
    channel.send([b"next", b"message"])
    assert peer.poll(5000)
    assert peer.recv_multipart() == [b"next", b"message"]  # nothing glued before it


def test_another_thread_may_not_use_a_channel(pair: tuple[Channel, zmq.Socket[bytes]]) -> None:
    channel, _ = pair
    errors: list[BaseException] = []

    def use() -> None:
        for call in (lambda: channel.send([b"x"]), channel.recv):
            try:
                call()
            except WrongThread as exc:
                errors.append(exc)

    thread = threading.Thread(target=use)
    thread.start()
    thread.join(timeout=10)
    assert len(errors) == 2 and "not thread-safe" in str(errors[0])


def test_a_channel_receives_whole_messages(pair: tuple[Channel, zmq.Socket[bytes]]) -> None:
    channel, peer = pair
    assert channel.recv() is None
    peer.send_multipart([b"a", b"b", b"c"])
    assert channel.socket.poll(5000)
    frames = channel.recv()
    assert frames is not None and [f.bytes for f in frames] == [b"a", b"b", b"c"]
