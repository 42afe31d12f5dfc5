"""Big taps and long loops on a TPU (issue 51): what a tap of 64 KiB to 4 MiB a step
costs against the floor of moving its bytes, woken and dormant, and how soon a long
loop's taps arrive.

    python bench/tpu_live.py [--quick] [--live-only|--sampled-only|--big-only]
                             [--out bench/RESULTS-tpu-live.md] [--log PATH]

The parent starts a tapd daemon and a subscriber for the woken big taps ("big"), then
one child (TAPD_GATHER=auto: the gathered path on a TPU). Each cell of the grid is a
`fori_loop` that taps `x` every step, timed in steady state as the issue does: a few
calls back to back (`_calls`), then every tap run in the subscriber (one
`barrier_wait`), µs a step, medians of interleaved rounds. The floor: the same values
returned as `scan` outputs and fetched with `np.asarray`. Live loops: a 2500-step loop
of two 4096² matmuls a step (~1.4 ms) and a 60-step loop of ~100 ms steps, each tapping
its step index to a function in this process; the time of its first tap after the call starts,
and the largest gap between taps. Cells of more than 400 MiB a call are left out (a
TPU host moves them in seconds a call; the rate is that of 100 steps).

Other cells of the grid: `TPU_BIG_CELLS=1MiB:9,2MiB:8,4MiB:4` (sizes in B, KiB or MiB of
float32; with --big-only, only those). `--small-only`: the small taps' cells of issue 63
(64 B x 5000, 1 KiB x 5000, 4 KiB x 2000, 64 KiB x 1000), where a tap's cost is per
record rather than per byte.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIZES = {"64KiB": 2**14, "1MiB": 2**18, "4MiB": 2**20}  # float32 elements
STEP_COUNTS = (1, 7, 8, 9, 100, 1000)


def grid(quick: bool) -> list[tuple[str, int, int]]:
    """The big taps' cells: (size's name, float32 elements, steps)."""
    chosen = os.environ.get("TPU_BIG_CELLS")
    if not chosen:
        return [
            (name, elements, steps)
            for name, elements in SIZES.items()
            for steps in STEP_COUNTS
            if elements * 4 * steps <= MOST_BYTES_A_CALL and not (quick and steps > 9)
        ]
    cells = []
    for cell in chosen.split(","):
        name, steps = cell.split(":")
        cells.append((name, _bytes_of(name) // 4, int(steps)))
    return cells


MOST_BYTES_A_CALL = 400 * 2**20
SMALL_CELLS = "64B:5000,1KiB:5000,4KiB:2000,64KiB:1000"  # issue 63's small taps


def _bytes_of(name: str) -> int:
    """A size's name ("64B", "1KiB", "4MiB") in bytes."""
    for suffix, unit in (("KiB", 2**10), ("MiB", 2**20), ("B", 1)):
        if name.endswith(suffix):
            return int(name[: -len(suffix)]) * unit
    raise ValueError(f"a size is 64B, 1KiB or 4MiB, not {name!r}")


def _calls(bytes_a_call: int) -> int:
    """Calls back to back before the barrier, by the bytes a call taps: 5 as the issue
    timed them, 25 where a call moves at most 8 MiB (a call of ~1 ms: the barrier's own
    spread, ±60 µs a round over 5 calls, bench/tpu_dormant_probe.py, would be 5% of
    the floor), 2 past 64 MiB."""
    if bytes_a_call <= 8 * 2**20:
        return 25
    return 5 if bytes_a_call <= 64 * 2**20 else 2


def settle_twins(functions: list[Callable[[Any], Any]], x: Any, seconds: float = 20.0) -> None:
    """Each of `functions` (dormant steps) called until a call is served by its twin
    (tapd/emitter/dormant_twin.py: compiled in the background once the step is called
    often), the steady state of a dormant step; given up on a step that 50 calls did not
    give a twin to while none compiles (one without: a flush, a long call, several
    devices), or after `seconds`."""
    import jax

    from tapd.emitter import dormant_twin

    for function in functions:
        deadline, calls, quiet = time.monotonic() + seconds, 0, 0
        while time.monotonic() < deadline:
            before, made = dormant_twin.calls_served(), dormant_twin.compiles()
            jax.block_until_ready(function(x))
            calls += 1
            if dormant_twin.calls_served() > before:
                break
            started, ended = dormant_twin.compiles()
            quiet = quiet + 1 if started == ended and (started, ended) == made else 0
            if calls >= 50 and quiet >= 5:
                break


def child(
    quick: bool, live_only: bool = False, sampled_only: bool = False, big_only: bool = False
) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import tapd
    from tapd.emitter import lifecycle

    rounds = 2 if quick else int(os.environ.get("TPU_BENCH_ROUNDS", "3"))
    made = {"big": 0}

    def loop(kind: str, steps: int) -> Callable[[Any], Any]:
        if kind == "floor":
            scan = jax.jit(lambda x: lax.scan(lambda c, _: (c * 0.999 + 0.001, c), x, length=steps))
            return lambda x: np.asarray(scan(x)[1])

        def body(i: Any, x: Any) -> Any:
            x = x * 0.999 + 0.001
            if kind == "tap":
                return tapd.tap(x, "big")
            if kind == "dormant":
                return tapd.tap(x, "nobody")
            if kind == "every100":
                return tapd.tap(x, "big", every=100)
            return x

        return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    def timed(function: Callable[[Any], Any], x: Any, calls: int) -> float:
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=900)
        start = time.perf_counter()
        for _ in range(calls):
            out = function(x)
        jax.block_until_ready(out)
        tapd.barrier_wait(timeout=900)
        return time.perf_counter() - start

    cells: dict[str, tuple[Callable[[Any], Any], Any, int, int]] = {}
    for size_name, elements, steps in [] if live_only or sampled_only else grid(quick):
        x = jnp.zeros(elements, jnp.float32)
        calls = _calls(elements * 4 * steps)
        for kind in ("none", "tap", "dormant", "floor"):
            cells[f"{size_name} x{steps} {kind}"] = (loop(kind, steps), x, calls, steps)
    x = jnp.zeros(SIZES["1MiB"], jnp.float32)
    for kind in () if live_only or big_only else ("none", "every100", "floor10"):
        steps = 1000 if not quick else 100
        function = loop(kind, steps) if kind != "floor10" else loop("floor", steps // 100)
        cells[f"1MiB x{steps} {kind}"] = (function, x, 2, steps if kind != "floor10" else 10)

    dormant = [(f, x) for name, (f, x, _, _) in cells.items() if name.endswith(" dormant")]
    for function, x in dormant:
        settle_twins([function], x)
    from tapd.emitter import dormant_twin

    twin_calls = dormant_twin.calls_served()
    times: dict[str, list[float]] = {name: [] for name in cells}
    for _ in range(rounds):
        for name, (function, x, calls, steps) in cells.items():
            seconds = timed(function, x, calls)
            times[name].append(seconds / calls * 1e6)  # µs a call
            if name.endswith(" tap"):
                made["big"] += (calls + 1) * steps
            elif name.endswith(" every100"):
                made["big"] += (calls + 1) * (steps // 100)
    live = {} if sampled_only or big_only else live_loops(quick)
    return {
        "us_a_call": {name: statistics.median(values) for name, values in times.items()},
        "all_us": times,
        "live": live,
        "made": made,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "gather_bytes": lifecycle.settings().gather_bytes,
        "twin_calls": dormant_twin.calls_served() - twin_calls,  # (in the timed rounds)
    }


def live_loops(quick: bool) -> dict[str, Any]:
    """Each long loop's calls: their time, first arrival and largest gap (seconds)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd

    arrivals: list[float] = []

    def arrived(_: Any, transforms: Any) -> None:
        arrivals.append(time.perf_counter())

    n = 256 if quick else 4096  # (the CPU's quick run: smaller matmuls)

    def program(kind: str, steps: int, matmuls: int) -> Callable[[Any], Any]:
        def body(i: Any, c: Any) -> Any:
            for _ in range(matmuls):
                c = (c @ c) * (1.0 / n)
            if kind == "tap":
                return tapd.id_tap(arrived, i, result=c)
            if kind == "jax":
                jax.debug.callback(lambda i: arrivals.append(time.perf_counter()), i)
            return c

        return jax.jit(lambda c: lax.fori_loop(0, steps, body, c))

    c = jnp.full((n, n), 1.0, jnp.float32)
    out: dict[str, Any] = {}
    shapes = [("1.4ms", 2500, 2), ("100ms", 60, 140)]
    if quick:
        shapes = [("1.4ms", 250, 2), ("100ms", 6, 40)]
    for label, steps, matmuls in shapes:
        for kind in ("none", "tap", "unpaced", "jax"):
            if kind in ("jax", "unpaced") and label == "100ms":
                continue  # (its gaps are its steps: each callback runs as the step does)
            function = program("tap" if kind == "unpaced" else kind, steps, matmuls)
            if kind == "unpaced":  # (what pacing costs: the same loop, lowered unpaced)
                function = unpaced(function, c)
            calls = []
            for _ in range(2):  # the first compiles; its taps arrive too
                jax.block_until_ready(c)
                arrivals.clear()
                start = time.perf_counter()
                jax.block_until_ready(function(c))
                end = time.perf_counter()
                tapd.barrier_wait(timeout=900)
                times = [start, *arrivals]
                calls.append(
                    {
                        "seconds": end - start,
                        "taps": len(arrivals),
                        "first": arrivals[0] - start if arrivals else None,
                        "largest_gap": max(b - a for a, b in itertools.pairwise(times))
                        if arrivals
                        else None,
                    }
                )
            out[f"{label} {kind}"] = {"steps": steps, "calls": calls}
    return out


def unpaced(function: Callable[[Any], Any], c: Any) -> Callable[[Any], Any]:
    """`function` compiled as issue 51 found it: `gather_latency` 0 and no one log of a
    counted run (`gather_log_bytes` 1): its loop flushes when its log fills."""
    import dataclasses

    from tapd.emitter import lifecycle

    settings = lifecycle.settings()
    lifecycle._settings = dataclasses.replace(settings, gather_latency=0.0, gather_log_bytes=1)
    try:
        compiled = function.lower(c).compile()  # type: ignore[attr-defined]
    finally:
        lifecycle._settings = settings
    return compiled  # type: ignore[no-any-return]


def report(result: dict[str, Any], delivered: int, quick: bool) -> str:
    us = result["us_a_call"]
    lines = [
        "# Big taps and long loops on a TPU (bench/tpu_live.py)",
        "",
        f"Machine: {result['device']}, JAX {result['jax']}, host {platform.machine()}, "
        f"Python {platform.python_version()}{' (quick)' if quick else ''}, "
        f"TAPD_GATHER_BYTES {result.get('gather_bytes')}.",
        "",
        "## Big taps: µs a step added over the untapped loop, ÷ the floor's added",
        "",
        "| cell | untapped | tap | dormant | floor | tap ÷ floor | dormant ÷ floor |",
        "|---|---|---|---|---|---|---|",
    ]
    cells = sorted({name.rsplit(" ", 1)[0] for name in us}, key=_cell_order)
    for cell in cells:
        if f"{cell} tap" not in us:
            continue
        steps = int(cell.split(" x")[1])
        a_step = {k: us[f"{cell} {k}"] / steps for k in ("none", "tap", "dormant", "floor")}
        floor = a_step["floor"] - a_step["none"]
        tap, dormant = a_step["tap"] - a_step["none"], a_step["dormant"] - a_step["none"]
        lines.append(
            f"| {cell} | {a_step['none']:.2f} | {a_step['tap']:.2f} | {a_step['dormant']:.2f} "
            f"| {a_step['floor']:.2f} | {tap / floor:.2f} | {dormant / floor:.3f} |"
        )
    sampled = [name for name in us if name.endswith(" every100")]
    for name in sampled:
        cell = name.rsplit(" ", 1)[0]
        added = us[name] - us[f"{cell} none"]
        floor = us[f"{cell} floor10"]
        lines += [
            "",
            f"`every=100`, {cell}: {added:.0f} µs a call added; the floor of the 10 taps "
            f"kept (a 10-step `scan`'s outputs fetched): {floor:.0f} µs; ratio "
            f"{added / floor:.2f}.",
        ]
    lines += [
        "",
        "## Long loops: when taps arrive (seconds; the second call of each)",
        "",
        "| loop | form | call | taps | first | largest gap |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in result["live"].items():
        label, kind = name.split(" ")
        call = entry["calls"][-1]
        first = "-" if call["first"] is None else f"{call['first']:.3f}"
        gap = "-" if call["largest_gap"] is None else f"{call['largest_gap']:.3f}"
        lines.append(
            f"| {entry['steps']} steps of {label} | {kind} | {call['seconds']:.3f} | "
            f"{call['taps']} | {first} | {gap} |"
        )
    live = result["live"]
    if "1.4ms tap" in live and "1.4ms jax" in live:
        base = live["1.4ms none"]["calls"][-1]["seconds"]
        tap = live["1.4ms tap"]["calls"][-1]["seconds"] - base
        jax_added = live["1.4ms jax"]["calls"][-1]["seconds"] - base
        lines += [
            "",
            f"The 1.4 ms loop's added cost ÷ `jax.debug.callback`'s: {tap / jax_added:.3f}.",
        ]
    lines += [
        "",
        f"Woken taps made: {result['made']['big']}; the subscriber received: {delivered}.",
        f"Dormant calls served by twins in the timed rounds: {result.get('twin_calls', 0)} "
        "(tapd/emitter/dormant_twin.py; each dormant step called until its twin serves it "
        "first, where one comes).",
        "",
    ]
    return "\n".join(lines)


def _cell_order(cell: str) -> tuple[int, int]:
    size, steps = cell.split(" x")
    return _bytes_of(size), int(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--live-only", action="store_true", help="only the long loops")
    parser.add_argument(
        "--sampled-only", action="store_true", help="only the every=100 cell and its floor"
    )
    parser.add_argument("--big-only", action="store_true", help="only the big taps' grid")
    parser.add_argument(
        "--small-only",
        action="store_true",
        help=f"only the small taps' grid ({SMALL_CELLS}; TPU_BIG_CELLS overrides it)",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the report here (Markdown)")
    parser.add_argument("--log", default=None, help="write the raw results here (JSON)")
    args = parser.parse_args()
    if args.small_only:
        os.environ.setdefault("TPU_BIG_CELLS", SMALL_CELLS)
        args.big_only = True
    if args.child:
        print(json.dumps(child(args.quick, args.live_only, args.sampled_only, args.big_only)))
        return
    from processes import Processes, run_child

    with tempfile.TemporaryDirectory(prefix="tl-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon()
            sink = processes.start_sink("big")
            env = {**os.environ, "TAPD_ENDPOINT": processes.endpoint, "TAPD_AUTOSTART": "0"}
            flags = [
                *(["--quick"] if args.quick else []),
                *(["--live-only"] if args.live_only else []),
                *(["--sampled-only"] if args.sampled_only else []),
                *(["--big-only"] if args.big_only else []),
            ]
            command = [sys.executable, __file__, "--child", *flags]
            result = run_child(command, env, "child")
        finally:
            processes.stop_all()
        delivered = sink.results()["processed"]
    text = report(result, delivered, args.quick)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.log:
        Path(args.log).write_text(json.dumps({"result": result, "delivered": delivered}, indent=1))


if __name__ == "__main__":
    main()
