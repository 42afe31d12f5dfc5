"""A progress bar that a jitted loop's callbacks update, closed as soon as the call
returns, has every update when it closes, and the call still did not wait for one
(tapd/emitter/print_order/bars.py): tqdm, a subclass of it, rich's Progress and a
program's own bar with `tapd.after_callbacks`, a bar state whose `closed` flag stops
its updates (as BlackJAX's does), through `install_debug()` and through
`id_tap` of a bound method, on both backends and on the TPU's gathered path forced on
the CPU; a close whose callbacks stall gives up and says so. Real JAX processes
(tests/apps/bars_app.py), with no daemon."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from zygote import run_program

import tapd
from conftest import APPS, PROCESS_TIMEOUT

BARS = ["tqdm", "subclass", "own", "flag"]


def run_app(scenario: str, runtime: Path, **env: str) -> dict[str, Any]:
    pytest.importorskip("tqdm")
    pytest.importorskip("rich")
    full_env = {**os.environ, "TAPD_RUNTIME_DIR": str(runtime), "TAPD_AUTOSTART": "0", **env}
    full_env.pop("TAPD_ENDPOINT", None)
    result = run_program(
        [sys.executable, str(APPS / "bars_app.py"), scenario],
        env=full_env,
        timeout=PROCESS_TIMEOUT * 2,
    )
    assert result.returncode == 0, f"{scenario}: rc {result.returncode}\n{result.stderr}"
    got: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    got["stderr"] = result.stderr
    return got


def assert_full_at_close(got: dict[str, Any]) -> None:
    for how, bars in (("install_debug", [*BARS, "rich"]), ("id_tap", BARS)):
        run = got[how]
        # When the call returned, no update had run (each waits for an event set only
        # then): the call did not wait for them.
        assert run["pending"] == [0, 0, 0, 0], how
        assert {bar: run[bar] for bar in bars} == dict.fromkeys(bars, 100), how
        assert run["threads"] == ["tapd-receiver"] and run["out"] == 4950, how


@pytest.mark.usefixtures("backend")
def test_a_bar_closed_right_after_the_call_has_every_update_and_the_call_did_not_wait(
    runtime_dir: Path,
) -> None:
    assert_full_at_close(run_app("closes", runtime_dir))


def test_the_same_on_the_tpus_gathered_path(runtime_dir: Path) -> None:
    got = run_app("closes", runtime_dir, TAPD_GATHER="on", TAPD_BACKEND="portable")
    assert_full_at_close(got)


def test_a_bar_the_computations_callbacks_close_does_not_wait_for_itself(
    runtime_dir: Path,
) -> None:
    got = run_app("closed_by_callbacks", runtime_dir, TAPD_CELL_TIMEOUT="2")
    assert got["pending"] == 0  # the updates waited for the call's return
    assert got["by_tapd"] == 100  # closed by a callback after the updates, in program order
    # Closed by JAX's io_callback, inside the computation (no update is its), before
    # the updates could run: had it waited for them, it would have stalled and said so.
    assert got["by_jax"] == 0 and got["out"] == 4950
    assert "waited for the in-process callbacks" not in got["stderr"]


def test_a_close_whose_callbacks_stall_gives_up_and_says_so(runtime_dir: Path) -> None:
    got = run_app("stalled", runtime_dir, TAPD_CELL_TIMEOUT="0.5")
    assert got["at_close"] == 0  # closed without the stalled updates
    assert got["ran"] == 100  # which all ran after it
    assert (
        "tapd: __main__.RecordingTqdm.close waited for the in-process callbacks already "
        "dispatched (a progress bar's updates), but none ran for 0.5 s (TAPD_CELL_TIMEOUT)"
    ) in got["stderr"]


@pytest.mark.fast
def test_after_callbacks_without_tapds_callbacks_calls_the_function_as_it_is() -> None:
    calls: list[int] = []

    def close(value: int) -> int:
        calls.append(value)
        return value * 2

    wrapped = tapd.after_callbacks(close)
    assert wrapped(3) == 6 and calls == [3]
    assert wrapped.__name__ == "close" and tapd.after_callbacks(wrapped) is wrapped
