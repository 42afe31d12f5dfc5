"""Forwarding under faults (issue 11): upstreams that start late, restart, or lose their
connection; forwarding daemons killed and restarted. Real daemons, emitters and
subscribers; each test counts, step by step, the taps delivered, duplicated and missing,
and checks that whatever is missing is what the emitter was told was lost."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from faultproxy import FaultProxy

from conftest import APPS, Daemon, SubscriberProcess, wait_until

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


@dataclasses.dataclass(frozen=True)
class Tally:
    """What a subscriber got of taps with steps 0..steps-1 (one tap per step)."""

    delivered: int  # steps that arrived at least once
    duplicated: int  # copies beyond the first
    missing: int  # steps that never arrived

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]], steps: int) -> Tally:
        seen = collections.Counter(r["step"] for r in records)
        assert set(seen) <= set(range(steps)), sorted(set(seen) - set(range(steps)))
        for r in records:  # a copy is the same tap: same seq
            assert r["seq"] == r["step"], r
        return cls(len(seen), sum(seen.values()) - len(seen), steps - len(seen))


def forward_stats(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.stats()["forward"])


def start_emitter(endpoint: str, scenario: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), scenario, *args],
        env={**os.environ, "TAPD_ENDPOINT": endpoint},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(emitter: subprocess.Popen[str], timeout: float = 90) -> dict[str, Any]:
    """Wait for the emitter; return its last JSON line (its stats)."""
    try:
        out, err = emitter.communicate(timeout=timeout)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    assert emitter.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    return result


# ---- 1. an upstream without a subscriber yet -------------------------------------------


def test_an_upstream_starting_late_before_its_subscriber_holds_the_backlog_for_it(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path, backend: str
) -> None:
    """The forwarding daemon first, 300 taps, then the upstream, then its subscriber: the
    upstream holds the forwarded backlog for its start-up grace instead of counting it
    as unrouted the moment it arrives."""
    steps = 300
    forwarder = start_daemon("--forward", f"ipc://{runtime_dir}/a.sock", name="b.sock")
    emitter = start_emitter(forwarder.endpoint, "steps", str(steps))
    try:
        wait_until(lambda: forward_stats(forwarder)["waiting"] == steps, "the taps waiting at B")
        upstream = start_daemon("--startup-grace", "20", name="a.sock")
        # Every tap reached the upstream before its subscriber exists.
        wait_until(lambda: upstream.counters().get("taps_received") == steps, "taps at A")
        far = start_subscriber(upstream, "loss")
        result = finish(emitter)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    assert Tally.of(far.records(), steps) == Tally(steps, 0, 0)
    stats = result["stats"]
    assert (stats["delivered"], stats["unrouted"], stats["daemon_dropped"]) == (steps, 0, 0)
    assert "taps_unrouted" not in upstream.counters()


def test_taps_the_upstream_had_no_subscriber_for_are_unrouted_for_the_emitter(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    """Delivered means an upstream subscriber handled it: taps nobody upstream wanted
    reach the emitter's counts as unrouted, not as delivered."""
    upstream = start_daemon(name="a.sock")  # no grace, and no subscriber for "loss"
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    other = start_subscriber(upstream, "other")
    emitter = start_emitter(forwarder.endpoint, "steps", "40")
    stats = finish(emitter)["stats"]
    assert (stats["delivered"], stats["unrouted"], stats["daemon_dropped"]) == (0, 40, 0)
    assert other.records() == []
    assert upstream.counters()["taps_unrouted"] == 40
    counters = forwarder.counters()
    assert counters["forward_upstream_unrouted"] == 40
    assert "forward_upstream_delivered" not in counters


# ---- 2 and 3. connections that drop, on both sides or on one -------------------------


@pytest.fixture
def tcp_pair(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> Iterator[tuple[Daemon, Daemon, FaultProxy, SubscriberProcess]]:
    """An upstream on tcp with a subscriber of "loss", and a forwarding daemon that
    reaches it through a FaultProxy."""
    upstream = start_daemon("--tcp", "tcp://127.0.0.1:0", "--insecure", name="a.sock")
    host, port = upstream.endpoints[1].removeprefix("tcp://").rsplit(":", 1)
    proxy = FaultProxy((host, int(port)))
    try:
        forwarder = start_daemon("--forward", proxy.endpoint, "--insecure", name="b.sock")
        far = start_subscriber(upstream, "loss")
        yield upstream, forwarder, proxy, far
    finally:
        proxy.close()


def of_emitter(records: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    return [r for r in records if r["emitter"].endswith(f":{pid}")]


def test_taps_lost_with_a_dropped_connection_are_sent_again_not_reported_as_errors(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess],
) -> None:
    _, forwarder, proxy, far = tcp_pair
    steps = 300
    emitter = start_emitter(forwarder.endpoint, "paced", str(steps), "5")
    try:
        wait_until(lambda: len(far.records()) >= 50, "taps through the proxy")
        proxy.pause()
        sent = forwarder.counters()["forward_sent"]
        wait_until(lambda: forwarder.counters()["forward_sent"] >= sent + 20, "taps in transit")
        proxy.cut()  # what was in transit is gone; the forwarder reconnects
        proxy.resume()
        result = finish(emitter)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    assert result["stats"]["delivered"] == steps and result["stats"]["errors"] == 0
    counters = forwarder.counters()
    assert counters["forward_resent"] >= 20 and "forward_lost" not in counters
    assert proxy.connections >= 2


@pytest.mark.parametrize("side", ["client", "upstream"])
def test_a_connection_reset_on_one_side_only_while_idle_heals(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess], side: str
) -> None:
    """One side of the forwarder's connection is reset and the other never hears of it:
    the upstream (side "client") or the forwarder (side "upstream") still holds the dead
    connection. Heartbeats find it dead, and a new connection takes over."""
    _, forwarder, proxy, far = tcp_pair
    first = start_emitter(forwarder.endpoint, "steps", "20")
    finish(first)
    proxy.cut_one_side(side)  # type: ignore[arg-type]
    second = start_emitter(forwarder.endpoint, "steps", "200")
    result = finish(second, timeout=40)
    tally = Tally.of(of_emitter(far.records(), second.pid), 200)
    assert (tally.delivered, tally.missing) == (200, 0), tally
    assert result["stats"]["delivered"] == 200


def test_a_connection_reset_on_the_forwarders_side_mid_stream_loses_nothing(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess],
) -> None:
    _, forwarder, proxy, far = tcp_pair
    steps = 300
    emitter = start_emitter(forwarder.endpoint, "paced", str(steps), "5")
    try:
        wait_until(lambda: len(far.records()) >= 50, "taps through the proxy")
        proxy.cut_one_side("client")
        result = finish(emitter, timeout=60)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    assert result["stats"]["delivered"] == steps and result["stats"]["errors"] == 0
