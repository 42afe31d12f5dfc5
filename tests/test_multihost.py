"""A real multi-process JAX job: 2 processes (jax.distributed on CPU, 4 devices each,
cross-process collectives over gloo), each tapping into its own host's daemon, and one
subscriber that follows both daemons and receives every shard."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import APPS, Daemon, wait_until

pytestmark = pytest.mark.usefixtures("backend")
STEPS = 3


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
    subscriber = subprocess.Popen([sys.executable, str(APPS / "subscriber_app.py"), *follow,
                                   "--record", str(record), "multihost"])  # fmt: skip
    try:
        wait_until(lambda: all(h.subscriber_count() == 1 for h in hosts), "the subscriber")
        coordinator = f"127.0.0.1:{free_port()}"
        jobs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(APPS / "emitter_app.py"),
                    "multihost",
                    str(index),
                    coordinator,
                    str(STEPS),
                ],
                env={
                    **os.environ,
                    "TAPD_ENDPOINT": host.endpoint,
                    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
                },
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for index, host in enumerate(hosts)
        ]
        outputs = [job.communicate(timeout=120) for job in jobs]
        for job, (_, err) in zip(jobs, outputs, strict=True):
            assert job.returncode == 0, err[-3000:]
        results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
        records = [json.loads(line) for line in record.read_text().splitlines()]
    finally:
        subscriber.terminate()
        subscriber.wait(timeout=30)

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
        assert all(r["value"]["total"] == expected_total for r in mine)
        if backend == "native":  # each device's taps in order, from its own handler call
            devices = sorted({r["device"] for r in mine})
            assert len(devices) == 4, devices
            for device in devices:
                steps = [r["step"] for r in mine if r["device"] == device]
                assert steps == list(range(STEPS))
