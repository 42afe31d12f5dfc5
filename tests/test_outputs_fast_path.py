"""A gathered computation's output on JAX's C++ dispatch path
(tapd/emitter/outputs_fast_path.py), on the CPU where `TAPD_BACKEND=portable
TAPD_GATHER=on` gathers as on a TPU.

Each program is a plain `jax.jit` called again and again: its first call takes JAX's
Python path, the next ones the C++ path. What a user sees is checked against the
references: every tap's values against numpy's, the programs' results against the
untapped functions', and the records the ring keeps (seqs, steps) through dormant,
woken, mixed and sampled sites against one host callback a tap (`TAPD_GATHER=off`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import native_unavailable, run_own_ring_app


def run(runtime_dir: Path, scenario: str, gather: str, **settings: str) -> dict[str, Any]:
    """One scenario of tests/apps/fast_path_app.py (it reads its own ring back)."""
    return run_own_ring_app(runtime_dir, "fast_path_app.py", scenario, gather, **settings)


@pytest.mark.parametrize("fast_dispatch", ["1", "0"])
def test_calls_on_the_cpp_path_return_what_jax_computes_and_tap_what_numpy_computes(
    runtime_dir: Path, fast_dispatch: str
) -> None:
    """Loops, a scan returning a dict with None in it and a constant captured, a cond
    taken every other call, donated arguments, a loop of 64 KiB taps (its log of more
    than 1 MiB leaves in rows, gathered.host.as_rows): six calls each, all but the first on the
    C++ path where the call's taps are counted before it runs; the results as the
    untapped functions give them, every tap in order with numpy's values. With
    TAPD_GATHER_FAST_DISPATCH=0, the same on JAX's Python path every call."""
    result = run(runtime_dir, "values", "on", TAPD_GATHER_FAST_DISPATCH=fast_dispatch)
    assert result["results"] == {
        name: [True] * 6 for name in ("loop", "pytree", "branch", "donated", "big")
    }
    assert result["seen"] == result["expected"]
    # Each program's first call takes JAX's Python path; the other five, the C++ path,
    # but the cond's: a tap in one arm only, its count not known before a call runs.
    fast = 5 if fast_dispatch == "1" else 0
    assert result["fast_by_program"] == {
        "loop": fast,
        "pytree": fast,
        "branch": 0,
        "donated": fast,
        "big": fast,
    }
    assert result["stats"]["host_callbacks"] == 0


def test_threads_calling_one_step_at_once_lose_no_tap(runtime_dir: Path) -> None:
    """Three threads call one jitted step 40 times each, at once, its caches cleared in
    the middle of it (`jax.clear_caches()`): every tap of every call arrives, once, with
    its values, and most calls were served by the C++ path."""
    result = run(runtime_dir, "threads", "on")
    assert result["seen"] == result["expected"]
    assert result["fast"] >= 100


@pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))
def test_dormant_woken_mixed_and_sampled_sites_keep_what_one_callback_a_tap_keeps(
    runtime_dir: Path,
) -> None:
    """Two programs (one site; two sites of their own consumers) through six settings of
    the site table, six calls each: the ring's records (seq, step) of every site are
    those of one host callback a tap. Dormant calls move nothing and stay on the C++
    path; a sampled consumer turns its program back to the Python path (sampled on the
    device), until its sampling stops."""
    reference = run(runtime_dir, "slots", "off")
    gathered = run(runtime_dir, "slots", "on")
    assert gathered["records"] == reference["records"]
    assert gathered["skipped"] == reference["skipped"]
    assert reference["fast"] == 0
    fast = gathered["fast_by_phase"]
    # 12 calls a setting; every one on the C++ path but where a site is sampled: the
    # first call that finds one so comes from the C++ path (and drops every program's),
    # the rest from Python's; woken again, the C++ path comes back within two calls of
    # each program (the first call of `one` on the Python path drops the caches again).
    assert fast["woken"] == fast["dormant"] == fast["mixed"] == 12
    assert fast["sampled"] == 1
    assert fast["woken again"] >= 9 and fast["dormant again"] == 12
    moved = gathered["moved"]
    assert moved["dormant"] == 0
    assert 0 < moved["dormant again"] < moved["woken"]  # (`two`'s outputs only)


@pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))
def test_a_dormant_steps_twin_runs_without_its_taps_and_a_wake_is_acknowledged_first(
    runtime_dir: Path,
) -> None:
    """Two steps (one donating its argument), their sites made dormant, then woken,
    dormant and woken again, as the daemon does it: dormant, each step gets its twin
    (tapd/emitter/dormant_twin.py), compiled without its taps, which serves its calls
    with the results of the untapped function; a wake of a site a twin holds is
    acknowledged before it holds (the app waits for it, as the daemon's welcome does),
    and every call after it taps, with the seqs one host callback a tap gives: every
    execution counted, the dormant ones skipped."""
    result = run(runtime_dir, "twin", "on")
    assert all(result["same"]) and len(result["same"]) > 20
    phases = result["phases"]
    for phase in ("dormant", "dormant again"):
        assert min(phases[phase]["twin_calls"].values()) >= 5, phases
    for phase in ("woken", "woken again"):
        assert phases[phase]["twin_calls"] == {"plain": 0, "donated": 0}, phases
        # (each step's twin held its sites: the wake waited for the acknowledgment)
        assert phases[phase]["waited"] == {"plain": True, "donated": True}, phases
    # The records of each site, against one host callback a tap: the first call, then
    # every woken call's three steps; seqs count the dormant calls between.
    dormant_calls = {"plain": 0, "donated": 0}
    for name in ("plain", "donated"):
        expected, seq = [[0, 0], [1, 1], [2, 2]], 3
        for phase in ("dormant", "woken", "dormant again", "woken again"):
            count = phases[phase]["calls"][name]
            if phase.startswith("dormant"):
                seq += 3 * count
                dormant_calls[name] += count
            else:
                for _ in range(count):
                    expected += [[seq, 0], [seq + 1, 1], [seq + 2, 2]]
                    seq += 3
        assert result["records"][name] == expected
    assert result["skipped"] == 3 * sum(dormant_calls.values())
    assert not any(result["relied_on"])  # (woken last: every site acknowledged)
