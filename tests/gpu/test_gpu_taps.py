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
    needs = "tests/gpu need an NVIDIA GPU, its driver and JAX's CUDA plugin (bench/gpu-check)"
    if not any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return f"{needs}: JAX has no CUDA plugin here (pip install 'jax[cuda12]')"
    probe = "import jax; print(len(jax.devices('gpu')))"
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=TIMEOUT, env=env)  # fmt: skip
    if result.returncode != 0 or not result.stdout.strip().isdigit():
        return f"{needs}: JAX found no GPU: {result.stderr.strip().splitlines()[-1:]}"
    return None if int(result.stdout) > 0 else f"{needs}: JAX found no GPU"


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

    def start(daemon: Daemon, *consumers: str, sleep_ms: float = 0,
              verify: bool = False) -> Checksums:  # fmt: skip
        record = runtime_dir / f"{consumers[0]}.jsonl"
        before = daemon.subscriber_count()
        argv = [sys.executable, str(HERE / "checksum_subscriber.py"), *consumers,
                "--endpoint", daemon.endpoint, "--record", str(record),
                "--sleep-ms", str(sleep_ms), *(["--verify"] if verify else [])]  # fmt: skip
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
    endpoint: str, scenario: str, *args: str, backend: str = "native",
    timeout: float = TIMEOUT, **env: str,
) -> dict[str, Any]:  # fmt: skip
    full_env = {**os.environ, "TAPD_ENDPOINT": endpoint, "TAPD_BACKEND": backend,
                "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **env}  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(HERE / "gpu_emitter_app.py"), scenario, *args],
        env=full_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, f"{scenario}:\n{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr
    output: dict[str, Any] = json.loads(lines[-1])
    output["stderr"] = result.stderr
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


CHECKSUM_STEPS = 25_000  # four taps a step: 100,000
CHECKSUM_SIZES = (1, 65, 1025, 4097)  # as in gpu_emitter_app.py


@pytest.mark.parametrize("commit", ["auto", "side"])
def test_100000_taps_of_mixed_sizes_arrive_whole(
    start_daemon: Callable[..., Daemon], start_checksums: Callable[..., Checksums], commit: str
) -> None:
    """Data before flag: 100,000 records of four sizes through a 4 MiB ring (so they
    wrap it often and cross its end), each checked against its checksum by the
    subscriber, committed by the stream itself where the GPU can ("auto") and by a side
    stream's host function."""
    daemon = start_daemon("--policy", "block")
    consumers = [f"gpu.checksum.{n}" for n in CHECKSUM_SIZES]
    subscriber = start_checksums(daemon, *consumers, verify=True)
    result = run_gpu_emitter(daemon.endpoint, "checksums", str(CHECKSUM_STEPS),
                             TAPD_BUFFER_BYTES=str(4 * 2**20),
                             TAPD_CUDA_COMMIT=commit)  # fmt: skip
    if commit == "side":
        assert result["commit"][0] == "side-stream host function", result["commit"]
    assert result["stats"]["dropped"] == 0, result["stats"]
    total = CHECKSUM_STEPS * len(CHECKSUM_SIZES)

    def tally() -> dict[str, Any]:
        lines = subscriber.records()
        return lines[-1] if lines else {"taps": 0}

    wait_until(lambda: tally()["taps"] >= total, "every tap to be checked", TIMEOUT)
    stop_process(subscriber.process)
    final = tally()
    assert (final["taps"], final["bad_sums"], final["out_of_order"]) == (total, 0, 0), final


def test_the_benchmark_setup_that_hung_runs_through(start_daemon: Callable[..., Daemon]) -> None:
    """bench/gpu_bench.py's cost section hung at 1 MiB on the first GPU run: a ring of
    half of /dev/shm (up to 1 GiB), the tap, portable tap and callback loops
    interleaved, no subscriber. The same here, with the waiting-tap message after 2 s:
    the run must finish, and if a tap waits, its message is in the failure."""
    daemon = start_daemon("--policy", "block")
    free = os.statvfs("/dev/shm")
    ring = max(16 * 2**20, min(2**30, free.f_bavail * free.f_frsize // 2) // 4096 * 4096)
    steps = min(200, int(ring * 0.8) // (2**20 + 64))
    result = run_gpu_emitter(daemon.endpoint, "interleaved", str(steps), timeout=90,
                             TAPD_BUFFER_BYTES=str(ring),
                             TAPD_RING_WAIT_WARNING_S="2")  # fmt: skip
    assert "for ring space" not in result["stderr"], result["stderr"]
    assert result["stats"]["dropped"] == 0, result["stats"]
