"""`tapd start --metrics`: a real daemon with real traffic, scraped over HTTP and parsed
with prometheus-client's own parser; the values must equal `tapd status --json`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import APPS, Daemon, SubscriberProcess, stop_process, tapd_cmd, wait_until

prometheus_parser = pytest.importorskip("prometheus_client.parser")

TAPS = 30
# status counter -> the sample that must carry its value (the public names)
COUNTERS = {
    "taps_received": "tapd_taps_received_total",
    "bytes_received": "tapd_received_bytes_total",
    "deliveries_acked": "tapd_deliveries_handled_total",
    "deliveries_dropped": "tapd_deliveries_dropped_total",
    "deliveries_lost": "tapd_deliveries_lost_total",
    "taps_unrouted": "tapd_taps_unrouted_total",
    "taps_skipped": "tapd_taps_skipped_total",
    "handler_errors": "tapd_handler_errors_total",
}
EMITTER = {
    "taps": "tapd_emitter_taps_received_total",
    "bytes": "tapd_emitter_received_bytes_total",
    "delivered": "tapd_emitter_taps_delivered_total",
    "dropped": "tapd_emitter_taps_dropped_total",
    "unrouted": "tapd_emitter_taps_unrouted_total",
    "pending": "tapd_emitter_pending_units",
    "parked_bytes": "tapd_emitter_parked_bytes",
    "last_handled_time": "tapd_emitter_last_handled_tap_timestamp_seconds",
}
SUBSCRIBER = {
    "delivered": "tapd_subscriber_taps_handled_total",
    "delivered_bytes": "tapd_subscriber_handled_bytes_total",
    "dropped": "tapd_subscriber_taps_dropped_total",
    "errors": "tapd_subscriber_handler_errors_total",
    "queued": "tapd_subscriber_queued_taps",
    "in_flight": "tapd_subscriber_in_flight_taps",
    "held_bytes": "tapd_subscriber_held_bytes",
    "spooled": "tapd_subscriber_spooled_taps",
    "spool_bytes": "tapd_subscriber_spool_bytes",
    "last_handled_time": "tapd_last_handled_tap_timestamp_seconds",
}
# Labels are bounded by peers: anything else (a seq, a step, a tid) would grow per tap.
BOUNDED_LABELS = {"daemon", "pid", "reason", "emitter", "subscriber", "consumers", "ring",
                  "group"}  # fmt: skip

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[list[Any], Samples]:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    families = list(prometheus_parser.text_string_to_metric_families(text))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}
    return families, samples


def status_json(daemon: Daemon) -> dict[str, Any]:
    result = tapd_cmd("status", "--json", "--endpoint", daemon.endpoint)
    assert result.returncode == 0, result.stderr
    stats: dict[str, Any] = json.loads(result.stdout)
    stats.pop("time")  # when it answered: the one field that changes by itself
    return stats


def test_scrape_equals_status(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon("--metrics", "127.0.0.1:0")
    url = daemon.stats()["metrics"]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    assert f"serving Prometheus metrics at {url}" in daemon.log()
    start_subscriber(daemon, "loss")
    start_subscriber(daemon, "loss", raise_on="loss")  # handler errors, counted
    started = time.time()
    # An emitter that stays connected after its taps, so that it is in the stats too.
    emitter = subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), "taps_then_hang", str(TAPS)],
        env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint}, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert emitter.stdout is not None and emitter.stdout.readline() == "TAPPED\n"
        tapped = time.time()

        def settled() -> dict[str, Any] | None:
            stats = daemon.stats()
            done = [s["delivered"] for s in stats["subscribers"]] == [TAPS, TAPS] and all(
                e["pending"] == 0 for e in stats["emitters"]
            )
            return stats if done and stats["emitters"] else None

        wait_until(settled, "every tap handled by both subscribers")
        before = status_json(daemon)
        families, samples = scrape(url)
        after = status_json(daemon)
        assert before == after, "the daemon was not quiescent around the scrape"
    finally:
        stop_process(emitter)
    stats = before

    def value(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in samples, f"no sample {name}{labels} in the scrape"
        return samples[key]

    counters = stats["counters"]
    assert counters["taps_received"] == TAPS and counters["handler_errors"] == TAPS
    for key, count in counters.items():
        assert key in COUNTERS, f"status counter {key!r} is not checked by this test"
        assert value(COUNTERS[key]) == count, key
    assert value("tapd_emitters") == len(stats["emitters"]) == 1
    assert value("tapd_subscribers") == len(stats["subscribers"]) == 2
    assert value("tapd_queue_limit_bytes") == stats["queue_bytes"]
    assert value("tapd_daemon_info", daemon=stats["daemon"], pid=str(stats["pid"])) == 1
    for e in stats["emitters"]:
        for key, name in EMITTER.items():
            assert value(name, emitter=e["name"]) == e[key], (name, e)
        assert started <= e["last_handled_time"] <= tapped
    for s in stats["subscribers"]:
        labels = {"subscriber": s["name"], "consumers": ",".join(s["consumers"])}
        for key, name in SUBSCRIBER.items():
            assert value(name, **labels) == s[key], (name, s)
        # meta.time of the last tap handled: one of this emitter's, by this host's clock
        assert started <= s["last_handled_time"] <= tapped
    for ring in stats["rings"]:
        label = {"ring": Path(ring["path"]).name}
        assert value("tapd_ring_taps_written_total", **label) == ring["taps"]
        assert value("tapd_ring_committed_bytes_total", **label) == ring["committed"]
        assert value("tapd_ring_released_bytes_total", **label) == ring["released"]
        assert value("tapd_ring_capacity_bytes", **label) == ring["capacity"]

    for family in families:
        assert family.name.startswith("tapd_"), family.name
        assert family.documentation, f"{family.name} has no HELP text"
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == family.name + "_total", sample.name
            assert set(sample.labels) <= BOUNDED_LABELS, sample
    gauges = {f.name for f in families if f.type == "gauge"}
    assert not any(name.endswith("_total") for name in gauges), gauges


def test_port_in_use(runtime_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = tapd_cmd(
            "start", "--endpoint", f"ipc://{runtime_dir}/tapd.sock",
            "--pidfile", str(runtime_dir / "pid"), "--metrics", f"127.0.0.1:{port}",
        )  # fmt: skip
    assert result.returncode == 1, result  # ExitCode.FAILURE, not "already running" (5)
    assert f"--metrics 127.0.0.1:{port}: cannot listen there: port {port} is in use" in (
        result.stderr
    )
    assert not (runtime_dir / "tapd.sock").exists()  # the daemon's socket closed again


def test_bad_address_and_help(runtime_dir: Path) -> None:
    result = tapd_cmd("start", "--endpoint", f"ipc://{runtime_dir}/tapd.sock",
                      "--metrics", "localhost")  # fmt: skip
    assert result.returncode == 4, result  # ExitCode.CONFIG
    assert "--metrics 'localhost' is not HOST:PORT" in result.stderr
    help_text = " ".join(tapd_cmd("start", "--help").stdout.split())
    assert "--metrics HOST:PORT serve Prometheus metrics at http://HOST:PORT/metrics" in help_text


def test_without_prometheus_client(runtime_dir: Path) -> None:
    """A machine without the extra: the daemon says what to install, and exits."""
    code = (
        "import sys; sys.modules['prometheus_client'] = None  # as if not installed\n"
        "from tapd.cli.main import main; sys.exit(main(sys.argv[1:]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "start", "--endpoint", f"ipc://{runtime_dir}/tapd.sock",
         "--pidfile", str(runtime_dir / "pid"), "--metrics", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 4, result
    assert "needs the prometheus-client package: pip install 'tapd[metrics]'" in result.stderr
