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


def fds_of(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def taps_from(upstream: Daemon, name: str) -> int:
    """Taps the upstream has received from the forwarding daemon whose emitter is `name`."""
    return sum(e["taps"] for e in upstream.stats()["emitters"] if e["name"] == name)


def test_a_forwarder_killed_and_restarted_mid_stream_loses_nothing_and_counts_stay_exact(
    start_daemon: StartDaemon, runtime_dir: Path, generators: Callable[[str, Path], Generator]
) -> None:
    upstream = start_daemon(name="up.sock")
    result_file = runtime_dir / "count.json"
    counter = subprocess.Popen(
        [
            sys.executable,
            str(FANIN),
            "count",
            "--endpoint",
            upstream.endpoint,
            "--result",
            str(result_file),
        ]
    )
    try:
        wait_until(lambda: upstream.subscriber_count() == 1, "the counting subscriber")
        forwarders, feeds = [], []
        for index in range(3):
            (runtime_dir / f"h{index}").mkdir(mode=0o700)  # a runtime dir (and rings) each
            name = f"h{index}/d.sock"
            forwarders.append(start_daemon("--forward", upstream.endpoint, name=name))
            feeds.append(generators(forwarders[-1].endpoint, runtime_dir / f"g{index}.log"))
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
    finally:
        stop_process(counter)  # type: ignore[arg-type]
    seen = json.loads(result_file.read_text())["consumers"]
    for result in results:
        assert result["sent"] > 0 and result["dropped"] == 0, result
        lost = result["dropped"] + result["daemon_dropped"] + result["unrouted"]
        delivered = seen[result["consumer"]]["distinct"]
        assert delivered + lost == result["sent"], (result, seen[result["consumer"]])
        assert seen[result["consumer"]]["size"] == 256
    # Taps of the other forwarders were never sent twice; forwarder 0's may have been.
    assert seen["fanin.test.1"]["duplicates"] == seen["fanin.test.2"]["duplicates"] == 0


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
