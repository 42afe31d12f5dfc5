"""A real multi-process JAX job: 2 processes (jax.distributed on CPU, 4 devices each,
cross-process collectives over gloo), each tapping into its own host's daemon, and one
subscriber that follows both daemons and receives every shard. Once on loopback, and
once with the hosts made real as network namespaces joined by a veth pair, the
subscriber reaching both daemons over CurveZMQ tcp."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tally import Tally, finish, start_emitter

from conftest import APPS, Daemon, SubscriberProcess, wait_until
from tapd.clients import control
from tapd.emitter.jax_compat import cpu_partition_id_in_branches

pytestmark = pytest.mark.usefixtures("backend")
STEPS = 3


def run_job(
    endpoints: list[str],
    coordinator: str,
    prefixes: list[list[str]],
    env: dict[str, str] | None = None,
) -> list[str]:
    """Run the 2-process job, process i tapping into endpoints[i] (its command prefixed
    by prefixes[i], e.g. `ip netns exec HOST`), with `env` added; return each process's
    stdout."""
    jobs = [
        subprocess.Popen(
            [
                *prefix,
                sys.executable,
                str(APPS / "emitter_app.py"),
                "multihost",
                str(index),
                coordinator,
                str(STEPS),
            ],
            env={
                **os.environ,
                "TAPD_ENDPOINT": endpoint,
                "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                **(env or {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, (endpoint, prefix) in enumerate(zip(endpoints, prefixes, strict=True))
    ]
    outputs = [job.communicate(timeout=180) for job in jobs]
    for job, (_, err) in zip(jobs, outputs, strict=True):
        assert job.returncode == 0, err[-3000:]
    return [out for out, _ in outputs]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.waits
def test_two_process_job_taps_reach_one_subscriber_from_both_hosts(
    start_daemon: Callable[..., Daemon], runtime_dir: Path, backend: str
) -> None:
    hosts = [start_daemon(name="host0.sock"), start_daemon(name="host1.sock")]
    record = runtime_dir / "all.jsonl"
    follow = [arg for host in hosts for arg in ("--endpoint", host.endpoint)]
    assembled = runtime_dir / "assembled.jsonl"
    subscriber = subprocess.Popen([sys.executable, str(APPS / "subscriber_app.py"), *follow,
                                   "--record", str(record), "multihost"])  # fmt: skip
    assembler = subprocess.Popen([sys.executable, str(APPS / "subscriber_app.py"), *follow,
                                  "--record", str(assembled), "--assemble",
                                  "multihost"])  # fmt: skip
    try:
        wait_until(lambda: all(h.subscriber_count() == 2 for h in hosts), "the subscribers")
        coordinator = f"127.0.0.1:{free_port()}"
        outputs = run_job([h.endpoint for h in hosts], coordinator, [[], []])
        results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
        records = [json.loads(line) for line in record.read_text().splitlines()]
        global_steps = [json.loads(line) for line in assembled.read_text().splitlines()]
    finally:
        for process in (subscriber, assembler):
            process.terminate()
            process.wait(timeout=30)

    # The assembling subscriber got each step once, as the global (8-shard) value, each
    # shard placed by the pmap coordinates its tap carried.
    assert sorted(g["step"] for g in global_steps) == list(range(STEPS))
    for g in global_steps:
        assert g["value"]["shard"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0]
        assert [(p, s) for p, _, s in g["shards"]] == [(p, 4 * p + d) for p in (0, 1)
                                                      for d in range(4)]  # fmt: skip
    expected_total = sum(range(4)) + sum(range(10, 14))  # psum over all 8 devices
    for result in results:
        assert result["devices"] == 8 and result["backend"] == backend
        assert result["totals"] == [[float(expected_total)] * 4] * STEPS
    assert len(records) == 2 * 4 * STEPS  # one tap per device per step, both hosts
    assert {r["process"] for r in records} == {0, 1}
    for process in (0, 1):
        mine = [r for r in records if r["process"] == process]
        shards = sorted(r["value"]["shard"] for r in mine if r["step"] == 0)
        assert shards == [10.0 * process + d for d in range(4)]
        # pmap's shard metadata: global position on the 8-device axis, global shapes.
        step0 = sorted((r["shard_index"], r["value"]["shard"]) for r in mine if r["step"] == 0)
        assert step0 == [(4 * process + d, 10.0 * process + d) for d in range(4)]
        assert all(r["global_shapes"] == [[8], [8]] for r in mine)  # "shard", "total"
        assert all(r["mesh_coords"] == {"devices": r["shard_index"]} for r in mine)
        assert all(r["value"]["total"] == expected_total for r in mine)
        if backend == "native":  # each device's taps in order, from its own handler call
            devices = sorted({r["device"] for r in mine})
            assert len(devices) == 4, devices
            for device in devices:
                steps = [r["step"] for r in mine if r["device"] == device]
                assert steps == list(range(STEPS))


@pytest.mark.waits
def test_two_process_job_gathered_on_each_device_reaches_one_subscriber(
    start_daemon: Callable[..., Daemon], runtime_dir: Path, backend: str
) -> None:
    """The same job gathered (TAPD_GATHER=on, what a TPU slice gets; issue 50), its step
    tapping three times: each process moves its own devices' logs, as their shards of
    the step's output (no host callback, where the per-tap path runs one a tap, three a
    device a step), and the subscriber gets every
    host's taps, tagged by process, device and shard, each device's in program order."""
    if backend != "portable":
        pytest.skip("the gathered path replaces host callbacks: the portable backend's")
    if not cpu_partition_id_in_branches():
        pytest.skip(
            "this JAX gathers no slice on its CPU (jax_compat.cpu_partition_id_in_branches)"
        )
    repeats = 3
    hosts = [start_daemon(name="host0.sock"), start_daemon(name="host1.sock")]
    record = runtime_dir / "all.jsonl"
    follow = [arg for host in hosts for arg in ("--endpoint", host.endpoint)]
    subscriber = subprocess.Popen([sys.executable, str(APPS / "subscriber_app.py"), *follow,
                                   "--record", str(record), "multihost"])  # fmt: skip
    try:
        wait_until(lambda: all(h.subscriber_count() == 1 for h in hosts), "the subscriber")
        coordinator = f"127.0.0.1:{free_port()}"
        env = {"TAPD_GATHER": "on", "MULTIHOST_TAPS_A_STEP": str(repeats)}
        outputs = run_job([h.endpoint for h in hosts], coordinator, [[], []], env)
        results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
        expected = 2 * 4 * STEPS * repeats
        wait_until(lambda: len(record.read_text().splitlines()) >= expected, "every tap")
        records = [json.loads(line) for line in record.read_text().splitlines()]
    finally:
        subscriber.terminate()
        subscriber.wait(timeout=30)

    expected_total = sum(range(4)) + sum(range(10, 14))
    assert len(records) == expected
    for result in results:
        assert result["totals"] == [[float(expected_total)] * 4] * STEPS
        # No host callback (each device's log leaves as its shard of the output), where
        # the per-tap path runs one a tap.
        assert result["stats"]["host_callbacks"] == 0
    for process in (0, 1):
        mine = [r for r in records if r["process"] == process]
        assert len(mine) == 4 * STEPS * repeats
        assert sorted({r["shard_index"] for r in mine}) == [4 * process + d for d in range(4)]
        for index in range(4 * process, 4 * process + 4):
            device = [r for r in mine if r["shard_index"] == index]
            shard = 10.0 * process + index - 4 * process
            # In program order: step by step, the step's three taps in turn.
            assert [(r["step"], r["value"]["shard"]) for r in device] == [
                (step, shard + 100.0 * k) for step in range(STEPS) for k in range(repeats)
            ]
            assert [r["seq"] for r in device] == list(range(STEPS * repeats))
            assert all(r["value"]["total"] == expected_total for r in device)


# ---- the same job across network namespaces: two real hosts on one machine ----------


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str]]]:
    """Two network namespaces joined by a veth pair: [(namespace, address), ...].
    Made and removed here; skips, saying why, where namespaces cannot be made."""
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` to make network namespaces")
    tag = secrets.token_hex(3)
    hosts = [(f"tapd{tag}a", "10.213.7.1"), (f"tapd{tag}b", "10.213.7.2")]
    made = _ip("netns", "add", hosts[0][0])
    if made.returncode != 0:
        pytest.skip(f"needs permission to create network namespaces: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", hosts[1][0]),
            ("link", "add", f"v{tag}a", "netns", hosts[0][0], "type", "veth",
             "peer", "name", f"v{tag}b", "netns", hosts[1][0]),
        ]  # fmt: skip
        for (namespace, address), device in zip(hosts, (f"v{tag}a", f"v{tag}b"), strict=True):
            steps += [
                ("-n", namespace, "addr", "add", f"{address}/24", "dev", device),
                ("-n", namespace, "link", "set", device, "up"),
                ("-n", namespace, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = _ip(*step)
            assert result.returncode == 0, f"ip {' '.join(step)}: {result.stderr}"
        for namespace, address in hosts:
            # `ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts: inside each
            # namespace this machine's name resolves to that host's own address, which
            # is what gloo advertises to the other process.
            etc = Path("/etc/netns") / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        yield hosts
    finally:
        for namespace, _ in hosts:
            _ip("netns", "del", namespace)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)


def _in(namespace: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, *argv]


@pytest.mark.waits
def test_two_hosts_in_network_namespaces_over_curve_tcp(
    two_hosts: list[tuple[str, str]], runtime_dir: Path, tmp_path: Path, backend: str
) -> None:
    keys = tmp_path / "keys"
    for name in ("daemon", "watcher"):
        subprocess.run([sys.executable, "-m", "tapd", "keygen", name, "--dir", str(keys)],
                       check=True, capture_output=True)  # fmt: skip
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(keys / "watcher.key", allowed / "watcher.key")
    processes: list[subprocess.Popen[str]] = []
    try:
        daemons = []
        for index, (namespace, address) in enumerate(two_hosts):
            local = f"ipc://{runtime_dir}/h{index}.sock"
            daemon = subprocess.Popen(
                _in(namespace, sys.executable, "-m", "tapd", "start", "--endpoint", local,
                    "--pidfile", str(runtime_dir / f"h{index}.pid"), "--startup-grace", "0",
                    "--tcp", f"tcp://{address}:5555", "--curve-secret-key",
                    str(keys / "daemon.key_secret"), "--curve-allowed", str(allowed)),
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            processes.append(daemon)
            assert daemon.stdout is not None
            assert daemon.stdout.readline().startswith("tapd ready:")
            daemons.append(local)
        record = runtime_dir / "all.jsonl"
        first_host = two_hosts[0][0]
        remote = [arg for _, address in two_hosts
                  for arg in ("--endpoint", f"tcp://{address}:5555")]  # fmt: skip
        subscriber = subprocess.Popen(
            _in(first_host, sys.executable, str(APPS / "subscriber_app.py"), *remote,
                "--record", str(record), "multihost"),
            env={**os.environ, "TAPD_CURVE_SERVER_KEY": str(keys / "daemon.key"),
                 "TAPD_CURVE_SECRET": str(keys / "watcher.key_secret")},
        )  # fmt: skip
        processes.append(subscriber)
        wait_until(lambda: all(len(control.stats(d)["subscribers"]) == 1 for d in daemons),
                   "the subscriber on both hosts' daemons")  # fmt: skip
        coordinator = f"{two_hosts[0][1]}:{free_port()}"
        run_job(daemons, coordinator, [_in(namespace) for namespace, _ in two_hosts])
        records = [json.loads(line) for line in record.read_text().splitlines()]
    finally:
        for process in reversed(processes):
            process.terminate()
            process.communicate(timeout=30)
    assert len(records) == 2 * 4 * STEPS
    assert {(r["process"], r["step"]) for r in records} == {
        (p, s) for p in (0, 1) for s in range(STEPS)}  # fmt: skip
    assert {r["value"]["total"] for r in records} == {float(sum(range(4)) + sum(range(10, 14)))}


# ---- forwarding between the two hosts, with the link between them cut ------------------


@dataclasses.dataclass
class ForwardingHosts:
    """Host a runs the upstream daemon (CurveZMQ tcp on its address, its subscriber on
    ipc); host b runs a daemon forwarding to it, its emitters on ipc. Only the daemons
    live in the namespaces: the ipc sockets are files, reachable from anywhere."""

    upstream: Daemon
    forwarder: Daemon
    namespace: str  # host b's
    device: str  # host b's end of the veth pair
    upstream_address: str

    def link(self, state: str) -> None:
        result = _ip("-n", self.namespace, "link", "set", self.device, state)
        assert result.returncode == 0, result.stderr

    def kill_forwarders_connection(self) -> None:
        """Reset the forwarder's TCP connection on host b only: with the link down, its
        reset never reaches host a, which keeps the connection, half-open."""
        self.link("down")
        try:
            killed = subprocess.run(
                _in(self.namespace, "ss", "-tnK", "dst", self.upstream_address,
                    "dport", "=", "5555"),
                capture_output=True, text=True,
            )  # fmt: skip
            assert killed.returncode == 0, killed.stderr
            left = subprocess.run(_in(self.namespace, "ss", "-tnH", "dst", self.upstream_address),
                                  capture_output=True, text=True)  # fmt: skip
            assert "ESTAB" not in left.stdout, left.stdout
        finally:
            self.link("up")


@pytest.fixture
def forwarding_hosts(
    two_hosts: list[tuple[str, str]], runtime_dir: Path, tmp_path: Path
) -> Iterator[ForwardingHosts]:
    if shutil.which("ss") is None:
        pytest.skip("needs iproute2's `ss` to reset connections")
    keys = tmp_path / "keys"
    for name in ("upstream", "forwarder"):
        subprocess.run([sys.executable, "-m", "tapd", "keygen", name, "--dir", str(keys)],
                       check=True, capture_output=True)  # fmt: skip
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(keys / "forwarder.key", allowed / "forwarder.key")
    (ns_a, address_a), (ns_b, _) = two_hosts
    tag = ns_b.removeprefix("tapd").removesuffix("b")
    daemons: list[Daemon] = []

    def start(namespace: str, name: str, *flags: str) -> Daemon:
        local = f"ipc://{runtime_dir}/{name}.sock"
        log = runtime_dir / f"{name}.log"
        with open(log, "w") as stderr:
            process = subprocess.Popen(
                _in(namespace, sys.executable, "-m", "tapd", "start", "--endpoint", local,
                    "--pidfile", str(runtime_dir / f"{name}.pid"), "--startup-grace", "0",
                    *flags),
                stdout=subprocess.PIPE, stderr=stderr, text=True,
            )  # fmt: skip
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("tapd ready:"), log.read_text()
        daemons.append(Daemon(process, [local], log))
        return daemons[-1]

    try:
        upstream = start(ns_a, "a", "--tcp", f"tcp://{address_a}:5555",
                         "--curve-secret-key", str(keys / "upstream.key_secret"),
                         "--curve-allowed", str(allowed))  # fmt: skip
        forwarder = start(ns_b, "b", "--forward", f"tcp://{address_a}:5555",
                          "--forward-server-key", str(keys / "upstream.key"),
                          "--curve-secret-key", str(keys / "forwarder.key_secret"))  # fmt: skip
        wait_until(lambda: upstream.stats()["emitters"], "the forwarder known upstream")
        yield ForwardingHosts(upstream, forwarder, ns_b, f"v{tag}b", address_a)
    finally:
        for daemon in daemons:
            daemon.process.terminate()
            daemon.process.communicate(timeout=30)
            sys.stderr.write(daemon.log())


@pytest.mark.waits
@pytest.mark.parametrize("cut_s", [5, 20])
def test_taps_forwarded_across_a_cut_link_all_arrive(
    forwarding_hosts: ForwardingHosts,
    start_subscriber: Callable[..., SubscriberProcess],
    cut_s: float,
) -> None:
    """The veth link down for 5 s (the connection survives) and for 20 s (TCP gives it
    up after 10 s of unacknowledged data; a new one is made once the link is back), taps
    flowing all along."""
    hosts = forwarding_hosts
    steps = 20 * (cut_s + 10)  # one every 50 ms, past the cut
    far = start_subscriber(hosts.upstream, "loss")
    emitter = start_emitter(hosts.forwarder.endpoint, "paced", str(steps), "50")
    try:
        wait_until(lambda: len(far.records()) >= 40, "taps across the link")
        hosts.link("down")
        time.sleep(cut_s)  # the fault itself lasts this long
        hosts.link("up")
        result = finish(emitter, timeout=cut_s + 90)
    finally:
        hosts.link("up")
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    stats = result["stats"]
    assert (stats["delivered"], stats["daemon_dropped"], stats["errors"]) == (steps, 0, 0)


def test_a_connection_reset_on_the_forwarders_side_only_heals_while_idle(
    forwarding_hosts: ForwardingHosts, start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    hosts = forwarding_hosts
    far = start_subscriber(hosts.upstream, "loss")
    finish(start_emitter(hosts.forwarder.endpoint, "steps", "20"))
    hosts.kill_forwarders_connection()
    second = start_emitter(hosts.forwarder.endpoint, "steps", "200")
    result = finish(second, timeout=60)
    mine = [r for r in far.records() if r["emitter"].endswith(f":{second.pid}")]
    assert Tally.of(mine, 200) == Tally(200, 0, 0)
    assert result["stats"]["delivered"] == 200


def test_a_connection_reset_on_the_forwarders_side_only_mid_stream_loses_nothing(
    forwarding_hosts: ForwardingHosts, start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    hosts = forwarding_hosts
    steps = 300
    far = start_subscriber(hosts.upstream, "loss")
    emitter = start_emitter(hosts.forwarder.endpoint, "paced", str(steps), "10")
    wait_until(lambda: len(far.records()) >= 50, "taps across the link")
    hosts.kill_forwarders_connection()
    result = finish(emitter, timeout=90)
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    assert result["stats"]["delivered"] == steps and result["stats"]["errors"] == 0
