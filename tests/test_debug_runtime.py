"""What `tapd.debug` does where it means to differ from `jax.debug` (the callback runs off
the step, on tapd's receiver thread; the barrier waits for it and raises what it raised;
exit drains) and where it stands in for it (`install_debug()`, `python -m tapd.debug` on
a real progress-bar library, io_callback without result). Real daemons, real JAX
processes (tests/apps/debug_runtime_app.py); where JAX has the same behaviour, its run is
the expected value."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, PROCESS_TIMEOUT, Daemon

StartDaemon = Callable[..., Daemon]


FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def run(
    daemon: Daemon, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_program(
        [sys.executable, *argv],
        env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint, **(env or {})},
        timeout=PROCESS_TIMEOUT * 2,
    )


def scenario(
    daemon: Daemon, name: str, impl: str = "tapd", env: dict[str, str] | None = None
) -> dict[str, Any]:
    result = run(daemon, str(APPS / "debug_runtime_app.py"), name, impl, env=env)
    assert result.returncode == 0, f"{name} {impl}: rc {result.returncode}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    output: dict[str, Any] = json.loads(lines[-1])
    output["stdout"], output["stderr"] = result.stdout, result.stderr
    return output


@pytest.mark.usefixtures("backend")
def test_the_step_does_not_wait_for_the_callback(start_daemon: StartDaemon) -> None:
    # Each callback waits for an event set only after the computation's result is
    # ready: had the computation waited for a callback, the callback would have waited
    # its 30 s out and found the event unset.
    got = scenario(start_daemon(), "off_the_step")
    assert got["seen"] == [[i, True, "tapd-receiver"] for i in range(5)]
    assert got["out"] == 10.0


def test_blocking_true_is_jaxs_own_call_done_with_the_computation(
    start_daemon: StartDaemon,
) -> None:
    got = scenario(start_daemon(), "blocking")
    # Ran before any barrier, and not on tapd's receiver thread.
    assert len(got["before_barrier"]) == 1 and got["before_barrier"][0][0] == 2.0
    assert got["before_barrier"][0][1] != "tapd-receiver"
    assert got["jax_callback"] == "jax._src.debugging"
    assert got["stdout"].startswith("blocking 2.0\n")


@pytest.mark.usefixtures("backend")
def test_a_failing_callback_is_reported_at_the_barrier_by_name_with_its_traceback(
    start_daemon: StartDaemon,
) -> None:
    got = scenario(start_daemon(), "failures")
    assert got["seen"] == [0.0, 1.0, 3.0]  # the other calls ran, in order
    raised = got["raised"]
    assert raised.startswith("There were exceptions during callback processing.")
    assert "failures.<locals>.check_step#2: tap function raised ValueError('step 2 is bad')" in (
        raised
    )
    assert re.search(r'debug_runtime_app\.py", line \d+, in check_step', raised)
    assert got["cause"] == "ValueError('step 2 is bad')"
    assert "ValueError: step 2 is bad" in got["stderr"]  # and logged as it happened


@pytest.mark.usefixtures("backend")
def test_exit_runs_every_pending_callback_in_program_order(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    expected = scenario(daemon, "exit_drain", "jax")["stdout"]  # with jax.effects_barrier()
    got = scenario(daemon, "exit_drain", "tapd")["stdout"]  # no barrier: the exit drain
    lines = [line for line in got.splitlines() if not line.startswith("{")]
    assert lines == [line for line in expected.splitlines() if not line.startswith("{")]
    assert len(lines) == 40


@pytest.mark.usefixtures("backend")
def test_install_debug_serves_a_librarys_own_calls_as_jax_would_make_them(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    expected = scenario(daemon, "library", "jax")
    got = scenario(daemon, "library", "tapd")
    for key in ("printed", "progress", "value", "with_result"):
        assert got[key] == expected[key], key
    assert expected["printed"].count("\n") == 4 and expected["progress"] == [0, 1, 2, 3]
    assert got["served_by_tapd"] and not expected["served_by_tapd"]
    # print, callback and the io_callback without result ran on tapd's receiver.
    assert got["threads"] == ["tapd-receiver"]
    assert "tapd-receiver" not in expected["threads"]


def test_io_callback_keeps_jaxs_refusals(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    expected = scenario(daemon, "io_callback_refusals", "jax")
    got = scenario(daemon, "io_callback_refusals", "tapd")
    for key in ("vmap_ordered", "vmap_unordered", "grad", "jvp"):
        assert got[key] == expected[key], key
    assert expected["vmap_ordered"][0] == expected["grad"][0] == "ValueError"


def test_io_callback_without_result_makes_jaxs_calls(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    expected = scenario(daemon, "io_callback_calls", "jax", env=FOUR_DEVICES)
    got = scenario(daemon, "io_callback_calls", "tapd", env=FOUR_DEVICES)
    assert got["calls"] == expected["calls"]
    assert len(expected["calls"]) == 12  # 1 gathered + 4 devices + 3 elements + 3 + 1


@pytest.mark.usefixtures("backend")
def test_ordered_true_on_several_devices_is_refused_as_jax_refuses_it(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    expected = scenario(daemon, "ordered_on_devices", "jax", env=FOUR_DEVICES)
    assert (
        expected["refused"]
        == "The following ordered effects are not supported for more than 1 device"
    )
    got = scenario(daemon, "ordered_on_devices", "tapd", env=FOUR_DEVICES)
    assert got == expected


def test_jax_effects_barrier_raises_what_tapds_callbacks_raised(
    start_daemon: StartDaemon,
) -> None:
    got = scenario(start_daemon(), "effects_barrier_raises")
    assert got["raised"] == "CallbackException"
    assert "RuntimeError: from the callback" in got["text"]


def test_python_m_tapd_debug_runs_a_real_progress_bar_library_off_the_step(
    start_daemon: StartDaemon,
) -> None:
    pytest.importorskip("jax_tqdm")
    daemon = start_daemon()
    script = str(APPS / "debug_tqdm_script.py")
    expected = run(daemon, script, "25")
    got = run(daemon, "-m", "tapd.debug", script, "25")
    assert expected.returncode == got.returncode == 0, got.stderr
    plain, served = (json.loads(r.stdout.splitlines()[-1]) for r in (expected, got))
    assert served["total"] == plain["total"] == 300.0
    assert served["argv"] == plain["argv"] == [script, "25"]
    # jax_tqdm bound `from jax.debug import callback` at import: tapd's, under -m tapd.debug.
    assert (plain["callback_from"], served["callback_from"]) == (
        "jax._src.debugging",
        "tapd.debug.calls",
    )
    assert served["threads"] == ["tapd-receiver"] and "tapd-receiver" not in plain["threads"]
    bar = re.compile(r"scan: 100%\|#+\| 25/25")
    assert bar.search(expected.stderr) and bar.search(got.stderr), got.stderr


def test_python_m_tapd_debug_without_a_script_shows_its_usage() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tapd.debug"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "usage: python -m tapd.debug [--io-callback] script.py" in result.stderr


def test_without_a_daemon_its_callbacks_still_run_off_the_step_and_start_none(
    tmp_path: Path,
) -> None:
    """tapd.debug's callbacks never leave the process (its local ring): with no daemon
    at the endpoint, they run on tapd's receiver, print what JAX prints, and no daemon
    is started or asked for."""
    code = (
        "import threading, jax, sys, tapd.debug\n"
        "api = jax.debug if sys.argv[1] == 'jax' else tapd.debug\n"
        "f = jax.jit(lambda x: (api.print('x={}', x), x)[1])\n"
        "f(1.0); f(2.0); jax.effects_barrier()\n"
        "api.print('eager {}', 3)\n"
        "where = []\n"
        "jax.jit(lambda x: api.callback(lambda v: where.append("
        "threading.current_thread().name), x))(1.0)\n"
        "jax.effects_barrier(); tapd.barrier_wait()\n"
        "print(where)\n"
    )
    socket_path = tmp_path / "none.sock"
    env = {**os.environ, "TAPD_ENDPOINT": f"ipc://{socket_path}", "TAPD_AUTOSTART": "1"}
    runs = [
        subprocess.run([sys.executable, "-c", code, impl], env=env, capture_output=True,
                       text=True, timeout=PROCESS_TIMEOUT)
        for impl in ("jax", "tapd")
    ]  # fmt: skip
    assert [r.returncode for r in runs] == [0, 0], runs[1].stderr
    printed = "x=1.0\nx=2.0\neager 3\n"
    assert runs[0].stdout == printed + "['MainThread']\n"
    assert runs[1].stdout == printed + "['tapd-receiver']\n"
    assert "tapd" not in runs[1].stderr  # no warning, no fallback
    assert not socket_path.exists()
