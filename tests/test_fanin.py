"""Fan-in (bench/fanin.py, issue 20 part 3), short and real: one upstream daemon with a
counting subscriber, three forwarding daemons in runtime directories of their own, each
fed by a JAX-free generator writing its shared-memory ring as the FFI handler does. One
forwarder is killed with SIGKILL while its generator writes, and started again: every
tap is still delivered (at least once), and the counts are exact."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from conftest import Daemon, native_unavailable, stop_process, wait_until

FANIN = Path(__file__).resolve().parent.parent / "bench" / "fanin.py"
StartDaemon = Callable[..., Daemon]

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))


class Generator:
    """`bench/fanin.py generate`: a ring writer driven line by line on stdin."""

    def __init__(self, endpoint: str, log: Path) -> None:
        with open(log, "w") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, str(FANIN), "generate", "--endpoint", endpoint],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.log = log
        assert "ready" in self.line(60.0)

    def line(self, timeout: float) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"no answer from the generator in {timeout} s\n{self.log.read_text()}"
        return self.process.stdout.readline()

    def run(self, consumer: str, size: int, seconds: float, rate: float) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(f"run {consumer} {size} {seconds} {rate} {1 << 20}\n")
        self.process.stdin.flush()

    def result(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.line(90.0))
        return result

    def quit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("quit\n")
        self.process.stdin.close()
        assert self.process.wait(timeout=30) == 0, self.log.read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


@pytest.fixture
def generators() -> Iterator[Callable[[str, Path], Generator]]:
    started: list[Generator] = []

    def start(endpoint: str, log: Path) -> Generator:
        started.append(Generator(endpoint, log))
        return started[-1]

    yield start
    for generator in started:
        generator.close()


@pytest.fixture
def counting(runtime_dir: Path) -> Iterator[Callable[[Daemon], Callable[[], dict[str, Any]]]]:
    """`bench/fanin.py count` on a daemon, connected; the function it returns stops it and
    gives what it counted, per consumer."""
    started: list[subprocess.Popen[str]] = []

    def start(daemon: Daemon) -> Callable[[], dict[str, Any]]:
        result = runtime_dir / f"count{len(started)}.json"
        argv = [sys.executable, str(FANIN), "count", "--endpoint", daemon.endpoint]
        started.append(subprocess.Popen([*argv, "--result", str(result)], text=True))
        wait_until(lambda: daemon.subscriber_count() == 1, "the counting subscriber")
        process = started[-1]

        def finish() -> dict[str, Any]:
            stop_process(process)
            seen: dict[str, Any] = json.loads(result.read_text())["consumers"]
            return seen

        return finish

    yield start
    for process in started:
        stop_process(process)


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def taps_from(upstream: Daemon, name: str) -> int:
    """Taps the upstream has received from the forwarding daemon whose emitter is `name`."""
    return sum(e["taps"] for e in upstream.stats()["emitters"] if e["name"] == name)


def host(start_daemon: StartDaemon, runtime_dir: Path, name: str, upstream: Daemon) -> Daemon:
    """A forwarding daemon in a runtime directory (and so a ring directory) of its own."""
    (runtime_dir / name).mkdir(mode=0o700)
    return start_daemon("--forward", upstream.endpoint, name=f"{name}/d.sock")


def assert_exact(results: list[dict[str, Any]], seen: dict[str, Any], size: int) -> None:
    """Per generator: distinct taps delivered + counted lost == sent, none dropped."""
    for result in results:
        assert result["sent"] > 0 and result["dropped"] == 0, result
        lost = result["dropped"] + result["daemon_dropped"] + result["unrouted"]
        delivered = seen[result["consumer"]]["distinct"]
        assert delivered + lost == result["sent"], (result, seen[result["consumer"]])
        assert seen[result["consumer"]]["size"] == size


def test_a_forwarder_killed_and_restarted_mid_stream_loses_nothing_and_counts_stay_exact(
    start_daemon: StartDaemon,
    runtime_dir: Path,
    generators: Callable[[str, Path], Generator],
    counting: Callable[[Daemon], Callable[[], dict[str, Any]]],
) -> None:
    upstream = start_daemon(name="up.sock")
    finish = counting(upstream)
    forwarders = [host(start_daemon, runtime_dir, f"h{i}", upstream) for i in range(3)]
    feeds = [generators(f.endpoint, runtime_dir / f"g{i}.log") for i, f in enumerate(forwarders)]
    for index, feed in enumerate(feeds):
        feed.run(f"fanin.test.{index}", 256, 3.0, 400)

    # Kill forwarder 0 once the upstream has had some of its taps, while it writes.
    victim = forwarders[0]
    emitter = f"forwarding daemon {victim.stats()['daemon']}"  # as the upstream names it
    wait_until(lambda: taps_from(upstream, emitter) >= 50, "taps through forwarder 0")
    fds_before = fds_of(upstream.process.pid)
    victim.process.send_signal(signal.SIGKILL)
    victim.process.wait(timeout=10)
    killed_at = time.monotonic()
    restarted = start_daemon("--forward", upstream.endpoint, name="h0/d.sock")

    results = [feed.result() for feed in feeds]
    assert results[0]["writes_done"] > killed_at, "the generator stopped before the kill"
    assert restarted.stats()["forward"]["upstream"] is not None
    # The killed forwarder's connection closed upstream; the new one took its place.
    # (At most as many as before: `fds_before` may include a control connection of
    # the polling above, which closes soon after.)
    wait_until(
        lambda: fds_of(upstream.process.pid) <= fds_before,
        f"the upstream's open fds to fall back to {fds_before}",
    )
    for feed in feeds:
        feed.quit()
    seen = finish()
    assert_exact(results, seen, 256)
    # Taps of the other forwarders were never sent twice; forwarder 0's may have been.
    assert seen["fanin.test.1"]["duplicates"] == seen["fanin.test.2"]["duplicates"] == 0


def test_a_tree_of_forwarders_delivers_every_tap_to_the_root_before_the_barrier_returns(
    start_daemon: StartDaemon,
    runtime_dir: Path,
    generators: Callable[[str, Path], Generator],
    counting: Callable[[Daemon], Callable[[], dict[str, Any]]],
) -> None:
    """docs/SIZING.md's tree: two hosts forward to a middle daemon, which forwards to the
    root; the root's subscriber has every tap by the time each barrier_wait returns."""
    root = start_daemon(name="root.sock")
    finish = counting(root)
    middle = host(start_daemon, runtime_dir, "mid", root)
    leaves = [host(start_daemon, runtime_dir, f"h{i}", middle) for i in range(2)]
    feeds = [generators(f.endpoint, runtime_dir / f"g{i}.log") for i, f in enumerate(leaves)]
    for index, feed in enumerate(feeds):
        feed.run(f"fanin.tree.{index}", 1024, 1.0, 300)
    results = [feed.result() for feed in feeds]
    sent = sum(r["sent"] for r in results)
    assert root.counters()["deliveries_acked"] == sent  # before the barriers returned
    assert [r["delivered"] for r in results] == [r["sent"] for r in results]
    forwarders = [e["name"] for e in root.stats()["emitters"]]
    assert forwarders == [f"forwarding daemon {middle.stats()['daemon']}"]
    for feed in feeds:
        feed.quit()
    seen = finish()
    assert_exact(results, seen, 1024)
    assert all(seen[r["consumer"]]["duplicates"] == 0 for r in results)


def test_the_fanin_benchmark_runs_in_quick_mode(tmp_path: Path) -> None:
    report = tmp_path / "fanin.md"
    result = subprocess.run(
        [sys.executable, str(FANIN), "--quick", "--output", str(report)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    text = report.read_text()
    assert "taps/s per upstream core" in text and "## Churn" in text
    assert "distinct taps delivered + counted lost == sent" in text


LISTENER = """
import subprocess, sys, time
import zmq
import zmq.utils.monitor
from tapd.daemon.bounds import configure_listener
from tapd.protocol import Limits

endpoint = sys.argv[1]
context = zmq.Context()
sock = context.socket(zmq.ROUTER)
configure_listener(sock, Limits())  # as the daemon's listening socket is
monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
sock.bind(endpoint)
peer = subprocess.Popen([sys.executable, "-c", sys.argv[2], endpoint, sys.argv[3]],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert peer.stdout.readline() == "queued\\n"
assert sock.poll(10_000), "nothing from the peer"
peer.kill()
peer.wait()
# Busy elsewhere for a few seconds, as a starved upstream is: the dead peer's
# connection still holds messages not read (libzmq stopped reading it).
time.sleep(3)
read = 0
while not monitor.poll(0):
    if sock.poll(100):
        sock.recv_multipart()
        read += 1
print(read, zmq.utils.monitor.recv_monitor_message(monitor)["event"], flush=True)
"""


FLOODER = """
import sys, time, zmq
from tapd.clients.emitter_socket import tcp_liveness
context = zmq.Context()
sock = context.socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 0)  # everything queued here, written as fast as the daemon reads
tcp_liveness(sock)  # what tapd's emitters and forwarders set on their connections
sock.connect(sys.argv[1])
count, seconds = (float(n) for n in sys.argv[2].split("/"))
for i in range(int(count)):  # spread over `seconds`, so that any ZeroMQ PING comes between
    sock.send(b"not a tapd message".ljust(100))
    time.sleep(seconds / count)
print("queued", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("flood", ["5000/0", "2000/2"])
def test_a_peer_killed_while_its_messages_wait_unread_does_not_abort_the_listener(
    runtime_dir: Path, flood: str
) -> None:
    """A host killed while its daemon's upstream had not yet read all it sent: libzmq
    stops reading a connection whose messages wait unread (RCVHWM), and a ZeroMQ
    heartbeat on that dead connection aborted the whole upstream (`Assertion failed:
    !_io_error`, libzmq 4.3.5): the listener's own (seen in bench/fanin.py's churn), or
    its answer to a PING the peer had sent among the unread messages (seen in
    test_multihost's cut link; with a peer that sent a PING every 2 ms, this test's
    paced flood aborted the listener in 1 of 6 runs). The daemon's listening socket, as
    it configures it, and a peer as tapd configures its connecting sockets (no PINGs),
    flooding at once or paced: the listener reads what the peer had sent and sees it go."""
    result = subprocess.run(
        [sys.executable, "-c", LISTENER, f"ipc://{runtime_dir}/l.sock", FLOODER, flood],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    read, event = result.stdout.split()
    assert int(read) > 0 and int(event) == zmq.EVENT_DISCONNECTED, result.stdout


@pytest.mark.fast
def test_connections_to_daemons_send_no_zeromq_heartbeats_and_keep_tcp_liveness() -> None:
    """What the test above needs of tapd's connecting sockets (emitters, forwarders):
    no ZeroMQ PING (tapd/protocol/link.py), and TCP's keepalive and unacknowledged-data
    timeout to find a dead connection."""
    from tapd.clients import emitter_socket
    from tapd.protocol.link import KEEPALIVE_IDLE_S, UNACKED_MAX_MS

    context = zmq.Context()
    sock = emitter_socket.connect(context, "tcp://127.0.0.1:9", secure=lambda s: None)
    try:
        assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
        assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
        assert sock.getsockopt(zmq.TCP_KEEPALIVE_IDLE) == KEEPALIVE_IDLE_S
        assert sock.getsockopt(zmq.TCP_MAXRT) == UNACKED_MAX_MS
    finally:
        sock.close(linger=0)
        context.term()
