"""Sampling decided on the device (issue 51; tapd/emitter/gathered/sampling.py), on the
CPU with `TAPD_BACKEND=portable TAPD_GATHER=on`, what a TPU gets by default.

A site's tap is sent where its seq (per consumer and device, counting every execution) is
a multiple of W, its own `every=K` times its subscribers' one-in-N. Each scenario of
tests/apps/gathered_sampling_app.py runs gathered and on the per-tap path (the reference,
`TAPD_GATHER=off`, where the ring decides each tap as it is written): the records must be
the same (seq and step), every tap counted, sent or skipped; and gathered, what moves
off the device is the kept taps only, where the call's count of taps is known before it
runs. Where it is not (a `while`), the phase of the next call is a guess: a tap kept on
a wrong guess is counted as skipped by the ring, never sent with a wrong seq.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import native_unavailable, run_own_ring_app

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))


def run(
    runtime_dir: Path, scenario: str, gather: str, *args: str, **settings: str
) -> dict[str, Any]:
    """One scenario of tests/apps/gathered_sampling_app.py (it reads its own ring back)."""
    app = "gathered_sampling_app.py"
    return run_own_ring_app(runtime_dir, app, scenario, gather, *args, **settings)


def taps_of(result: dict[str, Any], name: str) -> int:
    """Every tap of `name`, sent or skipped (its next seq)."""
    sent = len(result["records"].get(name, []))
    return sent + result["stats"]["skipped_by_consumer"].get(name, 0)


@pytest.mark.parametrize(
    ("scenario", "name", "every", "calls", "steps"),
    [
        ("every", "e100", 100, 3, 1000),
        ("subscribers", "k2n3", 6, 3, 40),
        ("live", "live7", 7, 2, 3000),
    ],
)
def test_sampled_out_taps_move_nothing_and_the_kept_ones_are_the_rings(
    runtime_dir: Path, scenario: str, name: str, every: int, calls: int, steps: int
) -> None:
    """Calls back to back (each dispatched before the last is written): the kept taps
    are the reference's, seq for seq and step for step, and only they move."""
    reference = run(runtime_dir, scenario, "off")
    gathered = run(runtime_dir, scenario, "on")
    total = calls * steps
    expected = [[seq, seq % steps] for seq in range(0, total, every)]
    assert reference["records"][name] == expected
    assert gathered["records"][name] == expected
    assert taps_of(gathered, name) == taps_of(reference, name) == total
    assert sum(gathered["moved"]) == len(expected)


@pytest.mark.parametrize("dormancy", ["1", "0"])
def test_a_log_holds_what_the_device_keeps_of_a_site_sampled_by_its_own_every(
    runtime_dir: Path, dormancy: str
) -> None:
    """Logs of 9 records (TAPD_GATHER_TAPS=9), a loop of 40 steps tapping with every=5:
    the device keeps at most 8 of a call's taps (and writes one more where the next kept
    one would go), so one log holds them and the loop never flushes while it runs (no
    host callback: on a TPU ~2 ms a call, run or not); then the subscribers' one in 3
    (W = 15). The records are the per-tap path's. With
    TAPD_DORMANT=0 the site is `always` (the device keeps every tap, the ring samples,
    by 5 alone): the loop flushes while it runs, and the per-tap path's records come."""
    settings = {"TAPD_GATHER_TAPS": "9", "TAPD_GATHER_LOG_BYTES": "1", "TAPD_DORMANT": dormancy}
    reference = run(runtime_dir, "bounded", "off", **settings)
    gathered = run(runtime_dir, "bounded", "on", **settings)
    # (An `always` site is never thinned by its subscribers: one in 5 throughout.)
    thinned = 15 if dormancy == "1" else 5
    expected = [[seq, seq % 40] for seq in range(0, 120, 5)]
    expected += [[seq, seq % 40] for seq in range(120, 240) if seq % thinned == 0]
    assert reference["records"]["b5"] == expected
    assert gathered["records"]["b5"] == expected
    assert taps_of(gathered, "b5") == 240
    if dormancy == "1":
        assert gathered["stats"]["host_callbacks"] == 0
        assert gathered["moved"] == [8, 8, 8, 3, 3, 2]
    else:
        assert gathered["stats"]["host_callbacks"] >= 6 * 4
        assert sum(gathered["moved"]) == 240  # (every tap kept: 5 logs a call)


def test_a_consumer_tapped_by_two_sites_is_sampled_by_the_ring(runtime_dir: Path) -> None:
    """Its seq counts both sites' taps: the device keeps all of them, the ring samples."""
    reference = run(runtime_dir, "shared", "off")
    gathered = run(runtime_dir, "shared", "on")
    assert gathered["records"]["two"] == reference["records"]["two"]
    assert [seq for seq, _ in gathered["records"]["two"]] == list(range(0, 80, 3))
    assert sum(gathered["moved"]) == 80


def test_a_change_of_the_subscribers_sampling_applies_from_the_next_call(
    runtime_dir: Path,
) -> None:
    reference = run(runtime_dir, "resampled", "off")
    gathered = run(runtime_dir, "resampled", "on")
    assert gathered["records"]["re"] == reference["records"]["re"]
    kept = [seq for seq, _ in gathered["records"]["re"]]
    expected = [s for s in range(0, 30, 5)] + list(range(30, 60))
    expected += [s for s in range(60, 90) if s % 4 == 0] + [s for s in range(90, 120) if s % 3 == 0]
    assert kept == expected
    assert taps_of(gathered, "re") == 120
    assert sum(gathered["moved"]) == len(expected)


def test_a_call_of_unknown_count_leaves_the_next_a_guess_never_a_wrong_seq(
    runtime_dir: Path,
) -> None:
    """A `while` between loops of one consumer: its taps are not reserved when it is
    dispatched, so the next call's phase is guessed from the ring. Every tap sent has a
    seq the ring would send (a multiple of 4), with the step its tap had; every tap is
    counted; the reference's are all sent once the calls before are written (the last
    loop's, dispatched after a guess, at least from its first flush on)."""
    reference = run(runtime_dir, "mixed", "off")
    gathered = run(runtime_dir, "mixed", "on")
    ref = {seq: step for seq, step in reference["records"]["mix"]}
    assert sorted(ref) == list(range(0, 95, 4))
    got = gathered["records"]["mix"]
    assert got, "nothing sent"
    for seq, step in got:
        assert seq % 4 == 0 and ref[seq] == step
    assert [seq for seq, _ in got] == sorted(seq for seq, _ in got)
    assert taps_of(gathered, "mix") == 95
    # The first call's taps are reserved before anything else runs: those are exact.
    assert [seq for seq, _ in got if seq < 25] == [0, 4, 8, 12, 16, 20, 24]


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_random_programs_whose_counts_are_known_send_the_references_taps(
    runtime_dir: Path, seed: int
) -> None:
    """Random loops over three consumers (random `every`, one or two taps a step, two
    sites of one consumer at times), called in a random order, back to back, the
    subscribers' one-in-N changed between some: the same records as the per-tap path,
    and only those move off the device."""
    reference = run(runtime_dir, "random", "off", str(seed), "known")
    gathered = run(runtime_dir, "random", "on", str(seed), "known")
    assert not gathered["unknown"]
    assert gathered["records"] == reference["records"]
    counted = gathered["stats"]["skipped_by_consumer"]
    assert counted == reference["stats"]["skipped_by_consumer"]
    sent = sum(len(records) for records in gathered["records"].values())
    assert sent > 0 and sum(counted.values()) > 0
    assert sum(gathered["moved"]) < sent + sum(counted.values())


@pytest.mark.parametrize("seed", [21, 22])
def test_random_programs_with_unknown_counts_send_no_wrong_seq(
    runtime_dir: Path, seed: int
) -> None:
    """The same with `while` loops and branches that tap in one arm: every record sent
    is one the per-tap path sends (seq and step), in order, and every tap is counted."""
    reference = run(runtime_dir, "random", "off", str(seed), "any")
    gathered = run(runtime_dir, "random", "on", str(seed), "any")
    assert gathered["unknown"]  # (the seeds chosen for it)
    for name, records in reference["records"].items():
        expected = {seq: step for seq, step in records}
        got = gathered["records"].get(name, [])
        assert all(expected.get(seq) == step for seq, step in got), name
        assert [seq for seq, _ in got] == sorted(seq for seq, _ in got)
        assert taps_of(gathered, name) == taps_of(reference, name)
