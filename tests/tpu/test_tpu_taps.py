"""Taps on a TPU, end to end: tests/tpu/tpu_app.py on the chip, a real daemon, a real
subscriber, with taps gathered on the device (TAPD_GATHER=auto: tapd.emitter.gathered)
and one host callback a tap (TAPD_GATHER=off). Skipped, with the reason, where JAX has
no TPU; CI has none, and tests/test_gathered.py tests the same path on the CPU
(TAPD_GATHER=on). On a TPU machine: `pytest -p no:xdist tests/tpu` (one process at a
time may hold the chip); bench/RESULTS-tpu.md has a run's log."""

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

from conftest import Daemon, SubscriberProcess, wait_until

HERE = Path(__file__).resolve().parent
TIMEOUT = 300.0
STEPS = 1000


@functools.cache
def tpu_missing() -> str | None:
    """Why there is no TPU for these tests, or None (asked of a child process, which
    lets go of the chip before the app takes it)."""
    needs = "tests/tpu need a TPU and JAX's TPU runtime (libtpu)"
    if importlib.util.find_spec("libtpu") is None:
        return f"{needs}: libtpu is not installed here"
    probe = "import jax; print(jax.devices()[0].platform)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=TIMEOUT)  # fmt: skip
    if result.stdout.strip() != "tpu":
        return f"{needs}: JAX's first device is not a TPU: {result.stdout.strip()!r}"
    return None


@pytest.fixture(autouse=True)
def _skip_without_tpu() -> None:
    if (reason := tpu_missing()) is not None:
        pytest.skip(reason)


def run_app(endpoint: str, gather: str) -> dict[str, Any]:
    env = {**os.environ, "TAPD_ENDPOINT": endpoint, "TAPD_GATHER": gather}
    result = subprocess.run([sys.executable, str(HERE / "tpu_app.py"), str(STEPS)], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, result.stderr
    output: dict[str, Any] = json.loads(lines[-1])
    assert output["platform"] == "tpu", output
    return output


# What host_callback printed for tpu_app.order's program: program order, inside cond,
# fori_loop, while_loop and scan alike.
ORDER = [
    ["start", 1.0], ["body", 1.0], ["body", 3.0], ["body", 5.0], ["cond", 5.0],
    ["body", 6.0], ["cond", 6.0], ["body", 7.0], ["cond", 7.0], ["while", 8.0],
    ["while", 16.0], ["while", 32.0], ["while", 64.0], ["scan", 128.0], ["scan", 129.0],
    ["scan", 131.0], ["end", 131.0],
]  # fmt: skip


@pytest.mark.parametrize("gather", ["auto", "off"])
def test_tpu_taps_in_program_order_exact_counts_failures_and_transforms(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    gather: str,
) -> None:
    daemon = start_daemon("--policy", "block")
    subscriber = start_subscriber(daemon, "tpu.values", "tpu.big")
    output = run_app(daemon.endpoint, gather)
    assert output["gather"] == gather
    result, seen = output["order"]
    assert result == 131.0
    if gather == "auto":  # one host callback a tap keeps order within a block only
        assert seen == ORDER
    else:
        assert sorted(map(tuple, seen)) == sorted(map(tuple, ORDER))
    assert output["counts"]["closure_total"] == float(sum(range(STEPS)))
    big_steps = list(range(0, STEPS, 50))
    wait_until(lambda: len(subscriber.records()) >= STEPS + len(big_steps),
               "every named tap to be handled", TIMEOUT)  # fmt: skip
    records = subscriber.records()
    values = [r for r in records if r["consumer"] == "tpu.values"]
    big = [r for r in records if r["consumer"] == "tpu.big"]
    assert [r["seq"] for r in values] == list(range(STEPS))
    assert [r["step"] for r in values] == list(range(STEPS))
    assert all(r["value"] == [float(r["step"])] * 4 for r in values)
    assert [r["step"] for r in big] == big_steps
    assert all(len(r["value"]) == 2**18 and r["value"][-1] == r["step"] for r in big)
    assert output["failure"].startswith(("CallbackException", "TapFunctionException"))
    assert "deliberate failure at 3" in output["failure"]
    transforms = output["transforms"]
    assert ["vmap", [0.0, 2.0, 4.0]] in transforms
    assert ["grad", 3.0] in transforms
    assert [name for name, _ in transforms].count("remat") == 1
    assert output["dtypes"]["got"] == output["dtypes"]["expected"]
    assert len(output["dtypes"]["got"]) == 3
