"""`tapd.debug.callback` and `tapd.debug.print` make the calls `jax.debug` makes: the
same cases (tests/apps/debug_cases.py) run in one real JAX process with `jax.debug` and
in another with `tapd.debug` (into a real daemon), and what their callbacks got (types,
dtypes, shapes, values, pytrees, order) and what they printed or logged must be equal,
or, for trace-time refusals, the exception's type and words. JAX's run is the expected
value; nothing here is compared with tapd's own earlier output."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, PROCESS_TIMEOUT, Daemon

sys.path.insert(0, str(APPS))
import debug_cases

StartDaemon = Callable[..., Daemon]
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}

_jax_runs: dict[str, dict[str, Any]] = {}


def run_cases(impl: str, group: str, endpoint: str) -> dict[str, Any]:
    env = {**os.environ, "TAPD_ENDPOINT": endpoint, **(FOUR_DEVICES if group == "devices" else {})}
    result = run_program(
        [sys.executable, str(APPS / "debug_app.py"), impl, group],
        env=env,
        timeout=PROCESS_TIMEOUT * 3,
    )
    assert result.returncode == 0, f"{impl} {group}: rc {result.returncode}\n{result.stderr}"
    output: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return output


def jax_run(group: str, endpoint: str) -> dict[str, Any]:
    """jax.debug's results (the same for every backend, so run once)."""
    if group not in _jax_runs:
        _jax_runs[group] = run_cases("jax", group, endpoint)
    return _jax_runs[group]


def comparable(name: str, result: dict[str, Any]) -> dict[str, Any]:
    if name not in debug_cases.ANY_ORDER:
        return result
    return {
        **result,
        "calls": sorted(json.dumps(call, sort_keys=True) for call in result["calls"]),
        "out": sorted(result["out"].splitlines()),
    }


@pytest.mark.parametrize("group", sorted(set(debug_cases.GROUPS) - {"not_in_this_jax"}))
@pytest.mark.usefixtures("backend")
def test_tapd_debug_makes_the_calls_jax_debug_makes(start_daemon: StartDaemon, group: str) -> None:
    daemon = start_daemon()
    expected = jax_run(group, daemon.endpoint)
    got = run_cases("tapd", group, daemon.endpoint)
    assert sorted(got) == sorted(expected) == sorted(debug_cases.GROUPS[group])
    differing = []
    for name in sorted(got):
        want = comparable(name, expected[name])
        if comparable(name, got[name]) != want:
            differing.append(
                f"{name}:\n  jax.debug:  {want}\n  tapd.debug: {comparable(name, got[name])}"
            )
    assert not differing, "\n".join(differing)
    # Every case was exercised: it called back, printed, logged or was refused.
    for name, result in expected.items():
        if name == "log_records" and not result["logged"]:
            continue  # a JAX without jax.debug.log
        assert result["calls"] or result["out"] or result["logged"] or result["error"], name
