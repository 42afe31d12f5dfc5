"""Subscribers under faults (issue 10): a daemon that is gone (SIGTERM must still stop
the subscriber), a daemon that asks again and again to be subscribed to, a tap the
subscriber cannot decode (it must be acknowledged with an error, not left in flight),
and a runtime directory someone else could have put a fake daemon in."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from conftest import Daemon
from tapd.errors import ConfigError
from tapd.protocol import MAGIC, decode, encode
from tapd_client import Subscriber

SUBSCRIBER = """
import signal, sys
from tapd_client import Subscriber
subscriber = Subscriber(sys.argv[1], heartbeat=0.001)
subscriber.add_handler("loss", lambda arg, meta: None)
signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
subscriber.connect()
print("CONNECTED", flush=True)
subscriber.run()
subscriber.close()
print("STOPPED", flush=True)
"""


def test_a_subscriber_whose_daemon_is_gone_still_stops_on_sigterm(
    start_daemon: Callable[..., Daemon],
) -> None:
    daemon = start_daemon()
    process = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, daemon.endpoint],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "CONNECTED"
        daemon.stop()  # it drains, closes and removes its socket
        time.sleep(3.0)  # a heartbeat a millisecond: its send queue to the daemon fills
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)
            pytest.fail("the subscriber ignored SIGTERM with its daemon gone")
    assert process.returncode == 0 and "STOPPED" in out


class FakeDaemon:
    """A ROUTER socket playing the daemon, for a real Subscriber run in a thread."""

    def __init__(self, runtime_dir: Path) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.endpoint = f"ipc://{runtime_dir}/fake.sock"
        self.sock.bind(self.endpoint)
        self.peer = b""

    def receive(self, timeout: float = 5.0) -> dict[str, Any] | None:
        if not self.sock.poll(int(timeout * 1000)):
            return None
        self.peer, *frames = self.sock.recv_multipart()
        return decode(frames).header

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


@pytest.fixture
def fake(runtime_dir: Path) -> Iterator[tuple[FakeDaemon, Subscriber, list[Any]]]:
    daemon = FakeDaemon(runtime_dir)
    subscriber = Subscriber(daemon.endpoint, heartbeat=0.1)
    handled: list[Any] = []
    subscriber.add_handler("loss", lambda arg, meta: handled.append(arg))
    thread = threading.Thread(target=subscriber.run, daemon=True)
    thread.start()
    hello = daemon.receive()
    assert hello is not None and hello["kind"] == "hello"
    daemon.send(encode("welcome", {"window_bytes": 0, "daemon": "fake"}))
    yield daemon, subscriber, handled
    subscriber.stop()
    thread.join(timeout=10)
    assert not thread.is_alive()
    subscriber.close()
    daemon.close()


@pytest.mark.fast
def test_a_storm_of_rehellos_is_answered_by_few_hellos(
    fake: tuple[FakeDaemon, Subscriber, list[Any]],
) -> None:
    daemon, _, _ = fake
    time.sleep(1.2)  # a while after its hello, as when its daemon restarts
    for _ in range(300):
        daemon.send(encode("rehello", {}))
    hellos = 0
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        header = daemon.receive(timeout=0.1)
        if header is not None and header["kind"] == "hello":
            hellos += 1
    assert 1 <= hellos <= 3, f"{hellos} hellos answered 300 rehellos within 1.5 s"


@pytest.mark.fast
def test_a_tap_the_subscriber_cannot_decode_is_acknowledged_with_an_error(
    fake: tuple[FakeDaemon, Subscriber, list[Any]],
) -> None:
    daemon, _, handled = fake
    header = {"kind": "tap", "consumer": "loss", "seq": 0, "step": None, "device": None,
              "process": 0, "host": "h", "pid": 1, "time": 0, "transforms": [], "meta": {},
              "tree": ["*"], "leaves": [["float32", [4], 16]], "tid": 5,
              "emitter": "h:1"}  # fmt: skip
    daemon.send([MAGIC, msgpack.packb(header), bytes(3)])  # 3 bytes for a 16-byte leaf
    ack = None
    deadline = time.monotonic() + 10
    while ack is None and time.monotonic() < deadline:
        got = daemon.receive(timeout=0.5)
        if got is not None and got["kind"] == "ack":
            ack = got
    assert ack is not None, "the undecodable tap was never acknowledged"
    assert ack["upto"] == 5
    [error] = ack["errors"]
    assert error["tid"] == 5 and "bad_frames" in error["error"]
    assert handled == []


@pytest.mark.fast
def test_a_subscriber_refuses_a_runtime_dir_others_can_enter(tmp_path: Path) -> None:
    squatted = tmp_path / "squatted"
    squatted.mkdir()
    os.chmod(squatted, 0o777)
    subscriber = Subscriber(f"ipc://{squatted}/tapd.sock")
    subscriber.add_handler("loss", lambda arg, meta: None)
    with pytest.raises(ConfigError, match="mode 0o777"):
        subscriber.connect(timeout=1)
    link = tmp_path / "link"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    link.symlink_to(private)
    subscriber = Subscriber(f"ipc://{link}/tapd.sock")
    subscriber.add_handler("loss", lambda arg, meta: None)
    with pytest.raises(ConfigError, match="symbolic link"):
        subscriber.connect(timeout=1)


def test_the_cli_refuses_a_runtime_dir_others_can_enter(tmp_path: Path) -> None:
    from conftest import tapd_cmd
    from tapd.cli.exit_codes import ExitCode

    squatted = tmp_path / "squatted"
    squatted.mkdir()
    os.chmod(squatted, 0o777)
    for command in (["status"], ["check"], ["tail", "loss"]):
        result = tapd_cmd(*command, env={"TAPD_RUNTIME_DIR": str(squatted)}, timeout=30)
        assert result.returncode == ExitCode.CONFIG, (command, result.stderr)
        assert "mode 0o777" in result.stderr


def test_a_portable_emitter_refuses_a_runtime_dir_others_can_enter(tmp_path: Path) -> None:
    squatted = tmp_path / "squatted"
    squatted.mkdir()
    os.chmod(squatted, 0o777)
    script = (
        "import jax, tapd\n"
        "try:\n"
        "    jax.jit(lambda x: tapd.tap(x, 'loss'))(1.0)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {**os.environ, "TAPD_RUNTIME_DIR": str(squatted), "TAPD_BACKEND": "portable",
           "TAPD_EXIT_TIMEOUT": "1"}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert "ConfigError" in result.stdout and "mode 0o777" in result.stdout, (
        result.stdout + result.stderr
    )
