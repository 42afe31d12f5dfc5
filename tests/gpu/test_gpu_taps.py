"""Taps on an NVIDIA GPU, end to end: a JAX emitter process on the GPU (its CUDA
handler copying into the ring on the computation's stream), a real daemon, a real
subscriber. Skipped, with the reason, where JAX has no GPU (bench/gpu-check runs these
on a machine that has one)."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, SubscriberProcess, stop_process, wait_until

HERE = Path(__file__).resolve().parent
TIMEOUT = 300.0


@functools.cache
def gpu_missing() -> str | None:
    """Why there is no GPU for these tests, or None. Asked of a child process, so that
    this one neither initialises JAX nor takes GPU memory from the emitters."""
    if not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return "JAX has no CUDA plugin here (pip install 'jax[cuda12]')"
    probe = "import jax; print(len(jax.devices('gpu')))"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)  # fmt: skip
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        return f"JAX found no GPU: {result.stderr.strip().splitlines()[-1:]}"
    return None if int(result.stdout) > 0 else "JAX found no GPU"


@pytest.fixture(autouse=True)
def _skip_without_gpu() -> None:
    if (reason := gpu_missing()) is not None:
        pytest.skip(reason)


# tests/gpu/checksum_subscriber.py writes one JSON line per tap it handled, as
# tests/apps/subscriber_app.py does: the same reader serves both.
Checksums = SubscriberProcess


@pytest.fixture
def start_checksums(runtime_dir: Path) -> Any:
    started: list[subprocess.Popen[str]] = []

    def start(daemon: Daemon, consumer: str, sleep_ms: float = 0) -> Checksums:
        record = runtime_dir / f"{consumer}.jsonl"
        before = daemon.subscriber_count()
        argv = [sys.executable, str(HERE / "checksum_subscriber.py"), consumer,
                "--endpoint", daemon.endpoint, "--record", str(record),
                "--sleep-ms", str(sleep_ms)]  # fmt: skip
        process = subprocess.Popen(argv, text=True)
        started.append(process)
        wait_until(lambda: daemon.subscriber_count() > before or process.poll() is not None,
                   "the subscriber to connect")  # fmt: skip
        assert process.poll() is None, "subscriber exited early"
        return Checksums(process, record)

    yield start
    for process in started:
        stop_process(process)


def run_gpu_emitter(
    endpoint: str, scenario: str, *args: str, backend: str = "native", **env: str
) -> dict[str, Any]:
    full_env = {**os.environ, "TAPD_ENDPOINT": endpoint, "TAPD_BACKEND": backend,
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env}  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(HERE / "gpu_emitter_app.py"), scenario, *args],
        env=full_env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert result.returncode == 0, f"{scenario}:\n{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr
    output: dict[str, Any] = json.loads(lines[-1])
    assert output["platform"] == "gpu", output
    if backend == "native":  # the CUDA handler, not a host callback, wrote the ring
        assert output["cuda_handler"], output["cuda_reason"]
        assert output["backend"] == "native" and "cuda" in output["handler_platforms"], output
    else:  # a host callback wrote the same ring
        assert output["backend"] == "portable" and not output["handler_platforms"], output
    return output


STEPS = 40
SMALL, BIG = 257, 1024 * 1024 // 2 + 3  # as in gpu_emitter_app.py


@pytest.mark.parametrize("backend", ["native", "portable"])
def test_gpu_taps_arrive_whole_in_order_with_seq_step_and_device(
    start_daemon: Callable[..., Daemon], start_checksums: Callable[..., Checksums], backend: str
) -> None:
    """Both paths a GPU has: the CUDA handler, and the host callback (a GPU where the
    handler is not built). The subscriber cannot tell them apart."""
    daemon = start_daemon("--policy", "block")
    subscriber = start_checksums(daemon, "gpu.values")
    # A 4 MiB ring: the ~1 MiB records wrap it ten times and often cross its end (the
    # handler splits such a copy in two); under "block" the host thread waits for room.
    result = run_gpu_emitter(daemon.endpoint, "values", str(STEPS), backend=backend,
                             TAPD_BUFFER_BYTES=str(4 * 2**20))  # fmt: skip
    assert result["stats"]["dropped"] == 0, result["stats"]
    wait_until(lambda: len(subscriber.records()) >= STEPS, "every tap to be handled", TIMEOUT)
    records = subscriber.records()
    assert [r["seq"] for r in records] == list(range(STEPS))
    assert [r["step"] for r in records] == list(range(STEPS))
    assert {r["device"] for r in records} == {result["local_hardware_id"]}
    for i, record in enumerate(records):
        small, big, count = (record["leaves"][k] for k in ("small", "big", "count"))
        assert (small["dtype"], small["shape"]) == ("float32", [SMALL])
        assert (small["first"], small["last"]) == (float(i), float(i + SMALL - 1))
        assert small["sum"] == sum(range(SMALL)) + SMALL * i
        assert (big["dtype"], big["shape"], big["first"], big["last"]) == (
            "float16", [BIG], float(i), float(i),
        )  # fmt: skip
        assert big["sum"] == float(i) * BIG
        assert (count["dtype"], count["first"]) == ("int32", i)
    assert result["total"] == float(sum(range(STEPS)))


def test_a_slow_handler_does_not_slow_the_gpu_step(
    start_daemon: Callable[..., Daemon], start_checksums: Callable[..., Checksums]
) -> None:
    """A handler that sleeps 10 ms a tap, 100 taps: if the stream waited for it, the
    tapped loop would take a second more than the untapped one. It waits for a copy
    and a commit (microseconds), never for Python."""
    daemon = start_daemon("--policy", "block")
    subscriber = start_checksums(daemon, "gpu.slow", sleep_ms=10)
    result = run_gpu_emitter(daemon.endpoint, "isolation", "100")
    assert result["tapped_s"] < result["untapped_s"] * 2 + 0.05, result
    assert result["barrier_s"] > 0.5, result  # the handler's sleeping happened after the loop
    assert result["stats"]["dropped"] == 0
    wait_until(lambda: len(subscriber.records()) >= 4 * 100, "every tap", TIMEOUT)  # 1 + 3 runs
