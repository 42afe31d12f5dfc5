"""The tap path never waits for a host function (issue 62): with the host function that
a computation's `jax.debug` calls run held (a printer that hangs), computations whose
taps lie in the loop shapes of real solvers (optimistix's verbose `least_squares` over
a Diffrax solve) still return: a `while` of unknown length with another inside, a tap
in a `cond`, a tap in an inner `while`, equinox's bounded loop (nested `scan`s of
`cond`s). Then every value arrives, in program order (tests/apps/held_host_app.py).

On the CPU with `TAPD_GATHER=on` (the portable backend): the TPU's gathered path, each
step a paced chunk (`TAPD_GATHER_LATENCY` tiny, so that every step flushes and waits
for the host's answer while the function is held); and the per-tap path
(`TAPD_GATHER=off`). tests/tpu/test_tpu_held_host.py runs the same program on a TPU.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, PROCESS_TIMEOUT, native_unavailable

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))

PATHS = {
    "gathered, a paced chunk a step": {"TAPD_GATHER": "on", "TAPD_GATHER_LATENCY": "0.000001"},
    "one host callback a tap": {"TAPD_GATHER": "off"},
}


def run_app(env: dict[str, str]) -> dict[str, Any]:
    full_env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TAPD_AUTOSTART": "0",
        "TAPD_BACKEND": "portable",
        **env,
    }
    argv = [sys.executable, str(APPS / "held_host_app.py")]
    result = run_program(argv, env=full_env, timeout=PROCESS_TIMEOUT * 4)
    assert result.returncode == 0, result.stderr
    assert "could not gather" not in result.stderr
    output: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return output


def check(results: dict[str, Any]) -> None:
    """Each shape's calls returned while the function was held; everything arrived."""
    for shape, result in results.items():
        assert result["entered"], f"{shape}: no tap reached the host function"
        assert result["returned_while_held"] == [True, True], (
            f"{shape}: a call waited for the held host function "
            f"(returned while held: {result['returned_while_held']})"
        )
        assert result["arrived"] == result["due"], shape


@pytest.mark.parametrize("path", list(PATHS))
def test_loops_of_solvers_return_while_their_host_function_is_held(path: str) -> None:
    output = run_app(PATHS[path])
    assert set(output["results"]) == {
        "nested_while", "print_nested_while", "tap_in_cond", "tap_in_inner_while", "bounded"
    }  # fmt: skip
    check(output["results"])
    if PATHS[path]["TAPD_GATHER"] == "on":  # (flushed while it ran: paced chunks)
        assert output["host_callbacks"] > 2 * len(output["results"])
