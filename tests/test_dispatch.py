"""A tapped step keeps JAX's C++ dispatch path (issue 26), and what users rely on holds:
program order inside one computation, the barrier over calls still in flight, strict
taps. Real daemon, subscriber and JAX processes, once per emitter backend."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, SubscriberProcess, run_emitter

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def run_dispatch(daemon: Daemon, scenario: str, *args: str, **env: str) -> dict[str, Any]:
    return run_emitter(daemon.endpoint, scenario, *args, env=env, app="dispatch_app.py")


@pytest.mark.parametrize("ordered", ["1", "0"])
def test_a_tapped_step_dispatches_through_jax_cpp_path(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str, ordered: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "fast")  # woken: the taps copy and deliver
    result = run_dispatch(daemon, "fast_path", ordered, "200")
    # After its first calls, JAX serves every call of the step from C++: none reaches
    # `_pjit_call_impl_python`.
    assert result["jit_python_calls"] == 0
    if backend == "native":  # (JAX keeps an executable with host callbacks off AOT's path)
        assert result["aot_python_calls"] == 0
    assert result["stats"]["delivered"] == 404  # 2 + 200 jit calls, 2 + 200 AOT calls
    assert [r["seq"] for r in subscriber.records()] == list(range(404))


def test_a_strict_tap_keeps_jax_ordered_effect_and_its_python_path(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    start_subscriber(daemon, "fast")
    result = run_dispatch(daemon, "fast_path", "strict", "50")
    # The check above can fail: a strict tap's step runs every call through Python.
    assert result["jit_python_calls"] == 50
    assert result["aot_python_calls"] == 50
    assert result["stats"]["delivered"] == 104


@pytest.mark.parametrize("kind", ["closure", "print"])
def test_id_tap_and_id_print_keep_jax_cpp_path_in_a_one_device_jit(
    start_daemon: StartDaemon, backend: str, kind: str
) -> None:
    """host_callback's order, in a computation on one device, comes from tapd's token:
    an id_tap (of a closure: the local ring) or an id_print (of plain keywords: through
    the daemon, printed here where no subscriber takes it) leaves the step on JAX's C++
    dispatch path, and the calls' taps still run in dispatch order."""
    daemon = start_daemon()
    result = run_dispatch(daemon, "hcb_fast_path", kind, "default", "200")
    assert result["jit_python_calls"] == 0
    if kind == "closure":
        assert result["seen"] == 202
        assert result["in_order"]
    else:
        assert result["stdout"].count("what: fastprint") == 202


@pytest.mark.parametrize("how", ["keyword", "setting"])
def test_a_strict_id_tap_keeps_jax_ordered_effect_and_its_python_path(
    start_daemon: StartDaemon, backend: str, how: str
) -> None:
    """`id_tap(..., ordered="strict")`, or TAPD_ORDERED=strict for every tap, is JAX's
    ordered effect: every call through JAX's Python dispatch."""
    daemon = start_daemon()
    if how == "keyword":
        result = run_dispatch(daemon, "hcb_fast_path", "closure", "strict", "50")
    else:
        result = run_dispatch(
            daemon, "hcb_fast_path", "closure", "default", "50", TAPD_ORDERED="strict"
        )
    assert result["jit_python_calls"] == 50
    assert result["seen"] == 52
    assert result["in_order"]


def test_id_taps_of_a_jit_of_pmap_are_strict_and_keep_host_callback_order(
    start_daemon: StartDaemon, backend: str
) -> None:
    """host_callback's `tap_jit_pmap_extra`: a tap before a pmap, one inside it, one after
    it, in one jit over two devices. The module is partitioned, where tapd's order pass
    does not run: the taps inside the pmap (and the one after it, of a value on both
    devices) are strict, and the one before it is joined to their token, so each device
    runs its taps in program order, and the calls in dispatch order."""
    daemon = start_daemon()
    calls = 20
    result = run_dispatch(
        daemon, "hcb_jit_of_pmap", str(calls), XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert result["jit_python_calls"] == calls
    assert result["ran"] == {
        "0": ["before", "inside", "after"] * (calls + 2),
        "1": ["inside"] * (calls + 2),
    }


def test_taps_of_tapd_token_and_strict_taps_in_one_jit_keep_one_program_order(
    start_daemon: StartDaemon, backend: str
) -> None:
    """Where one computation holds both kinds, all its ordered taps take JAX's token
    (`program_order.chained`): around a scan that taps both ways, and a cond whose
    strict tap takes JAX's token from above."""
    daemon = start_daemon()
    result = run_dispatch(daemon, "hcb_mixed_order", "5")
    per_call = ["a", "s1", "loop", "strict_loop", "loop", "strict_loop", "big", "strict_cond", "b"]
    assert result["ran"] == per_call * 5


def test_an_id_tap_under_a_mesh_of_two_cpu_devices_takes_jax_python_dispatch(
    start_daemon: StartDaemon, backend: str
) -> None:
    """Over several CPU devices a tapped step keeps JAX's runtime token (the barrier
    waits for each device's part: jax_compat.dispatch), so each call goes through Python;
    its taps are ordered by tapd's token (program_order), which holds there too."""
    daemon = start_daemon()
    result = run_dispatch(
        daemon, "hcb_under_a_mesh", "20", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert result["jit_python_calls"] == 20
    assert result["seen"] == 22


def test_taps_around_scan_cond_while_and_a_nested_jit_arrive_in_program_order(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "order")
    calls = 20
    result = run_dispatch(daemon, "program_order", str(calls))
    per_call = [0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]
    records = subscriber.records()
    assert result["stats"]["delivered"] == calls * len(per_call)
    # One consumer keeps its records in the order the emitter's ring holds them, which
    # is the order the taps ran in.
    assert [(r["step"], r["value"]) for r in records] == [
        (call, value) for call in range(calls) for value in per_call
    ]


def test_barrier_wait_waits_for_1000_calls_still_in_flight(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "flight")
    result = run_dispatch(daemon, "in_flight", "1000")
    # The calls took JAX's C++ path (no runtime token for jax.effects_barrier to wait
    # on), and were still running when the loop ended (native; the portable backend's
    # callbacks keep pace with dispatch here).
    assert result["python_dispatches"] == 0
    if backend == "native":
        assert result["dispatched_before_done"]
    # By the time barrier_wait returned, every tap of every call had been delivered.
    assert result["stats_at_barrier"]["delivered"] == 1001
    assert [r["step"] for r in subscriber.records()] == [-1, *range(1000)]


def test_jax_effects_barrier_still_waits_for_tapped_calls_in_flight(
    start_daemon: StartDaemon, backend: str
) -> None:
    """A tapped call keeps no runtime token for `jax.effects_barrier()` to wait on; tapd
    makes JAX's barrier wait for the devices too, as it did for any call with an effect."""
    daemon = start_daemon()
    result = run_dispatch(daemon, "effects_barrier_in_flight", "500", "4")
    if backend == "native":  # (a round the machine's load let finish first proves nothing)
        assert any(result["dispatched_before_done"])
    assert result["ready"] == [True] * 4
    assert result["taps_run"] == [500, 1000, 1500, 2000]


def test_the_exit_drain_delivers_every_tap_of_calls_still_in_flight(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "exit")
    result = run_dispatch(daemon, "exit_in_flight", "500")
    if backend == "native":
        assert result["dispatched_before_done"]
    # The process has exited: its exit drain waited for the device, then for delivery.
    assert [r["step"] for r in subscriber.records()] == list(range(500))


def test_barrier_wait_inside_a_mesh_context(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "mesh")
    result = run_dispatch(
        daemon, "under_a_mesh", XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    assert result["out"] == [0.0, 2.0, 4.0, 6.0]
    assert result["stats"]["delivered"] == 1
    assert [r["value"] for r in subscriber.records()] == [[0.0, 1.0, 2.0, 3.0]]


def test_a_big_portable_tap_asks_first_and_a_small_one_does_not(tmp_path: Path) -> None:
    """On the portable backend a tap of 64 KiB or more is lowered as a question to the
    host (does its site want this tap?) and a `case` around the callback that takes the
    operands, so that a dormant one copies nothing to the host; a small tap is one
    callback. (Its counts: test_dormant_emitter; its order: the program-order test.)"""
    script = (
        "import jax, jax.numpy as jnp, tapd\n"
        "def lowered(n):\n"
        "    f = jax.jit(lambda x: tapd.tap(x, 'q') * 2)\n"
        "    return f.lower(jnp.ones(n, jnp.float32)).as_text()\n"
        "big, small = lowered(2**16), lowered(16)\n"
        "print(tapd.backend(), big.count('stablehlo.case'), small.count('stablehlo.case'))\n"
    )
    # (No daemon to lower against: at the default endpoint, autostart off, the tap would
    # fail at trace time; at another, it waits for one.)
    endpoint = f"ipc://{tmp_path}/tapd.sock"
    env = {**os.environ, "TAPD_BACKEND": "portable", "TAPD_ENDPOINT": endpoint}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["portable", "1", "0"], done.stdout
