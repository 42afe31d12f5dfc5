"""Real daemon, real subscriber processes, real jitted JAX emitters; every test runs
once per emitter backend (native ring, portable callback)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import APPS, Daemon, SubscriberProcess, ring_files, rings_of, run_emitter, wait_until

pytestmark = pytest.mark.usefixtures("backend")

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def by_consumer(records: list[dict[str, Any]], consumer: str) -> list[dict[str, Any]]:
    return [r for r in records if r["consumer"] == consumer]


def test_taps_under_jit_scan_fori_vmap_cond_and_grad(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "*")
    result = run_emitter(daemon.endpoint, "transforms")
    records = subscriber.records()

    [jit] = by_consumer(records, "jit")
    assert jit["value"] == [0.0, 2.0, 4.0]
    assert (jit["step"], jit["seq"], jit["meta"]) == (7, 0, {"note": "hello"})
    assert jit["transforms"] == []

    scan = by_consumer(records, "scan")
    assert [r["value"] for r in scan] == [0.0, 1.0, 3.0, 6.0, 10.0]
    assert [r["seq"] for r in scan] == [0, 1, 2, 3, 4]

    fori = by_consumer(records, "fori")
    assert [(r["step"], r["value"]) for r in fori] == [(0, 0), (1, 1), (2, 3), (3, 6)]

    [vmap] = by_consumer(records, "vmap")  # one tap for the whole batch
    assert vmap["value"] == {"sq": [0.0, 1.0, 4.0], "x": [0.0, 1.0, 2.0]}
    assert vmap["transforms"] == [["batch", {"batch_dims": [0, 0]}]]

    assert [r["value"] for r in by_consumer(records, "cond_true")] == [1.0]
    assert [r["value"] for r in by_consumer(records, "cond_false")] == [2.0]

    [grad] = by_consumer(records, "grad")  # the primal, once
    assert len(grad["value"]) == 3
    assert result["grad_tapped"] == result["grad_plain"]

    [vmap2] = by_consumer(records, "vmap2")
    assert vmap2["transforms"] == [["batch", {"batch_dims": [0]}]] * 2
    assert vmap2["shape"] == [2, 3]
    assert [(r["seq"], r["value"]) for r in by_consumer(records, "while")] == [
        (0, 1), (1, 2), (2, 3)]  # fmt: skip
    assert [r["value"] for r in by_consumer(records, "remat")] == [pytest.approx(0.84147098)]
    assert [(r["seq"], r["value"]) for r in by_consumer(records, "scan_grad")] == [
        (0, 0.0), (1, 1.0), (2, 2.0)]  # fmt: skip


def test_pmap_over_four_devices_taps_every_shard(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "shard")
    result = run_emitter(daemon.endpoint, "pmap", "3",
                         env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})  # fmt: skip
    assert (result["devices"], result["backend"]) == (4, backend)
    records = subscriber.records()
    assert len(records) == 4 * 3  # one tap per device per step
    for step in range(3):
        values = sorted(r["value"] for r in records if r["step"] == step)
        assert values == sorted([[10.0 * (2 * d) + step, 10.0 * (2 * d + 1) + step]
                                 for d in range(4)])  # fmt: skip
    if backend == "native":  # the FFI handler knows its device; in program order per device
        for device in range(4):
            mine = [r for r in records if r["device"] == device]
            assert [(r["seq"], r["step"]) for r in mine] == [(0, 0), (1, 1), (2, 2)]
            assert mine[0]["value"] == [20.0 * device, 20.0 * device + 10.0]


def test_one_subscriber_follows_two_daemons(start_daemon: StartDaemon, runtime_dir: Path) -> None:
    """Two hosts' daemons (each with its own emitter) and one subscriber for both."""
    first, second = start_daemon(name="a.sock"), start_daemon(name="b.sock")
    record = runtime_dir / "both.jsonl"
    subscriber = subprocess.Popen(
        [sys.executable, str(APPS / "subscriber_app.py"), "--endpoint", first.endpoint,
         "--endpoint", second.endpoint, "--record", str(record), "loss"])  # fmt: skip
    try:
        wait_until(lambda: first.subscriber_count() == second.subscriber_count() == 1,
                   "the subscriber on both daemons")  # fmt: skip
        a = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "steps", "20"],
                             env={**os.environ, "TAPD_ENDPOINT": first.endpoint})  # fmt: skip
        b = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "steps", "30"],
                             env={**os.environ, "TAPD_ENDPOINT": second.endpoint})  # fmt: skip
        assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0  # both barriers passed
        records = [json.loads(line) for line in record.read_text().splitlines()]
    finally:
        subscriber.terminate()
        subscriber.wait(timeout=30)
    by_emitter: dict[str, list[int]] = {}
    for r in records:
        by_emitter.setdefault(r["emitter"], []).append(r["step"])
    assert sorted(len(steps) for steps in by_emitter.values()) == [20, 30]
    assert all(steps == list(range(len(steps))) for steps in by_emitter.values())


def test_two_subscribers_both_get_every_tap_and_others_get_none(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon()
    first = start_subscriber(daemon, "loss")
    second = start_subscriber(daemon, "loss")
    other = start_subscriber(daemon, "accuracy")
    result = run_emitter(daemon.endpoint, "steps", "30")
    expected = [float(i) for i in range(30)]
    assert [r["value"] for r in first.records()] == expected
    assert [r["value"] for r in second.records()] == expected
    assert other.records() == []
    assert result["stats"]["delivered"] == 30
    assert result["stats"]["unrouted"] == 0


def test_slow_handler_does_not_slow_the_loop_and_the_barrier_waits(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon("--policy", "block")
    subscriber = start_subscriber(daemon, "loss", sleep_ms=100, timed=True)
    result = run_emitter(daemon.endpoint, "steps", "20")
    handler_time = 20 * 0.100
    records = subscriber.records()
    # The loop only queues taps: it ended before the handlers' two seconds did (had each
    # step waited for its tap's handler, the last one would have ended first). Checked
    # by which came first, not by the loop's length against a bound, which a loaded
    # machine stretched (0.60 s against 0.5 once, with 13 processes running on 2 cores).
    assert result["loop_end"] < records[-1]["handled_at"], (result, records[-1])
    assert result["loop_s"] + result["barrier_s"] >= handler_time * 0.9, result
    assert [r["value"] for r in records] == [float(i) for i in range(20)]
    assert result["stats"]["delivered"] == 20
    assert result["stats"]["dropped"] == result["stats"]["daemon_dropped"] == 0


def test_handler_exception_surfaces_in_barrier_wait(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "bad", "good", raise_on="bad")
    result = run_emitter(daemon.endpoint, "raising")
    assert result["raised"] is not None, "barrier_wait did not raise TapFunctionException"
    # As host_callback's: the exception as Python formats it, here the subscriber
    # process's (its handler's frame), as JAX's host_callback test matched it.
    assert re.search(
        "There were exceptions during callback processing. Last one was:.*"
        r'subscriber_app\.py", line \d+, in handle\n.*'
        "ValueError: deliberate failure at seq 0",
        result["raised"],
        re.DOTALL,
    ), result["raised"]
    assert result["errors"] == [
        "bad#0: main.<locals>.handle raised ValueError('deliberate failure at seq 0')"
    ]
    assert result["raised"].endswith(f"1 tap function call(s) raised:\n  {result['errors'][0]}")
    assert [r["consumer"] for r in subscriber.records()] == ["good"]
    assert daemon.counters()["handler_errors"] == 1


def test_subscriber_killed_mid_stream_daemon_survives_and_serves_its_replacement(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon("--subscriber-timeout", "1")
    doomed = start_subscriber(daemon, "big", sleep_ms=20, window=4)
    run_emitter(daemon.endpoint, "many_bytes", "50", "4", env={"TAPD_EXIT_TIMEOUT": "0.5"})
    wait_until(lambda: doomed.records(), "the first taps to arrive")
    doomed.kill()
    wait_until(lambda: daemon.subscriber_count() == 0, "the daemon to drop the dead subscriber")
    assert daemon.process.poll() is None
    counters = daemon.counters()
    # Every tap is accounted for: acknowledged, or counted lost with the subscriber.
    acked = counters.get("deliveries_acked", 0)
    assert acked + counters["deliveries_lost"] == 50, counters
    # At most one window of taps was handled but not yet acknowledged when it died.
    assert acked <= len(doomed.records()) <= acked + 4

    replacement = start_subscriber(daemon, "big")
    run_emitter(daemon.endpoint, "many_bytes", "10", "4")
    records = wait_until(
        lambda: len(replacement.records()) == 10 and replacement.records(),
        "the replacement to get every tap",
    )
    assert [r["step"] for r in records] == list(range(10))


def test_exit_drains_taps_without_an_explicit_barrier(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "big", sleep_ms=5)
    run_emitter(daemon.endpoint, "many_bytes", "40", "64")
    # The emitter has exited: its atexit drain waited until the handlers were done.
    records = subscriber.records()
    assert [r["step"] for r in records] == list(range(40))
    assert all(len(r["value"]) == 64 * 256 for r in records)


def test_block_policy_with_tiny_queues_loses_nothing(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon(
        "--policy", "block", "--queue-bytes", "40000", "--emitter-window-bytes", "40000"
    )
    subscriber = start_subscriber(daemon, "big", sleep_ms=10, window=2)
    result = run_emitter(
        daemon.endpoint, "many_bytes", "60", "16", env={"TAPD_BUFFER_BYTES": "40000"}
    )
    assert result["stats"]["dropped"] == 0
    assert [r["step"] for r in subscriber.records()] == list(range(60))


def test_drop_newest_counts_exactly(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    # Each tap is 4 bytes: the subscriber's queue holds two, and it is slow.
    daemon = start_daemon("--policy", "drop_newest", "--queue-bytes", "8")
    subscriber = start_subscriber(daemon, "loss", sleep_ms=20, window=1)
    result = run_emitter(daemon.endpoint, "steps", "200", env={"TAPD_POLICY": "drop_newest"})
    stats = result["stats"]
    seqs = [r["seq"] for r in subscriber.records()]
    assert stats["daemon_dropped"] > 0
    assert stats["sent"] + stats["dropped"] == 200
    assert stats["delivered"] == len(seqs)
    assert stats["delivered"] + stats["daemon_dropped"] + stats["unrouted"] == stats["sent"]
    assert daemon.counters().get("deliveries_dropped", 0) == stats["daemon_dropped"]
    # What arrived is in order, and the drops show as gaps in the sequence numbers.
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert 200 - len(seqs) == stats["dropped"] + stats["daemon_dropped"]


@pytest.mark.parametrize("batch", [True, False], ids=["batch-handler", "per-tap-handler"])
def test_drop_newest_counts_runs_of_ring_taps_exactly(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, batch: bool
) -> None:
    """A loop's taps reach the daemon as runs (a unit of up to half the window), sent as
    columnar runs; a slow subscriber's full queue drops whole runs: every tap is still
    counted once (delivered, dropped by the ring or by the daemon), what arrives is in
    order, and the drops show as gaps in the seqs."""
    daemon = start_daemon("--policy", "drop_newest", "--queue-bytes", "1024")
    subscriber = start_subscriber(daemon, "loss", sleep_ms=20, window=64, batch=batch)
    count = 3000
    result = run_emitter(daemon.endpoint, "loop", str(count), env={"TAPD_POLICY": "drop_newest"})
    stats = result["stats"]
    records = subscriber.records()
    seqs = [r["seq"] for r in records]
    assert stats["daemon_dropped"] > 0, stats  # (the queue holds 8 runs of 32)
    assert stats["sent"] + stats["dropped"] == count
    assert stats["delivered"] == len(seqs)
    assert stats["delivered"] + stats["daemon_dropped"] + stats["unrouted"] == stats["sent"]
    assert daemon.counters().get("deliveries_dropped", 0) == stats["daemon_dropped"]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert count - len(seqs) == stats["dropped"] + stats["daemon_dropped"]
    assert all(r["value"] == r["step"] for r in records)  # each tap's own value
    if batch:  # (runs: a batch holds more than one tap)
        assert max(r["batch_size"] for r in records) > 1


def test_taps_with_no_subscriber_are_counted_unrouted(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    # (TAPD_DORMANT=0: else, once the daemon has read the site's entry, the site is
    # dormant and its later taps are skipped, not unrouted; tests/test_dormant.py)
    result = run_emitter(daemon.endpoint, "steps", "5", env={"TAPD_DORMANT": "0"})
    assert result["stats"]["unrouted"] == 5
    assert daemon.counters()["taps_unrouted"] == 5


def test_sigterm_drains_queued_taps_before_exit(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path
) -> None:
    # (A subscriber held in a handler sends no heartbeat: not dropped for it here.)
    daemon = start_daemon("--drain-timeout", "30", "--subscriber-timeout", "120")
    hold = runtime_dir / "hold"
    subscriber = start_subscriber(daemon, "loss", hold=hold)
    # Its handlers wait for `hold`: every tap is still to be handled when the daemon is
    # told to stop. The emitter has left by then (its exit drain gives up after 0.5 s), so
    # that no barrier of its is still to be answered: the daemon's drain alone delivers.
    # (Before: 50 ms handlers, and a bound on how many had run, which a loaded machine
    # broke; and the emitter's barrier had to reach the daemon within their second.)
    result = run_emitter(daemon.endpoint, "steps", "20", "no_barrier",
                         env={"TAPD_EXIT_TIMEOUT": "0.5"})  # fmt: skip
    assert result["stats"]["sent"] == 20, result
    wait_until(lambda: daemon.counters().get("taps_received") == 20, "all taps at the daemon")
    assert subscriber.records() == []
    daemon.process.send_signal(signal.SIGTERM)
    hold.touch()
    assert daemon.stop() == 0
    assert [r["value"] for r in subscriber.records()] == [float(i) for i in range(20)]


def test_insecure_tcp_endpoint_is_opt_in_and_warns_loudly(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon("--tcp", "tcp://127.0.0.1:0", "--insecure")
    local, remote = daemon.endpoints
    assert local.startswith("ipc://") and remote.startswith("tcp://127.0.0.1:")
    over_tcp = start_subscriber(daemon, "loss", endpoint=remote)
    run_emitter(local, "steps", "3")
    assert [r["value"] for r in over_tcp.records()] == [0.0, 1.0, 2.0]
    assert "WITHOUT authentication" in daemon.log()


@pytest.mark.waits
def test_exit_without_a_daemon_counts_and_logs_what_was_lost(
    runtime_dir: Path, backend: str, start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    result = run_emitter(
        f"ipc://{runtime_dir}/tapd.sock",
        "steps",
        "3",
        "no_barrier",
        env={"TAPD_EXIT_TIMEOUT": "0.5"},
    )
    assert "barrier_wait timed out after 0.5 s" in result["stderr"]
    # Both backends write the ring: the taps wait there; a daemon started later drains
    # the dead emitter's ring, delivers them, and removes it.
    assert result["stats"]["sent"] == 3
    assert list(rings_of(runtime_dir).glob("*.ring"))
    daemon = start_daemon("--startup-grace", "10")  # time for the subscriber to connect
    subscriber = start_subscriber(daemon, "loss")
    records = wait_until(lambda: len(subscriber.records()) == 3 and subscriber.records(),
                         "the orphaned ring's taps")  # fmt: skip
    assert [r["value"] for r in records] == [0.0, 1.0, 2.0]
    wait_until(lambda: not ring_files(runtime_dir), "the ring's removal")
