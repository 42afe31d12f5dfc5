"""A real multi-process JAX job: 2 processes (jax.distributed on CPU, 4 devices each,
cross-process collectives over gloo), each tapping into its own host's daemon, and one
subscriber that follows both daemons and receives every shard. Once on loopback, and
once with the hosts made real as network namespaces joined by a veth pair, the
subscriber reaching both daemons over CurveZMQ tcp."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import APPS, Daemon, wait_until
from tapd.daemon import control

pytestmark = pytest.mark.usefixtures("backend")
STEPS = 3


def run_job(endpoints: list[str], coordinator: str, prefixes: list[list[str]]) -> list[str]:
    """Run the 2-process job, process i tapping into endpoints[i] (its command prefixed
    by prefixes[i], e.g. `ip netns exec HOST`); return each process's stdout."""
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
