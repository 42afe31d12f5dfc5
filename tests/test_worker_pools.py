"""Worker pools (issue 12): the members of a group share its taps, each tap going to one
member, more to a member with free credit; a member killed mid-stream leaves its taps to
the others; barrier_wait counts each tap once for the group; subscribers outside the
group still get every tap. Real daemon, real member processes, real JAX emitters."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from conftest import (
    APPS,
    PROCESS_TIMEOUT,
    BackgroundEmitter,
    Daemon,
    keygen,
    run_emitter,
    tapd_cmd,
    wait_until,
)
from tapd.protocol import decode, encode


class Member:
    """tests/apps/pool_member_app.py: one JSON line per tap it handled."""

    def __init__(self, process: subprocess.Popen[str], record: Path, name: str) -> None:
        self.process = process
        self.record = record
        self.name = name

    def lines(self) -> list[dict[str, Any]]:
        text = self.record.read_text() if self.record.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.endswith("}")]

    def seqs(self) -> list[int]:
        return [line["seq"] for line in self.lines() if "seq" in line]

    def hung_at(self) -> int | None:
        return next((line["hung_at"] for line in self.lines() if "hung_at" in line), None)


@pytest.fixture
def start_member(runtime_dir: Path) -> Iterator[Callable[..., Member]]:
    started: list[Member] = []

    def start(daemon: Daemon, *consumers: str, group: str | None = "writers",
              window: int = 8, sleep_ms: float = 0, hang_after: int = -1,
              endpoint: str | None = None,
              env: dict[str, str] | None = None) -> Member:  # fmt: skip
        name = f"member{len(started)}"
        record = runtime_dir / f"{name}.jsonl"
        argv = [sys.executable, str(APPS / "pool_member_app.py"), "--endpoint",
                endpoint or daemon.endpoint, "--record", str(record), "--name", name,
                "--window", str(window), "--sleep-ms", str(sleep_ms),
                "--hang-after", str(hang_after),
                *(["--group", group] if group is not None else []), *consumers]  # fmt: skip
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, **(env or {})})  # fmt: skip
        member = Member(process, record, name)
        started.append(member)
        assert process.stdout is not None
        line = process.stdout.readline()  # after the daemon's welcome (or its exit)
        assert line.strip() == "CONNECTED", f"{name} did not connect: {line!r}"
        return member

    yield start
    for member in started:  # a hung member ignores SIGTERM: it is killed, unwaited for
        if member.process.poll() is None and member.hung_at() is not None:
            member.process.kill()
        if member.process.poll() is None:
            member.process.send_signal(signal.SIGTERM)
            try:
                member.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                member.process.kill()
                member.process.wait(timeout=PROCESS_TIMEOUT)
        if member.process.stdout is not None:
            member.process.stdout.close()


def group_stats(daemon: Daemon, name: str = "writers") -> dict[str, Any]:
    [group] = [g for g in daemon.stats()["groups"] if g["group"] == name]
    return group


def test_each_tap_goes_to_one_member_and_barrier_wait_counts_it_once(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member]
) -> None:
    daemon = start_daemon("--metrics", "127.0.0.1:0")
    members = [start_member(daemon, "loss", window=w, sleep_ms=5) for w in (8, 4, 16)]
    outsider = start_member(daemon, "loss", group=None)

    result = run_emitter(daemon.endpoint, "steps", "120")
    # barrier_wait has returned: every tap was handled, once, by the group (the records
    # are written before the ack), and by the outsider.
    handled = [seq for m in members for seq in m.seqs()]
    assert sorted(handled) == list(range(120))
    assert outsider.seqs() == list(range(120))
    assert sum(1 for m in members if m.seqs()) >= 2, [len(m.seqs()) for m in members]
    stats = result["stats"]
    assert (stats["delivered"], stats["dropped"], stats["unrouted"]) == (120, 0, 0)

    counters = daemon.counters()
    assert counters["deliveries_acked"] == 240  # 120 by the group, 120 by the outsider
    group = group_stats(daemon)
    assert group["members"] == sorted(m.name for m in members)
    assert (group["delivered"], group["queued"], group["in_flight"]) == (120, 0, 0)
    assert group["redelivered"] == 0
    member_stats = {s["name"]: s for s in daemon.stats()["subscribers"]}
    assert [member_stats[m.name]["delivered"] for m in members] == [len(m.seqs()) for m in members]
    assert member_stats[outsider.name]["group"] is None

    status = tapd_cmd("status", "--json", "--endpoint", daemon.endpoint)
    assert status.returncode == 0, status.stderr
    [shown] = json.loads(status.stdout)["groups"]
    assert shown["group"] == "writers" and len(shown["members"]) == 3

    top = tapd_cmd("top", "--once", "--interval", "0.2", "--endpoint", daemon.endpoint)
    [pool] = [line.split() for line in top.stdout.splitlines() if "pool:writers[3]" in line]
    assert pool[:2] == ["loss", "pool:writers[3]"] and pool[7] == "120", top.stdout

    # Prometheus: the pool's series, labelled by group and consumers, equal its stats.
    parser = pytest.importorskip("prometheus_client.parser")
    with urllib.request.urlopen(daemon.stats()["metrics"], timeout=10) as response:
        text = response.read().decode()
    samples = {s.name: s for f in parser.text_string_to_metric_families(text)
               for s in f.samples if s.labels.get("group") == "writers"}  # fmt: skip
    assert samples["tapd_group_taps_handled_total"].value == 120
    assert samples["tapd_group_taps_redelivered_total"].value == 0
    assert samples["tapd_group_members"].value == 3
    assert samples["tapd_group_queued_taps"].labels == {"group": "writers", "consumers": "loss"}


def test_a_slow_member_gets_fewer_taps(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member]
) -> None:
    daemon = start_daemon()
    fast = start_member(daemon, "loss")
    slow = start_member(daemon, "loss", sleep_ms=40)

    result = run_emitter(daemon.endpoint, "steps", "200")
    assert result["stats"]["delivered"] == 200
    assert sorted(fast.seqs() + slow.seqs()) == list(range(200))
    assert len(slow.seqs()) >= 1 and 4 * len(slow.seqs()) < len(fast.seqs()), (
        f"slow {len(slow.seqs())}, fast {len(fast.seqs())}"
    )


def test_the_taps_of_a_member_killed_mid_stream_go_to_another(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member]
) -> None:
    # Long enough that the hung member (no heartbeats) is still there when it is killed.
    daemon = start_daemon("--subscriber-timeout", "3")
    steady = start_member(daemon, "loss", sleep_ms=2)
    doomed = start_member(daemon, "loss", hang_after=2)  # then holds a tap, unacked
    outsider = start_member(daemon, "loss", group=None)

    emitter = BackgroundEmitter(daemon.endpoint, "paced", "150", "10")
    hung_at = wait_until(doomed.hung_at, "the doomed member to hang on a tap")
    in_flight = {s["name"]: s["in_flight"] for s in daemon.stats()["subscribers"]}
    assert in_flight.get(doomed.name, 0) >= 1, in_flight
    os.kill(doomed.process.pid, signal.SIGKILL)
    doomed.process.wait(timeout=PROCESS_TIMEOUT)
    assert emitter.is_alive(), "the stream ended before the kill: make it longer"

    stats = emitter.outcome()["stats"]  # its barrier_wait returned
    assert (stats["delivered"], stats["dropped"], stats["unrouted"]) == (150, 0, 0)
    # At least once: what the dead member did not acknowledge, the other handled.
    assert hung_at in steady.seqs()
    assert set(steady.seqs()) | set(doomed.seqs()) == set(range(150))
    assert outsider.seqs() == list(range(150))
    counters = daemon.counters()
    assert counters["deliveries_redelivered"] >= 1, counters
    assert counters.get("deliveries_lost", 0) == 0, counters
    group = group_stats(daemon)
    assert group["members"] == [steady.name]
    assert group["redelivered"] == counters["deliveries_redelivered"]
    # (found silent, or unreachable when the daemon sent it more)
    assert f"subscriber {doomed.name!r} of group 'writers' " in daemon.log()


def test_at_shutdown_a_groups_taps_are_lost_once_not_passed_around(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member]
) -> None:
    """The daemon stops while both members hold taps they have not acknowledged: the
    group's taps are counted lost once, not handed from member to member first."""
    daemon = start_daemon("--subscriber-timeout", "30", "--drain-timeout", "1")
    members = [start_member(daemon, "loss", hang_after=2) for _ in range(2)]
    emitter = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "taps_then_hang",
                                "20"], env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint},
                               stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        for member in members:
            wait_until(member.hung_at, f"{member.name} to hang on a tap")
        held = group_stats(daemon)["in_flight"] + group_stats(daemon)["queued"]
        assert held >= 2
        assert daemon.stop() == 0
    finally:
        emitter.kill()
        emitter.wait(timeout=PROCESS_TIMEOUT)
    log = daemon.log()
    assert "go to the other members" not in log, log
    assert "lost its last member" in log and "taps it had not processed are lost" in log, log


def test_a_member_over_curve_tcp_shares_a_group_with_a_local_one(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member], tmp_path: Path
) -> None:
    daemon_public, daemon_secret = keygen(tmp_path / "daemon", "daemon")
    remote_public, remote_secret = keygen(tmp_path / "remote", "remote")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "remote.key").write_text(remote_public.read_text())
    daemon = start_daemon("--tcp", "tcp://127.0.0.1:0", "--curve-secret-key",
                          str(daemon_secret), "--curve-allowed", str(allowed))  # fmt: skip
    local = start_member(daemon, "loss", sleep_ms=2)
    remote = start_member(daemon, "loss", sleep_ms=2, endpoint=daemon.endpoints[1],
                          env={"TAPD_CURVE_SERVER_KEY": str(daemon_public),
                               "TAPD_CURVE_SECRET": str(remote_secret)})  # fmt: skip

    result = run_emitter(daemon.endpoint, "steps", "60")
    assert result["stats"]["delivered"] == 60
    assert sorted(local.seqs() + remote.seqs()) == list(range(60))
    assert local.seqs() and remote.seqs()
    assert group_stats(daemon)["members"] == sorted([local.name, remote.name])


def test_other_consumers_make_another_group_and_bad_names_are_refused(
    start_daemon: Callable[..., Daemon], raw_peer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    daemon = start_daemon()
    for consumers in (["loss"], ["loss", "grads"], ["grads", "loss"]):
        sock = raw_peer(daemon.endpoint)
        sock.send_multipart(encode("hello", {"role": "subscriber", "consumers": consumers,
                                             "window": 4, "group": "writers"}))  # fmt: skip
        assert decode(sock.recv_multipart()).kind == "welcome"
    groups = daemon.stats()["groups"]
    assert sorted((g["consumers"], len(g["members"])) for g in groups) == [
        (["grads", "loss"], 2),  # the same set in another order: the same group
        (["loss"], 1),
    ]

    for group, reason in (("", "bad_field"), ("w" * 257, "too_large"), (7, "bad_field")):
        sock = raw_peer(daemon.endpoint)
        before = daemon.counters().get(f"rejected_{reason}", 0)
        sock.send_multipart(encode("hello", {"role": "subscriber", "consumers": ["loss"],
                                             "window": 4, "group": group}))  # fmt: skip
        wait_until(lambda r=reason, b=before: daemon.counters().get(f"rejected_{r}", 0) > b,
                   f"the group name {group!r:.20} refused as {reason}")  # fmt: skip
    assert len(daemon.stats()["groups"]) == 2


def test_a_group_spools_under_the_spool_policy_and_loses_nothing(
    start_daemon: Callable[..., Daemon], start_member: Callable[..., Member], tmp_path: Path
) -> None:
    daemon = start_daemon("--policy", "spool", "--spool-dir", str(tmp_path / "spool"),
                          "--queue-bytes", "400")  # fmt: skip
    members = [start_member(daemon, "loss", sleep_ms=3) for _ in range(2)]

    result = run_emitter(daemon.endpoint, "steps", "200")
    assert result["stats"]["delivered"] == 200
    assert sorted(members[0].seqs() + members[1].seqs()) == list(range(200))
    counters = daemon.counters()
    assert counters["taps_spooled"] > 0, counters  # the group's queue was full: it spooled
    assert counters["taps_unspooled"] == counters["taps_spooled"]
    group = group_stats(daemon)
    assert (group["spooled"], group["spool_bytes"], group["queued"]) == (0, 0, 0)


def test_tapd_tail_group_members_share_the_taps(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    tails = [
        subprocess.Popen([sys.executable, "-m", "tapd", "tail", "--endpoint", daemon.endpoint,
                          "--group", "watchers", "loss"], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]  # fmt: skip
    try:
        wait_until(lambda: [len(g["members"]) for g in daemon.stats()["groups"]] == [2],
                   "both tails to join the group")  # fmt: skip
        run_emitter(daemon.endpoint, "steps", "20")
    finally:
        outputs = []
        for tail in tails:
            tail.send_signal(signal.SIGINT)
            outputs.append(tail.communicate(timeout=PROCESS_TIMEOUT)[0])
    seqs = [int(line.split("#")[1].split()[0].rstrip("]")) for out in outputs
            for line in out.splitlines() if line.startswith("[")]  # fmt: skip
    assert sorted(seqs) == list(range(20)), outputs
