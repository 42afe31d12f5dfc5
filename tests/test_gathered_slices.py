"""The gathered path over several devices (issue 50; tapd/emitter/gathered/slices.py), on
the CPU with forced devices (`--xla_force_host_platform_device_count`) and
`TAPD_BACKEND=portable TAPD_GATHER=on`, what a TPU slice gets by default.

Each kind of computation over several devices (tests/apps/gathered_slices_app.py: a
`shard_map`, a `pmap`, a `jit` around a `pmap`, a `shard_map` called at each step of a
loop (tapd.emitter.gathered.threaded), a `jit` over a mesh of Explicit axes (each tap of
a sharded value a `shard_map` of its own: threaded too), a `jit` the compiler partitions
over a mesh) runs a tapping loop (a `cond` in it taps too) and a tap after a `psum`, twice:
gathered, every device's taps must be those of the per-tap path (the reference,
`TAPD_GATHER=off`), value for value, in the same order, with the same device; and the
host callbacks a call runs (`tapd.stats()["host_callbacks"]`, the figure that costs ~1 ms
each on a TPU) drop from one a tap to none where each device's taps fit its log (they
leave as its shard of the computation's output; one flush in all for the partitioned
jit, whose taps are of whole values), or, with a log of 3 records, to a few a device.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, native_unavailable
from tapd.emitter.jax_compat import cpu_partition_id_in_branches

pytestmark = [
    pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable())),
    pytest.mark.skipif(
        not cpu_partition_id_in_branches(),
        reason="this JAX's CPU compiler aborts on a device's flush in a cond: no slice is "
        "gathered on its CPU (tapd.emitter.jax_compat.versions.cpu_partition_id_in_branches)",
    ),
    pytest.mark.timeout(600),
]

STEPS = 50
CALLS = 2
# Taps a device makes a call: "first", 50 "step", 17 "cond" (j % 3 == 0), "after".
TAPS_A_DEVICE = 1 + STEPS + math.ceil(STEPS / 3) + 1


# A reference (`TAPD_GATHER=off`) that two tests compare with, run once for both: the
# same program with the same arguments and environment (its outcome is the program's,
# not the test's). Their tests share an xdist group (SHARED_REFERENCE), so that one
# worker runs both; elsewhere (-n0, another worker) the program simply runs again.
_references: dict[tuple[str, int], dict[str, Any]] = {}


def reference_run(kind: str, devices: int) -> dict[str, Any]:
    if (kind, devices) not in _references:
        _references[kind, devices] = run(kind, devices, TAPD_GATHER="off")
    return _references[kind, devices]


def run(kind: str, devices: int, **env: str) -> dict[str, Any]:
    full_env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TAPD_AUTOSTART": "0",
        "TAPD_BACKEND": "portable",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        **env,
    }
    argv = [sys.executable, str(APPS / "gathered_slices_app.py"), kind, str(STEPS)]
    result = run_program(argv, env=full_env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "could not gather" not in result.stderr
    outcome: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return outcome


# The references on 4 devices that test_a_small_log_... compares with too.
SHARED_REFERENCE = {"shard_map", "explicit"}


def sharing(kind: str, devices: int) -> Any:
    """`(kind, devices)` as a case, in the xdist group of the reference it shares."""
    if devices == 4 and kind in SHARED_REFERENCE:
        return pytest.param(kind, devices, marks=pytest.mark.xdist_group(f"slices-{kind}-4"))
    return pytest.param(kind, devices)


CASES = [
    ("shard_map", 1),
    ("shard_map", 2),
    ("shard_map", 4),
    ("shard_map", 8),
    ("pmap", 1),
    ("pmap", 2),
    ("pmap", 8),
    ("jit_of_pmap", 4),
    ("shard_map_in_loop", 2),
    ("shard_map_in_loop", 8),
    ("explicit", 2),
    ("explicit", 4),
    ("explicit", 8),
    ("explicit_2d", 4),
    ("while", 4),
    ("sharded_jit", 2),
    ("sharded_jit", 8),
]


@pytest.mark.parametrize(("kind", "devices"), [sharing(*case) for case in CASES])
def test_each_device_gathers_its_taps_and_they_leave_as_an_output(kind: str, devices: int) -> None:
    reference = reference_run(kind, devices)
    gathered = run(kind, devices, TAPD_GATHER="on")
    per_device = 1 if kind == "sharded_jit" else devices  # (its taps: whole values, once)
    assert reference["taps"] == CALLS * per_device * TAPS_A_DEVICE
    assert reference["host_callbacks"] == reference["taps"]  # one a tap
    assert gathered["per_device"] == reference["per_device"]
    assert gathered["out"] == reference["out"]
    if kind == "sharded_jit":  # one flush a call, on its first device
        assert gathered["host_callbacks"] == CALLS
    else:  # each device's log its shard of the output: no host callback
        assert gathered["host_callbacks"] == 0
    assert len(gathered["per_device"]) == per_device


def test_id_tap_s_device_index_in_a_sharded_jit_taps_on_that_device() -> None:
    """`device_index=1` in a jit over two devices: each tap runs on the second device, as
    on the per-tap path (which such a computation keeps, gathered or not)."""
    reference = run("device_index", 2, TAPD_GATHER="off")
    gathered = run("device_index", 2, TAPD_GATHER="on")
    [device] = reference["per_device"]
    assert device.endswith("1"), device  # (cpu:1, TFRT_CPU_1: the second device)
    assert gathered["per_device"] == reference["per_device"]
    assert gathered["out"] == reference["out"]
    assert gathered["taps"] == reference["taps"] == CALLS * STEPS


@pytest.mark.parametrize(
    ("kind", "devices"),
    [sharing(kind, 4) for kind in ("shard_map", "pmap", "shard_map_in_loop", "explicit")],
)
def test_a_small_log_flushes_in_the_loop_and_keeps_every_tap_in_order(
    kind: str, devices: int
) -> None:
    reference = reference_run(kind, devices)
    gathered = run(kind, devices, TAPD_GATHER="on", TAPD_GATHER_TAPS="3", TAPD_GATHER_LOG_BYTES="1")
    assert gathered["per_device"] == reference["per_device"]
    # Records of a device a call, in logs of 3 (a loop flushes by chunks, so a few
    # more), the last of them leaving as an output.
    least = CALLS * devices * (math.ceil(TAPS_A_DEVICE / 3) - 1)
    assert least <= gathered["host_callbacks"] < reference["host_callbacks"]


def test_vmap_grad_and_checkpoint_in_a_body_tap_as_the_per_tap_path_does() -> None:
    reference = run("transforms", 4, TAPD_GATHER="off")
    gathered = run("transforms", 4, TAPD_GATHER="on")
    assert reference["taps"] > 0
    assert gathered["per_device"] == reference["per_device"]
    assert gathered["out"] == reference["out"]
    assert gathered["host_callbacks"] == 0 < reference["host_callbacks"]


def test_a_tap_function_s_exception_surfaces_at_the_next_barrier() -> None:
    """Raised on every device's step 7, twice a device: the barrier raises it, as on the
    per-tap path, and every other tap has run."""
    reference = run("failing", 4, TAPD_GATHER="off")
    gathered = run("failing", 4, TAPD_GATHER="on")
    for outcome in (reference, gathered):
        assert outcome["raised"] is not None and "tap function failed at 7" in outcome["raised"]
        assert outcome["taps"] == CALLS * 4 * (STEPS - 1)
    assert gathered["host_callbacks"] == 0


def test_a_full_ring_under_drop_newest_counts_every_drop_on_every_device() -> None:
    """50 taps of 4 KiB a device, 4 devices, into a 64 KiB ring whose tap function
    takes a millisecond: each device's taps that ran are in order, and every tap ran or
    was counted dropped."""
    env = {"TAPD_BUFFER_BYTES": str(64 * 1024), "TAPD_EMITTER_POLICY": "drop_newest"}
    steps = STEPS
    for gather in ("off", "on"):
        got = run("drop", 4, TAPD_GATHER=gather, **env)
        dropped = got["stats"]["dropped"]
        assert dropped > 0 and got["taps"] + dropped == 4 * steps, gather
        for device, records in got["per_device"].items():
            values = [value for _, value in records]
            assert values == sorted(set(values)), (gather, device)


def test_barriers_return_once_every_earlier_tap_of_every_device_has_run() -> None:
    for gather in ("off", "on"):
        got = run("barriers", 4, TAPD_GATHER=gather)
        assert got["seen"] == [got["expected"]] * 2, gather


def test_the_exit_drain_runs_every_device_s_taps_left_behind(tmp_path: Path) -> None:
    for gather in ("off", "on"):
        path = tmp_path / f"{gather}.lines"
        run("exit", 4, TAPD_GATHER=gather, SLICES_EXIT_FILE=str(path))
        lines = [line.split() for line in path.read_text().splitlines()]
        for device in {device for device, _ in lines}:
            values = [int(value) for dev, value in lines if dev == device]
            assert values == list(range(STEPS)), (gather, device)
        assert len(lines) == 4 * STEPS, gather


def test_jax_export_refuses_a_slice_s_taps_as_on_the_per_tap_path() -> None:
    """Gathered or not, an export of tapping computations over several devices is
    refused with the per-tap path's message (an export is never gathered)."""

    def unnamed(text: str) -> str:
        return re.sub(r"'local/[^']*'", "'SITE'", text)

    reference = run("export", 4, TAPD_GATHER="off")
    gathered = run("export", 4, TAPD_GATHER="on")
    for form, said in gathered["exported"].items():
        assert said.startswith("TapDefinitionError: tap site 'local/"), (form, said)
        assert "cannot be exported" in said, form
        assert unnamed(said) == unnamed(reference["exported"][form]), form
