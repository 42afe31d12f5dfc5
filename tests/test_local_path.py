"""Tap functions that live in the JAX process go through its local ring, drained by its
own receiver thread, with no daemon (tapd/emitter/local/path.py): order, the ring's
policies, barriers with calls in flight, the exit drain, exceptions, a barrier that
times out saying why, and a program that also has named sites. Real JAX processes
(tests/apps/local_path_app.py), on both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zygote import run_program

from conftest import APPS, PROCESS_TIMEOUT, Daemon, SubscriberProcess, tapd_cmd, wait_until

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

pytestmark = pytest.mark.usefixtures("backend")


def run_app(
    scenario: str, *args: str, env: dict[str, str] | None = None, runtime: Path
) -> dict[str, Any]:
    """Run one scenario with `runtime` as its runtime directory (the default endpoint's,
    where a daemon would be started if one were asked for: autostart on, as users have
    it); the JSON it prints last, with its stderr."""
    full_env = {**os.environ, "TAPD_RUNTIME_DIR": str(runtime), "TAPD_AUTOSTART": "1"}
    full_env.pop("TAPD_ENDPOINT", None)
    result = run_program(
        [sys.executable, str(APPS / "local_path_app.py"), scenario, *args],
        env={**full_env, **(env or {})},
        timeout=PROCESS_TIMEOUT * 2,
    )
    assert result.returncode == 0, f"{scenario}: rc {result.returncode}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith('{"pid"')]
    assert lines, f"{scenario} printed no result\n{result.stdout}\n{result.stderr}"
    got: dict[str, Any] = json.loads(lines[-1])
    got["stdout"], got["stderr"] = result.stdout, result.stderr
    return got


def assert_no_daemon_was_started(runtime: Path) -> None:
    """Nothing of a daemon in the runtime directory: no socket, no pidfile, no log."""
    leftovers = sorted(p.name for p in runtime.iterdir()) if runtime.exists() else []
    assert leftovers == [], f"a daemon was started for in-process callbacks: {leftovers}"


def test_local_taps_keep_program_order_and_start_no_daemon(runtime_dir: Path) -> None:
    got = run_app("order", runtime=runtime_dir)
    calls = [tuple(call) for call in got["calls"]]
    scan = [("id_tap a", 0.0), ("id_tap a", 1.0), ("id_tap a", 2.0)]
    id_taps = [*scan, ("id_tap b", 20.0), ("while", 1.0), ("while", 2.0)] * 2
    debug_calls = [("debug", x + 0.5) for x in (0.0, 1.0, 2.0)]
    debug_calls += [("while debug", 0.0), ("while debug", 1.0)]
    # Each kind in program order (id_tap's order; tapd.debug's unordered calls in one
    # computation are one site each here, in seq order).
    id_order = [c for c in calls if c[0] in ("id_tap a", "id_tap b", "while")]
    assert sorted(id_order[:4], key=lambda c: c[0]) == sorted(id_taps[:4], key=lambda c: c[0])
    assert [c for c in id_order if c[0] != "id_tap b"] == [c for c in id_taps if c[0] != "id_tap b"]
    assert [c for c in calls if c[0] in ("debug", "while debug")] == debug_calls * 2
    # (Between an unordered jax.debug.callback and an id_tap, JAX promises no order.)
    assert got["stats"]["local"]["ran"] == len(calls) == 22
    assert got["stats"]["delivered"] == got["stats"]["submitted"] == 22
    assert_no_daemon_was_started(runtime_dir)


def test_block_policy_pauses_the_step_and_loses_nothing(runtime_dir: Path) -> None:
    env = {"TAPD_BUFFER_BYTES": str(64 * 1024), "TAPD_EMITTER_POLICY": "block"}
    got = run_app("flood", "200", "2", env=env, runtime=runtime_dir)
    assert got["seqs"] == list(range(200))
    local = got["stats"]["local"]
    assert local["dropped"] == 0 and local["ran"] == 200
    assert local["blocked_ns"] > 0  # the ring (15 taps) filled: the step waited
    assert_no_daemon_was_started(runtime_dir)


def test_drop_newest_policy_drops_and_counts_every_drop(runtime_dir: Path) -> None:
    env = {"TAPD_BUFFER_BYTES": str(64 * 1024), "TAPD_EMITTER_POLICY": "drop_newest"}
    got = run_app("flood", "200", "2", env=env, runtime=runtime_dir)
    local = got["stats"]["local"]
    seqs = got["seqs"]
    assert local["dropped"] > 0
    assert len(seqs) == local["ran"] and local["ran"] + local["dropped"] == 200
    assert seqs == sorted(set(seqs)) and set(seqs) <= set(range(200))
    assert got["stats"]["dropped"] == local["dropped"]
    assert "not every tap of this process's own tap functions ran" in got["stderr"]


def test_taps_that_gather_never_wait_for_the_gathering_to_end(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """With the receiver gathering taps for 10 minutes after each read: a writer that
    finds no room, half a ring waiting, a barrier and exit each wake it (the process
    would otherwise outlive this test's timeout)."""
    ran = tmp_path / "ran.txt"
    env = {"TAPD_BUFFER_BYTES": str(64 * 1024), "TAPD_EMITTER_POLICY": "block"}
    got = run_app("gathering", str(ran), env=env, runtime=runtime_dir)
    assert got["at_barrier"] == 500
    assert [int(v) for v in ran.read_text().split()] == list(range(510))  # exit ran 10
    assert got["stats"]["blocked_ns"] > 0  # the 40 KiB tap waited for room
    assert "not every tap" not in got["stderr"]


def test_waits_with_nothing_to_wait_for_leave_the_gathering_as_it_was(runtime_dir: Path) -> None:
    """A barrier (or jax.effects_barrier) with every tap already run used to hurry the
    receiver all the same: it then read the next taps one by one, beside the thread that
    dispatches the steps (bench/RESULTS.md §10 (b): the first calls after such a barrier
    took 50-200 µs, against 15)."""
    got = run_app("gathering_after_idle_waits", runtime=runtime_dir)
    assert got["before_barrier"] == [0]
    assert got["after_barrier"] == [0, 1]


def test_barriers_wait_for_callbacks_in_flight(runtime_dir: Path) -> None:
    got = run_app("barrier_in_flight", "30", runtime=runtime_dir)
    assert got["after_jax"] == 30  # jax.effects_barrier(), once tapd.install_debug()
    assert got["after_tapd"] == 60
    assert got["ran"] == list(range(30)) * 2
    assert_no_daemon_was_started(runtime_dir)


@pytest.mark.parametrize("ordered", ["default", "strict", "false"])
def test_jax_effects_barrier_waits_for_id_tap_functions_without_any_install(
    runtime_dir: Path, ordered: str
) -> None:
    """As host_callback's tests use it: a bare `jax.effects_barrier()` returns once the
    tap functions of this process (id_print's output_stream, a slow id_tap closure) have
    run, also for calls served from the compiled executable."""
    got = run_app("effects_barrier_without_install", ordered, runtime=runtime_dir)
    # (id_print writes its keywords' line and the value: two writes a tap)
    assert got["written_after_each"] == [[6, 1], [12, 2], [18, 3]]
    assert_no_daemon_was_started(runtime_dir)


@pytest.mark.parametrize("installed", ["1", "0"])
def test_jax_effects_barrier_raises_what_tap_functions_raised_once_host_callback_is_installed(
    runtime_dir: Path, installed: str
) -> None:
    """host_callback's `jax.effects_barrier()` raised CallbackException (its tests'
    `test_call_error_*`); without install_host_callback it leaves that to barrier_wait."""
    raised = run_app("effects_barrier_raising", installed, runtime=runtime_dir)["raised"]
    first = "There were exceptions during callback processing. Last one was:"
    if installed == "1":
        assert raised["effects_barrier"] is not None and raised["effects_barrier"].startswith(first)
        assert raised["barrier_wait"] is None  # (raised once)
    else:
        assert raised["effects_barrier"] is None
        assert raised["barrier_wait"] is not None and raised["barrier_wait"].startswith(first)


def test_exit_runs_every_callback_in_flight(runtime_dir: Path, tmp_path: Path) -> None:
    sink = tmp_path / "ran.txt"
    got = run_app("exit_drain", str(sink), "40", runtime=runtime_dir)
    assert got["dispatched"] == 40
    assert sink.read_text().split() == [str(i) for i in range(40)]
    assert "not every tap" not in got["stderr"]
    assert_no_daemon_was_started(runtime_dir)


def test_exit_waits_while_callbacks_progress_past_the_exit_timeout(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """TAPD_EXIT_TIMEOUT bounds a wait without progress, not the whole drain: 40 callbacks
    of 50 ms (2 s) all run at exit with a 1 s timeout."""
    sink = tmp_path / "ran.txt"
    env = {"TAPD_EXIT_TIMEOUT": "1"}
    got = run_app("exit_drain", str(sink), "40", "50", env=env, runtime=runtime_dir)
    assert sink.read_text().split() == [str(i) for i in range(40)]
    assert "not every tap" not in got["stderr"]


def test_exit_gives_up_on_a_callback_that_never_returns_and_counts_the_rest(
    runtime_dir: Path,
) -> None:
    # (TAPD_CELL_TIMEOUT: the app's result line is a print, which waits for the stuck
    # callback up to it; 10 s by default, twice, as print writes text and newline apart)
    env = {"TAPD_EXIT_TIMEOUT": "1", "TAPD_CELL_TIMEOUT": "0.5"}
    got = run_app("exit_stuck", "5", env=env, runtime=runtime_dir)
    stderr = got["stderr"]
    assert "not every tap of this process's own tap functions ran: 6 not run" in stderr
    assert "exit_stuck.<locals>.<lambda>" in stderr  # what it waited for, and where
    assert "still running exit_stuck.<locals>.<lambda>" in stderr


def test_exceptions_surface_at_the_next_barrier_with_name_and_traceback(
    runtime_dir: Path,
) -> None:
    got = run_app("raising", runtime=runtime_dir)
    assert got["seen"] == [0.0, 2.0]  # the others ran
    first, second = got["first"], got["second"]
    assert "ValueError: deliberate debug failure" in first["text"]
    assert "Traceback" in first["text"] and "in sometimes" in first["text"]
    assert len(first["errors"]) == 1 and "sometimes" in first["errors"][0]
    assert "ValueError" in first["cause"]
    assert "KeyError: 'deliberate id_tap failure'" in second["text"]
    assert "always" in second["errors"][0]
    assert got["third"] is None  # each failure raised once
    assert_no_daemon_was_started(runtime_dir)


def test_interleaved_sites_each_get_their_own_values_and_failures(runtime_dir: Path) -> None:
    count = 300
    got = run_app("interleaved", str(count), runtime=runtime_dir)
    steps = range(count)
    failing = [i for i in steps if i % 50 == 7]
    alone = range(1000, 1000 + count)  # then a step with the leaf's site alone
    assert got["got"]["leaf"] == [i for i in [*steps, *alone] if i % 50 != 7]
    assert got["got"]["pair"] == [["tuple", i, 2 * i] for i in steps]
    assert got["got"]["tree"] == [[["a", "b"], i, 3 * i] for i in steps]
    assert got["got"]["device"] == [[i, True] for i in steps]
    errors = got["errors"]
    assert len(errors) == 2 * len(failing)
    # (the tap's own site, `leaf`'s, and its seq: the site's count of taps, which the
    # second step's tap of the same function and value shape goes on with)
    seqs = [*failing, *(count + i for i in failing)]
    values = [*failing, *(1000 + i for i in failing)]
    for error, seq, value in zip(errors, seqs, values, strict=True):
        assert error.split(": ")[0].endswith(f"interleaved.<locals>.leaf#{seq}"), error
        assert f"deliberate failure at {value}" in error
    stats = got["stats"]
    assert stats["ran"] == stats["sent"] == 5 * count
    assert stats["errors"] == 2 * len(failing) and stats["pending"] == 0
    assert_no_daemon_was_started(runtime_dir)


def test_debug_callbacks_run_by_runs_get_what_jax_debug_callback_gives(runtime_dir: Path) -> None:
    """Many taps of each tapd.debug site a read (the receiver's run of one site): each
    call's arguments (jax.Arrays on the CPU, committed, their values; statics, keywords,
    vmap's unrolled calls, a typed key, none for grad's transpose) and default device
    are what jax.debug.callback gives for the same program."""
    count = "120"
    want = run_app("debug_runs", "jax", count, runtime=runtime_dir)["calls"]
    got = run_app("debug_runs", "tapd", count, runtime=runtime_dir)["calls"]
    assert sorted(got) == sorted(want)
    for tag in want:
        if tag != "vmapped":
            assert got[tag] == want[tag], tag
    # vmap's unrolled calls are unordered ones: XLA may run a step's three in any order
    assert len(want["vmapped"]) == 3 * len(want["leaf"]) == 3 * int(count)
    for start in range(0, len(want["vmapped"]), 3):
        assert sorted(got["vmapped"][start : start + 3]) == sorted(
            want["vmapped"][start : start + 3]
        )
    assert want["default device"] == ["cpu"] * int(count)
    assert_no_daemon_was_started(runtime_dir)


def test_debug_callback_failures_in_long_runs_each_reported(runtime_dir: Path) -> None:
    count = 400
    got = run_app("debug_failures", str(count), runtime=runtime_dir)
    failing = [i for i in range(count) if i % 50 == 7]
    assert got["seen"] == [i for i in range(count) if i % 50 != 7]
    errors = got["errors"]
    assert len(errors) == len(failing)
    for error, value in zip(errors, failing, strict=True):
        assert "debug_failures.<locals>.sometimes" in error.split(": ")[0], error
        assert f"deliberate failure at {value}" in error
    assert got["stats"]["errors"] == len(failing) and got["stats"]["pending"] == 0


def test_id_print_renders_alike_in_its_print_worker_and_in_the_process(
    runtime_dir: Path,
) -> None:
    """The print worker renders the very text the process would (dtypes, a 0-d int,
    bfloat16, a summarized array with `threshold`, bools, nan and inf), in order: on
    every tap (`always`), on long runs of one site only (`auto`), never (`never`)."""
    count = 60

    def run(mode: str, rounds: str) -> dict[str, Any]:
        env = {"TAPD_PRINT_WORKER": mode}
        return run_app("printing", str(count), rounds, env=env, runtime=runtime_dir)

    # auto: in the worker once it has started (~0.2 s; the runs meanwhile are rendered
    # here), for the long runs of the loop that prints one site alone
    got = {"auto": run("auto", "until-worker")}
    rounds = got["auto"]["rounds"]
    got |= {mode: run(mode, str(rounds)) for mode in ("never", "always")}
    lines = got["never"]["lines"]
    assert got["always"]["lines"] == lines and got["auto"]["lines"] == lines
    # (each step: 6 taps, 3 with a `what:` line; then rounds * count taps of one site)
    assert len(lines) == count * (6 + 3) + rounds * count * 2
    assert lines[:4] == ["what: floats\n", f"{np.zeros(16, np.float32)}\n", "0\n", "what: bf16\n"]
    last = np.arange(4.0, dtype=np.float32) + rounds * count - 1
    assert lines[-1] == f"{last / 4}\n"
    taps = count * 6 + rounds * count
    assert got["never"]["stats"]["printed_by_worker"] == 0 and got["never"]["worker"] is None
    assert got["always"]["stats"]["printed_by_worker"] == taps
    assert 0 < got["auto"]["stats"]["printed_by_worker"] <= rounds * count
    for mode in got.values():
        assert mode["stats"]["ran"] == mode["stats"]["sent"] == taps
        assert "print worker failed" not in mode["stderr"]
    assert_no_daemon_was_started(runtime_dir)


def test_a_print_worker_that_dies_loses_no_line(runtime_dir: Path) -> None:
    count = 200
    got = run_app(
        "print_worker_killed", str(count), env={"TAPD_PRINT_WORKER": "always"}, runtime=runtime_dir
    )
    assert got["killed"] is not None  # the worker ran, and was killed
    assert got["lines"] == [np.array2string(np.float32(i)) + "\n" for i in range(2 * count)]
    assert "tapd's print worker failed" in got["stderr"]
    assert "renders in this process from now on" in got["stderr"]
    assert count <= got["stats"]["printed_by_worker"] < 2 * count
    assert got["stats"]["errors"] == 0
    wait_until(lambda: not Path(f"/proc/{got['killed']}").exists(), what="the worker is gone")


def test_a_barrier_that_times_out_says_what_it_waits_for(runtime_dir: Path) -> None:
    got = run_app("stuck", runtime=runtime_dir)
    message = got["message"]
    assert message is not None and "timed out after 0.5 s" in message
    assert "wait_for_release" in message  # the site that waits, and what runs
    assert "running stuck.<locals>.wait_for_release" in message
    assert "in wait_for_release" in message  # the receiver thread's stack


def test_calls_outside_jit_and_prints_need_no_daemon(runtime_dir: Path) -> None:
    got = run_app("eager_and_print", runtime=runtime_dir)
    assert got["got"] == [3.0]
    printed = [line for line in got["stdout"].splitlines() if not line.startswith("{")]
    assert printed == ["eager [0 1]", "jitted 7.0"]
    assert_no_daemon_was_started(runtime_dir)


def test_named_and_local_sites_in_one_program_both_deliver(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path
) -> None:
    daemon = start_daemon()  # at the default endpoint of `runtime_dir`
    subscriber = start_subscriber(daemon, "named")
    got = run_app("mixed", "20", runtime=runtime_dir, env={"TAPD_AUTOSTART": "0"})
    assert got["local"] == [float(i + 100) for i in range(20)]
    wait_until(lambda: len(subscriber.records()) == 20, "the named site's 20 taps")
    assert sorted(r["value"] for r in subscriber.records()) == [float(i) for i in range(20)]
    stats = got["stats"]
    assert stats["local"]["ran"] == 20
    assert stats["delivered"] == stats["submitted"] == 40


@pytest.mark.alone  # leaves a dead job's rings for a clean to find
def test_tapd_clean_removes_what_a_killed_process_left_of_its_local_ring(
    runtime_dir: Path,
) -> None:
    """kill -9 leaves a local ring's directory behind (its wake socket; the ring itself
    was unlinked once mapped, so its memory went with the process): `tapd clean` removes
    it, and leaves a live process's alone."""
    code = (
        "import sys, jax, tapd, tapd.debug\n"
        "from tapd.emitter import lifecycle\n"
        "jax.jit(lambda x: tapd.debug.callback(lambda v: None, x))(1.0)\n"
        "print(lifecycle.local_path().directory, flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "TAPD_RUNTIME_DIR": str(runtime_dir)}

    def start() -> tuple[subprocess.Popen[str], Path]:
        process = subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
        assert process.stdout is not None
        return process, Path(process.stdout.readline().strip())

    killed, left = start()
    alive, kept = start()
    try:
        assert killed.poll() is None and alive.poll() is None
        assert left.is_dir() and [p.name for p in left.iterdir()] == ["wake.sock"]
        killed.kill()
        killed.communicate(timeout=PROCESS_TIMEOUT)  # (and its pipes closed)
        result = tapd_cmd("clean", env=env)
        assert result.returncode == 0, result.stderr
        assert not left.exists() and kept.is_dir()
    finally:
        for process in (killed, alive):
            if process.poll() is None or (process.stdin and not process.stdin.closed):
                process.communicate("", timeout=PROCESS_TIMEOUT)
    assert alive.returncode == 0 and not kept.exists()  # a clean exit removes its own
