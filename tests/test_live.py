"""Live gathered loops (issue 51; tapd/emitter/gathered/live.py), on the CPU where
`TAPD_BACKEND=portable TAPD_GATHER=on` forces the gathered path a TPU takes by default.

A long loop's taps reach their tap function while it runs, within about
`gather_latency` seconds, whatever its step time: the host paces the device's chunks.
The reference is the same program with `TAPD_GATHER_LATENCY=0` (a loop flushes only
when its log fills): every tap of a loop shorter than its log arrives at the end. The
bound is set from that reference's own duration (an eighth of it), so that the test
holds on a machine of any speed; each call must then show its first tap and every gap
between taps within half the call (4 latencies: a chunk is paced at half of one). And
at the log's edges (a log of 8 taps; loops of 7 to 33 steps, one or three taps a
step, `scan` and `while`, live or not), every value arrives once, in program order,
as eager execution makes them, whether a paced flush's bytes are written by the
outputs' thread or, where too many wait there, by the flush itself.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, native_unavailable

pytestmark = [
    pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable())),
    pytest.mark.timeout(600),
]

STEPS = {"while": 40, "scan": 100}  # a 20 ms host sleep, or a 1000² matmul, a step


def run(*args: str, **env: str) -> dict[str, Any]:
    full_env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TAPD_AUTOSTART": "0",
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        **env,
    }
    argv = [sys.executable, str(APPS / "live_app.py"), *args]
    result = run_program(argv, env=full_env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "could not gather" not in result.stderr
    outcome: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return outcome


def gaps(call: dict[str, Any]) -> list[float]:
    """The time to the first tap, then between taps, of one call."""
    times = [call["start"], *call["times"]]
    return [later - earlier for earlier, later in itertools.pairwise(times)]


@pytest.mark.parametrize("kind", ["while", "scan"])
def test_a_long_loop_s_taps_arrive_while_it_runs(kind: str) -> None:
    steps = STEPS[kind]
    reference = run("timed", kind, str(steps), TAPD_GATHER_LATENCY="0")
    for call in reference["calls"]:
        assert call["values"] == list(range(steps))
        duration = call["end"] - call["start"]
        # (not live: the log holds the whole loop, written at its end)
        assert call["times"][0] - call["start"] >= 0.8 * duration, gaps(call)
    duration = reference["calls"][-1]["end"] - reference["calls"][-1]["start"]
    latency = duration / 8
    live = run("timed", kind, str(steps), TAPD_GATHER_LATENCY=f"{latency:.4f}")
    for call in live["calls"]:
        assert call["values"] == list(range(steps))
        assert max(gaps(call)) <= 4 * latency, (latency, gaps(call))
    # (the chunks' answers are host callbacks: fewer than one a step over the calls; the
    # while loop's 20 ms steps are paced two a chunk, ~40 answers for its 2 x 40 steps)
    assert 2 < live["host_callbacks"] < len(live["calls"]) * steps


# Logs of 8 KiB of 1 KiB taps: 8 records, and a count known before the run that packs
# into 16 KiB (15 records and the head) in one log (`TAPD_GATHER_LOG_BYTES`).
BYTES_BOUND = {
    "TAPD_GATHER_TAPS": "1024",
    "TAPD_GATHER_BYTES": "8192",
    "TAPD_GATHER_LOG_BYTES": "16384",
    "LIVE_THRESHOLD_ROW": "256",
}


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"LIVE_LATER_BYTES": "0"},
        {"TAPD_GATHER_LATENCY": "0"},
        BYTES_BOUND,
        {**BYTES_BOUND, "TAPD_GATHER_LATENCY": "0"},
    ],
    ids=["handed_off", "written_in_flush", "unpaced", "bytes_bound", "bytes_bound_unpaced"],
)
def test_no_tap_is_lost_or_reordered_at_the_log_s_edges(env: dict[str, str]) -> None:
    """Whether a paced flush hands its bytes to the outputs' thread (the default) or,
    with no room for them there (`taps_as_outputs.LATER_BYTES`), writes them itself; and
    unpaced, where a loop is flushed by its log alone (its flushes as even as the log
    allows: `choose.plan_buffers`). Logs bound by their bytes (vector taps): a scan of
    9 or 15 steps of one tap in one log of more than the bound, of 16 and more, and a
    while loop (its count not known), flushed."""
    result = run("thresholds", **{"TAPD_GATHER_TAPS": "8", "TAPD_GATHER_LOG_BYTES": "1", **env})
    for case, outcome in result["cases"].items():
        assert outcome["got"] == outcome["expected"], case
