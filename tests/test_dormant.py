"""Dormant taps and sampling (issue 21), with real processes: a daemon, subscriber
processes, `tapd tail`, and a running JAX job (tests/apps/dormant_app.py) that taps
"acts" (every step), "sampled" (`every=3`) and an id_tap function each step.

A site no one takes is dormant: the emitter copies nothing and counts it `skipped`; a
subscriber (or `tapd tail`) that starts wakes it, and its leaving (or its death) makes
it dormant again. The counts add up exactly: skipped + delivered + unrouted is what ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    APPS,
    PROCESS_TIMEOUT,
    Daemon,
    SubscriberProcess,
    native_unavailable,
    stop_process,
    tapd_cmd,
    wait_until,
)
from tapd.protocol.ring_format import EVERY_ALL, EVERY_DORMANT
from tapd_client import Subscriber

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))
SAMPLE_EVERY = 3  # dormant_app.py's "sampled" site: tap(..., every=3)
TAPS_PER_STEP = 3  # acts, sampled, and the id_tap function's


class Job:
    """tests/apps/dormant_app.py: a JAX job that runs steps when told."""

    def __init__(
        self, endpoint: str, env: dict[str, str] | None = None, backend: str = "native"
    ) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(APPS / "dormant_app.py")],
            env={**os.environ, "TAPD_ENDPOINT": endpoint, "TAPD_BACKEND": backend, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = self.read()
        assert first.get("backend") == backend, first

    def read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("{"), f"the job said {line!r} (exit {self.process.poll()})"
        result: dict[str, Any] = json.loads(line)
        return result

    def start(self, steps: int) -> None:
        """Run `steps` more steps; `read()` says when they are done."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"run {steps}\n")
        self.process.stdin.flush()

    def run(self, steps: int) -> dict[str, Any]:
        """Run `steps` more steps (and barrier_wait); its stats after them."""
        self.start(steps)
        return self.read()

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.poll() is None:
            self.process.stdin.write("quit\n")
        self.process.stdin.close()
        self.process.wait(timeout=PROCESS_TIMEOUT)
        self.process.stdout.close()


@pytest.fixture
def start_job() -> Iterator[Callable[..., Job]]:
    jobs: list[Job] = []

    def start(daemon: Daemon, env: dict[str, str] | None = None, backend: str = "native") -> Job:
        jobs.append(Job(daemon.endpoint, env, backend))
        return jobs[-1]

    yield start
    for job in jobs:
        try:
            job.close()
        finally:
            if job.process.poll() is None:
                job.process.kill()


def site_every(daemon: Daemon, consumer: str) -> int | None:
    """N the daemon wrote for `consumer`'s site (None: not known there yet)."""
    for sites in daemon.stats()["wants"].values():
        for _, name, every in sites:
            if name == consumer:
                return int(every)
    return None


def wait_every(daemon: Daemon, consumer: str, every: int) -> None:
    wait_until(lambda: site_every(daemon, consumer) == every, f"{consumer} at every={every}")


def skipped_of(daemon: Daemon, consumer: str) -> int:
    return sum(r["skipped_by_consumer"].get(consumer, 0) for r in daemon.stats()["rings"])


def acts_seqs(subscriber: SubscriberProcess, consumer: str = "acts") -> list[int]:
    return sorted(r["seq"] for r in subscriber.records() if r["consumer"] == consumer)


@pytest.fixture
def start_sampling_subscriber(runtime_dir: Path) -> Iterator[Callable[..., SubscriberProcess]]:
    """tests/apps/subscriber_app.py with `--every`, connected; stopped after the test."""
    started: list[subprocess.Popen[str]] = []

    def start(daemon: Daemon, every: int, *consumers: str) -> SubscriberProcess:
        record = runtime_dir / f"every{len(started)}.jsonl"
        before = daemon.subscriber_count()
        process = subprocess.Popen(
            [sys.executable, str(APPS / "subscriber_app.py"), "--endpoint", daemon.endpoint,
             "--record", str(record), "--every", str(every), *consumers], text=True,
        )  # fmt: skip
        started.append(process)
        wait_until(
            lambda: daemon.subscriber_count() > before or process.poll() is not None,
            "the sampling subscriber to connect",
        )
        assert process.poll() is None
        return SubscriberProcess(process, record)

    yield start
    for process in started:
        stop_process(process)


def exact_counts(stats: dict[str, Any], steps: int) -> None:
    """Every tap that ran is skipped, delivered or unrouted: exactly, none dropped."""
    assert stats["dropped"] == 0, stats
    total = stats["skipped"] + stats["delivered"] + stats["unrouted"]
    assert total == TAPS_PER_STEP * steps, stats


@pytest.mark.parametrize("backend", ["native", "portable"])
def test_a_site_sleeps_without_a_taker_wakes_for_a_subscriber_and_sleeps_when_it_leaves(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_job: Callable[..., Job],
    backend: str,
) -> None:
    """Both backends write the ring here (the portable one from its callback)."""
    daemon = start_daemon()
    job = start_job(daemon, backend=backend)
    first = job.run(2)  # the daemon learns the sites from their first taps
    wait_every(daemon, "acts", EVERY_DORMANT)
    wait_every(daemon, "sampled", EVERY_DORMANT)
    skipped = skipped_of(daemon, "acts")
    dormant = job.run(10)
    # dormant: nothing copied, each counted skipped; barrier_wait returned all the same,
    # and the id_tap function ran every step (its site is always taken)
    assert skipped_of(daemon, "acts") == skipped + 10
    assert dormant["stats"]["skipped"] >= first["stats"]["skipped"] + 10
    assert dormant["id_tap_calls"] == 12
    exact_counts(dormant["stats"], 12)

    writes = daemon.stats()["site_slot_writes"]
    subscriber = start_subscriber(daemon, "acts")
    wait_every(daemon, "acts", 1)
    assert daemon.stats()["site_slot_writes"] == writes + 1  # acts' slot, and only it
    woken = job.run(10)
    wait_until(lambda: len(acts_seqs(subscriber)) == 10, "10 taps of acts")
    assert daemon.stats()["site_slot_writes"] == writes + 1  # taps and acks change nothing
    assert acts_seqs(subscriber) == list(range(12, 22))  # seq counts every execution
    assert skipped_of(daemon, "acts") == skipped + 10
    exact_counts(woken["stats"], 22)

    stop_process(subscriber.process)  # it says bye
    wait_every(daemon, "acts", EVERY_DORMANT)
    again = job.run(10)
    assert skipped_of(daemon, "acts") == skipped + 20
    assert again["id_tap_calls"] == 32
    exact_counts(again["stats"], 32)
    assert daemon.counters().get("taps_skipped", 0) >= 20


def test_a_killed_subscriber_makes_its_sites_dormant_again(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_job: Callable[..., Job],
) -> None:
    daemon = start_daemon("--subscriber-timeout", "1")
    job = start_job(daemon)
    job.run(1)
    subscriber = start_subscriber(daemon, "acts")
    wait_every(daemon, "acts", 1)
    job.run(3)
    wait_until(lambda: len(acts_seqs(subscriber)) == 3, "3 taps of acts")
    subscriber.process.send_signal(signal.SIGKILL)
    subscriber.process.wait(timeout=PROCESS_TIMEOUT)
    wait_every(daemon, "acts", EVERY_DORMANT)  # found silent, dropped: no taker left
    skipped = skipped_of(daemon, "acts")
    stats = job.run(5)["stats"]
    assert skipped_of(daemon, "acts") == skipped + 5
    exact_counts(stats, 9)


def test_tapd_tail_attaches_to_a_running_job(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    daemon = start_daemon()
    job = start_job(daemon)
    job.run(2)
    wait_every(daemon, "acts", EVERY_DORMANT)
    status = tapd_cmd("status", "--endpoint", daemon.endpoint)
    assert "acts dormant" in status.stdout and "taps_skipped=" in status.stdout, status.stdout
    tail = subprocess.Popen(
        [sys.executable, "-m", "tapd", "tail", "acts", "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert tail.stdout is not None
        assert tail.stdout.readline().startswith("subscribed to acts")
        wait_every(daemon, "acts", 1)
        job.run(3)
        lines = [tail.stdout.readline() for _ in range(3)]
        assert [line.split("#")[1].split()[0] for line in lines] == ["2", "3", "4"], lines
        assert all("acts:" in line for line in lines)
    finally:
        stop_process(tail)
        assert tail.stdout is not None
        tail.stdout.close()
    wait_every(daemon, "acts", EVERY_DORMANT)


def test_every_on_the_subscriber_side_and_combined_with_the_sites_own(
    start_daemon: Callable[..., Daemon],
    start_job: Callable[..., Job],
    start_sampling_subscriber: Callable[..., SubscriberProcess],
) -> None:
    daemon = start_daemon()
    job = start_job(daemon)
    job.run(1)
    fours = start_sampling_subscriber(daemon, 4, "acts", "sampled")
    wait_every(daemon, "acts", 4)
    wait_every(daemon, "sampled", 4)  # the emitter copies seq % (3 * 4) == 0
    skipped = skipped_of(daemon, "acts"), skipped_of(daemon, "sampled")
    job.run(24)  # steps 1..24
    wait_until(lambda: len(acts_seqs(fours)) == 6, "acts at 4, 8, ..., 24")
    assert acts_seqs(fours) == [4, 8, 12, 16, 20, 24]
    wait_until(lambda: acts_seqs(fours, "sampled") == [12, 24], "sampled at 12 and 24")
    assert skipped_of(daemon, "acts") == skipped[0] + 18  # never copied, not thinned here
    assert skipped_of(daemon, "sampled") == skipped[1] + 22

    # Two takers: every=4 and every=6 make N = 2; each still gets only its own.
    sixes = start_sampling_subscriber(daemon, 6, "acts")
    wait_every(daemon, "acts", 2)
    thinned = daemon.counters().get("taps_thinned", 0)
    stats = job.run(12)["stats"]  # steps 25..36
    wait_until(lambda: acts_seqs(sixes) == [30, 36], "acts at 30 and 36 for every=6")
    wait_until(lambda: acts_seqs(fours)[6:] == [28, 32, 36], "acts at 28, 32, 36 for every=4")
    # copied: 26, 28, ..., 36 (6); 26 and 34 went to neither: thinned, unrouted
    assert daemon.counters()["taps_thinned"] == thinned + 2
    assert skipped_of(daemon, "acts") == skipped[0] + 18 + 6
    exact_counts(stats, 37)


def test_the_startup_grace_keeps_every_site_wanted(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_job: Callable[..., Job],
) -> None:
    first = start_daemon()
    job = start_job(first)
    skipped = job.run(2)["stats"]["skipped"]
    wait_every(first, "acts", EVERY_DORMANT)
    first.process.send_signal(signal.SIGKILL)  # no clean exit: its slots stay dormant
    first.process.wait(timeout=PROCESS_TIMEOUT)
    second = start_daemon("--startup-grace", "5")
    assert site_every(second, "acts") in (None, EVERY_ALL)
    job.start(4)  # in the grace, before any subscriber: copied all the same
    subscriber = start_subscriber(second, "acts")
    stats = job.read()["stats"]
    wait_until(lambda: acts_seqs(subscriber) == [2, 3, 4, 5], "the taps of the grace")
    assert stats["skipped"] == skipped + 3  # "sampled" (every=3) at seqs 2, 4, 5 only
    wait_every(second, "acts", 1)
    wait_every(second, "sampled", EVERY_DORMANT)


def test_a_forwarders_sites_wake_for_a_subscriber_upstream(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_job: Callable[..., Job],
) -> None:
    upstream = start_daemon(name="up.sock")
    downstream = start_daemon("--forward", upstream.endpoint, name="down.sock")
    wait_until(lambda: downstream.stats()["forward"]["upstream"], "the upstream's welcome")
    job = start_job(downstream)
    job.run(1)
    wait_every(downstream, "acts", EVERY_DORMANT)  # the upstream has no taker either
    subscriber = start_subscriber(upstream, "acts")
    wait_every(downstream, "acts", 1)
    job.run(4)
    wait_until(lambda: acts_seqs(subscriber) == [1, 2, 3, 4], "acts, forwarded")
    assert site_every(downstream, "sampled") == EVERY_DORMANT
    stop_process(subscriber.process)
    wait_every(downstream, "acts", EVERY_DORMANT)
    # An upstream that stops cleanly says "everything": taps wait here for the next one.
    upstream.stop()
    wait_every(downstream, "acts", 1)
    wait_every(downstream, "sampled", 1)


def test_a_forwarder_sends_upstream_only_what_its_takers_want(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_job: Callable[..., Job],
) -> None:
    """A site woken by a taker on the forwarding host alone ("sampled", and the id_tap
    function's taps, which run in the job) is not sent upstream, where no one wants
    it: the upstream receives the taps its subscriber takes, and nothing to discard."""
    upstream = start_daemon(name="up.sock")
    downstream = start_daemon("--forward", upstream.endpoint, name="down.sock")
    wait_until(lambda: downstream.stats()["forward"]["upstream"], "the upstream's welcome")
    far = start_subscriber(upstream, "acts")
    near = start_subscriber(downstream, "sampled")
    job = start_job(downstream)
    job.run(1)  # (compiles: the sites exist from here on)
    wait_every(downstream, "acts", 1)
    wait_every(downstream, "sampled", 1)
    wait_until(lambda: len(acts_seqs(far)) == 1, "the first acts, forwarded")
    before = upstream.counters()
    steps = 2 * SAMPLE_EVERY
    job.run(steps)
    wait_until(lambda: len(acts_seqs(far)) == 1 + steps, "acts, forwarded")
    wait_until(lambda: len(acts_seqs(near, "sampled")) >= 2, "sampled, taken here")
    counters = upstream.counters()
    assert counters["taps_received"] - before["taps_received"] == steps, counters
    assert counters.get("taps_unrouted", 0) == 0, counters
    assert {r["consumer"] for r in far.records()} == {"acts"}


def test_a_clean_exit_gives_every_slot_back(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    """A daemon that stops cleanly writes EVERY_ALL back: the job, alone, sends every
    tap (for the next daemon) instead of skipping what nobody took from the last one."""
    from tapd.native.ring import Ring

    daemon = start_daemon()
    job = start_job(daemon)
    job.run(1)
    wait_every(daemon, "acts", EVERY_DORMANT)
    (path, sites), *_ = daemon.stats()["wants"].items()
    acts = next(site for site, consumer, _ in sites if consumer == "acts")
    ring = Ring.open(Path(path))
    try:
        assert ring.site_every(acts) == EVERY_DORMANT
        assert daemon.stop() == 0
        assert ring.site_every(acts) == EVERY_ALL
    finally:
        ring.close()


def test_dormancy_off_at_the_daemon_sends_every_tap(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    daemon = start_daemon("--no-dormant")
    job = start_job(daemon)
    stats = job.run(6)["stats"]
    assert site_every(daemon, "acts") == EVERY_ALL
    assert skipped_of(daemon, "acts") == 0
    assert stats["unrouted"] >= 6  # sent, and no one wanted them
    exact_counts(stats, 6)


def test_tapd_tail_every_takes_a_positive_int() -> None:
    for bad in ("0", "-3", "x", str(2**32 - 1)):
        result = tapd_cmd("tail", "acts", "--every", bad)
        assert result.returncode == 2 and "--every takes an int from 1" in result.stderr, bad


@pytest.mark.fast
def test_a_subscriber_handles_only_the_taps_it_sampled_even_when_sent_more() -> None:
    """A run parked before a sampling subscriber came is routed to it whole: its library
    drops what it did not ask for, by the daemon's rule seq % (K * n) == 0."""
    from tapd_client.sampling import Sampling

    sampling = Sampling()
    sampling.add("acts", 3)
    kept = [s for s in range(10) if sampling.keeps("acts", {"seq": s})]
    assert kept == [0, 3, 6, 9]
    kept = [s for s in range(13) if sampling.keeps("acts", {"seq": s, "every": 2})]
    assert kept == [0, 6, 12]
    assert all(sampling.keeps("loss", {"seq": s}) for s in range(5))  # asked no every


# A dormant computation's twin (tapd/emitter/dormant_twin.py) against the daemon: the job
# gathers its taps (TAPD_GATHER=on, the portable backend: the path a TPU takes), its step
# tapping "acts" alone.
GATHERED = {"TAPD_GATHER": "on", "DORMANT_APP_ACTS_ONLY": "1"}


def test_a_twin_serves_a_dormant_step_and_a_subscriber_woken_after_it_gets_every_tap(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    """The job's site no one takes: its step runs its twin, compiled without the tap. A
    subscriber that connects wakes the site, and its `connect()` returns only once the
    job has acknowledged the wake (tapd/daemon/wants.py), so that every step run after
    it reaches it (without that wait, the first was lost about one run in three); when
    it leaves, the twin serves again."""
    daemon = start_daemon()
    job = start_job(daemon, env=GATHERED, backend="portable")
    job.run(2)  # (the daemon learns the site from its first taps)
    wait_every(daemon, "acts", EVERY_DORMANT)
    skipped = skipped_of(daemon, "acts")
    dormant, steps = run_until_twin(job, 0)
    assert dormant["twin_calls"] > 0, dormant
    assert skipped_of(daemon, "acts") == skipped + steps

    seqs: list[int] = []
    subscriber = Subscriber(daemon.endpoint)
    subscriber.add_handler("acts", lambda value, meta: seqs.append(meta.seq))
    subscriber.connect()  # (returns once the job acknowledged the wake)
    try:
        job.start(10)  # (its barrier_wait waits for this subscriber: run below)
        deadline = time.monotonic() + 30
        subscriber.run(until=lambda: len(seqs) >= 10 or time.monotonic() > deadline)
        woken = job.read()
        first = 2 + steps
        assert seqs == list(range(first, first + 10))  # every step after the welcome
        assert woken["twin_calls"] == dormant["twin_calls"]  # (none since the wake)
    finally:
        subscriber.close()
    wait_every(daemon, "acts", EVERY_DORMANT)
    again, more = run_until_twin(job, woken["twin_calls"])
    assert again["twin_calls"] > woken["twin_calls"]
    assert skipped_of(daemon, "acts") == skipped + steps + more


def run_until_twin(job: Job, twin_calls: int) -> tuple[dict[str, Any], int]:
    """Steps, 100 at a time, until the twin has served more than `twin_calls` (it is
    compiled in the background: within seconds); the job's last line, and the steps."""
    steps, deadline = 0, time.monotonic() + 120
    while True:
        said = job.run(100)
        steps += 100
        if said["twin_calls"] > twin_calls or time.monotonic() > deadline:
            return said, steps


def twin_held_by_a_stopped_job(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job], ack_timeout: float
) -> tuple[Daemon, Job]:
    """A daemon (`--wake-ack-timeout ack_timeout`) and a job whose twin holds "acts",
    stopped (SIGSTOP): it cannot acknowledge a wake."""
    daemon = start_daemon("--wake-ack-timeout", str(ack_timeout))
    job = start_job(daemon, env=GATHERED, backend="portable")
    job.run(2)
    wait_every(daemon, "acts", EVERY_DORMANT)
    said, _ = run_until_twin(job, 0)
    assert said["twin_calls"] > 0, said
    job.process.send_signal(signal.SIGSTOP)
    return daemon, job


def connecting(daemon: Daemon, seqs: list[int]) -> tuple[Subscriber, threading.Thread]:
    """A subscriber of "acts" whose `connect()` runs in a thread (started)."""
    subscriber = Subscriber(daemon.endpoint)
    subscriber.add_handler("acts", lambda value, meta: seqs.append(meta.seq))
    thread = threading.Thread(target=subscriber.connect, daemon=True)
    thread.start()
    return subscriber, thread


def test_a_subscribers_welcome_waits_for_the_job_to_acknowledge_the_wake(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    """While the job cannot acknowledge the wake, the daemon says the site is dormant and
    holds the subscriber's welcome; continued, the job acknowledges, the welcome goes,
    and the steps it runs after it reach the subscriber, every one."""
    daemon, job = twin_held_by_a_stopped_job(start_daemon, start_job, 120.0)
    seqs: list[int] = []
    try:
        subscriber, thread = connecting(daemon, seqs)
        wait_until(lambda: daemon.subscriber_count() == 1, "the subscriber's hello")
        assert site_every(daemon, "acts") == EVERY_DORMANT  # (not acknowledged: not taken)
        assert thread.is_alive()  # (no welcome yet)
    finally:
        job.process.send_signal(signal.SIGCONT)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert site_every(daemon, "acts") == 1
    assert "did not acknowledge" not in daemon.log()
    try:
        job.start(10)
        deadline = time.monotonic() + 30
        subscriber.run(until=lambda: len(seqs) >= 10 or time.monotonic() > deadline)
        said = job.read()
        assert seqs == list(range(seqs[0], seqs[0] + 10)) and len(seqs) == 10
        assert seqs[-1] == said["steps"] - 1  # (the job's last ten steps)
    finally:
        subscriber.close()


def test_a_wake_a_stopped_job_cannot_acknowledge_is_waited_for_then_named_in_the_log(
    start_daemon: Callable[..., Daemon], start_job: Callable[..., Job]
) -> None:
    """No silent wait: past `--wake-ack-timeout` the daemon names the ring in its log and
    welcomes the subscriber."""
    daemon, job = twin_held_by_a_stopped_job(start_daemon, start_job, 0.5)
    seqs: list[int] = []
    try:
        started = time.monotonic()
        subscriber, thread = connecting(daemon, seqs)
        thread.join(timeout=60)
        assert not thread.is_alive()
        assert time.monotonic() - started >= 0.45
        assert "did not acknowledge the wake of acts within 0.5 s" in daemon.log()
        assert site_every(daemon, "acts") == 1
        subscriber.close()
    finally:
        job.process.send_signal(signal.SIGCONT)
