"""Faults on the ring, which both backends write (the native FFI handler, or the portable
backend's host callback): the ring outlives a killed daemon and a killed emitter.

A daemon killed with SIGKILL and restarted re-attaches to the emitter's ring and
delivers from where delivery stopped (at least once: a tap delivered but not yet released
may come twice, and its sequence number shows it). An emitter killed with SIGKILL
leaves its committed taps in the ring: the daemon delivers them and removes the ring.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import (
    APPS,
    Daemon,
    SubscriberProcess,
    native_unavailable,
    ring_files,
    wait_until,
)

pytestmark = pytest.mark.skipif(bool(native_unavailable()), reason=str(native_unavailable()))


def start_emitter(daemon: Daemon, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TAPD_ENDPOINT": daemon.endpoint}  # TAPD_BACKEND: the fixture's
    return subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), *args], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_line(process: subprocess.Popen[str], expected: str) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        if line.strip() == expected:
            return
    pytest.fail(f"{process.args!r} ended without printing {expected!r}")


def test_daemon_killed_and_restarted_reattaches_and_loses_nothing(
    backend: str,
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    runtime_dir: Path,
) -> None:
    first = start_daemon()
    subscriber = start_subscriber(first, "loss", sleep_ms=5)
    emitter = start_emitter(first, "paced", "150", "10")
    wait_until(lambda: len(subscriber.records()) >= 20, "taps flowing")
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    # The subscriber reconnects on its own; the grace period lets it back in first.
    start_daemon("--startup-grace", "3")
    wait_for_line(emitter, "TAPPED")
    out, _ = emitter.communicate(timeout=90)
    assert emitter.returncode == 0, out
    steps = [r["step"] for r in subscriber.records()]
    assert set(steps) == set(range(150)), sorted(set(range(150)) - set(steps))
    # Duplicates, if any, are re-deliveries of taps the killed daemon had sent.
    assert len(steps) - len(set(steps)) < 64
    wait_until(lambda: not ring_files(runtime_dir), "the ring's removal")


def test_emitter_killed_its_committed_taps_are_delivered_and_the_ring_removed(
    backend: str,
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    runtime_dir: Path,
) -> None:
    # (A subscriber held in a handler sends no heartbeat: not dropped for it here.)
    daemon = start_daemon("--subscriber-timeout", "120")
    hold = runtime_dir / "hold"
    subscriber = start_subscriber(daemon, "loss", hold=hold)
    emitter = start_emitter(daemon, "taps_then_hang", "100")
    wait_for_line(emitter, "TAPPED")
    # Its handlers wait for `hold`: none has run when the emitter dies (a bound on how
    # many had, with 10 ms handlers, failed when a loaded machine was slow to read
    # TAPPED).
    assert subscriber.records() == []
    emitter.kill()
    emitter.communicate(timeout=30)
    hold.touch()
    records = wait_until(lambda: len(subscriber.records()) >= 100 and subscriber.records(),
                         "every committed tap", timeout=30)  # fmt: skip
    assert [r["step"] for r in records] == list(range(100))
    wait_until(lambda: not ring_files(runtime_dir), "the ring's removal")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.mark.waits
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc")
def test_an_idle_daemon_sleeps_rather_than_spins_and_wakes_for_the_next_tap(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    """Not a speed measurement: a daemon spinning on an attached, quiet ring burns a
    whole core (it did once: 100% in bench/RESULTS.md); sleeping, a few percent."""
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss")
    # Taps 3 s apart: the second comes after the daemon went to sleep, and wakes it.
    emitter = start_emitter(daemon, "paced", "3", "3000")
    try:
        wait_until(lambda: len(subscriber.records()) == 2, "the tap that wakes the daemon")
        time.sleep(0.5)  # the daemon settles into its idle state again
        before = cpu_seconds(daemon.process.pid)
        time.sleep(1.5)
        used = cpu_seconds(daemon.process.pid) - before
        assert used < 0.5, f"the idle daemon used {used:.2f} s of CPU in 1.5 s"
        wait_until(lambda: len(subscriber.records()) == 3, "the next tap after a pause")
        assert emitter.wait(timeout=60) == 0
    finally:
        if emitter.poll() is None:
            emitter.kill()
        emitter.communicate(timeout=30)
