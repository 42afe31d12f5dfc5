"""An emitter's counts across a daemon restart (issue 10, item 7; issue 18, part 5): every
tap is counted once, by the daemon that finished it; what a killed daemon finished but
never reported is counted unknown; and the exit check does not cry wolf."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable

from conftest import APPS, Daemon, SubscriberProcess, wait_until


def _paced_emitter(daemon: Daemon, *, taps: int, interval_ms: int) -> subprocess.Popen[str]:
    """A JAX process tapping `loss` every `interval_ms` into `daemon` (tests/apps)."""
    command = [sys.executable, str(APPS / "emitter_app.py"), "paced", str(taps), str(interval_ms)]
    env = {**os.environ, "TAPD_ENDPOINT": daemon.endpoint}
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_delivered_counts_the_taps_of_both_daemons_and_exit_is_quiet(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    backend: str,
) -> None:
    first = start_daemon()
    subscriber = start_subscriber(first, "loss")
    emitter = _paced_emitter(first, taps=60, interval_ms=20)
    try:
        wait_until(lambda: len(subscriber.records()) >= 20, "taps flowing to the first daemon")
        assert first.stop() == 0  # drains, tells its emitters their totals, exits
        second = start_daemon("--startup-grace", "3")
        out, err = emitter.communicate(timeout=120)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate(timeout=30)
    assert emitter.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    wait_until(lambda: len(subscriber.records()) >= stats["delivered"], "the handled taps")
    handled = {r["seq"] for r in subscriber.records()}
    assert stats["delivered"] >= len(handled) > 20, (stats, len(handled))
    assert stats["delivered"] + stats["unrouted"] <= stats["sent"] + 64  # re-reads, at most
    if len(handled) == 60:
        assert "not every tap was delivered" not in err and "tapd at exit" not in err, err
    assert second.process.poll() is None


def test_after_a_daemon_is_killed_the_emitter_counts_what_it_knows_and_exit_is_true(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    backend: str,
) -> None:
    first = start_daemon()
    subscriber = start_subscriber(first, "loss")
    emitter = _paced_emitter(first, taps=200, interval_ms=10)
    try:
        wait_until(lambda: len(subscriber.records()) >= 40, "taps flowing to the first daemon")
        first.process.kill()
        first.process.wait(timeout=30)
        second = start_daemon("--startup-grace", "3")
        out, err = emitter.communicate(timeout=120)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate(timeout=30)
    assert emitter.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    handled = {r["seq"] for r in subscriber.records()}
    assert handled == set(range(200)), sorted(set(range(200)) - handled)
    # What the killed daemon finished after its last report to the emitter died with it:
    # those taps are unknown, not undelivered, and no tap is counted twice.
    assert stats["sent"] == 200 and stats["dropped"] == stats["daemon_dropped"] == 0, stats
    assert stats["delivered"] + stats["unknown"] + stats["unrouted"] == 200, stats
    assert stats["unknown"] <= 32, stats  # the killed daemon's last tenth of a second
    assert "not every tap was delivered" not in err, err
    if stats["unknown"]:
        assert f"at exit, {stats['unknown']} taps went to a tapd daemon that stopped" in err
    assert second.process.poll() is None


def test_a_loop_s_runs_survive_a_killed_daemon_each_tap_counted_once(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    backend: str,
) -> None:
    """The bulk path (issue 63): a loop's taps, routed as runs and sent as columnar runs
    to a slow batch handler, when the daemon is killed -9 midway: the next daemon reads
    the ring from where delivery stopped, the subscriber has every tap, and the emitter
    counts each tap once (delivered, or unknown: finished by the killed daemon after its
    last report)."""
    count = 3000
    first = start_daemon()
    subscriber = start_subscriber(first, "loss", sleep_ms=20, window=64, batch=True)
    command = [sys.executable, str(APPS / "emitter_app.py"), "loop", str(count), "when_told"]
    env = {**os.environ, "TAPD_ENDPOINT": first.endpoint}
    emitter = subprocess.Popen(
        command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert emitter.stdout is not None
        assert json.loads(emitter.stdout.readline()) == {"ran": count}
        # Its barrier_wait starts while the first daemon runs, which holds the barrier
        # (the slow subscriber is far behind) when it is killed: the next daemon is
        # asked it again, and answers it once every tap is delivered.
        assert emitter.stdin is not None
        emitter.stdin.write("barrier\n")
        emitter.stdin.flush()
        wait_until(lambda: len(subscriber.records()) >= 300, "runs flowing to the first daemon")
        first.process.kill()
        first.process.wait(timeout=30)
        assert len(subscriber.records()) < count  # (killed midway)
        second = start_daemon("--startup-grace", "3")
        out, err = emitter.communicate(timeout=120)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate(timeout=30)
    assert emitter.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])["stats"]
    records = subscriber.records()
    assert {r["seq"] for r in records} == set(range(count))
    assert max(r["batch_size"] for r in records) > 1  # runs, not single taps
    assert stats["sent"] == count and stats["dropped"] == stats["daemon_dropped"] == 0, stats
    assert stats["delivered"] + stats["unknown"] + stats["unrouted"] == count, stats
    assert second.process.poll() is None
