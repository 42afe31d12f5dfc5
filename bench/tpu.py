"""What a tap costs on a TPU (bench/RESULTS-tpu.md): per step of a loop and per call,
against `jax.debug.callback` and against moving the same values as outputs (section tpu);
and big taps and long loops (issue 51, section tpu-live: `live`).

    python bench/tpu.py [--quick] [--gather off,on] [--out PATH] [--log PATH]
    python bench/tpu.py live [--quick] [--live-only|--sampled-only|--big-only|--small-only]
                             [--out PATH] [--log PATH]

The parent starts a tapd daemon and a subscriber that takes the woken sites ("loss",
"big"; `live`: "big"), then runs one child process per `TAPD_GATHER` setting (`off`: one
host callback a tap; `on`: taps gathered on the device, tapd.emitter.gathered; `live`: one
child, TAPD_GATHER=auto, the gathered path on a TPU), one at a time (one process at a time
may hold the chip). Each child times every variant in interleaved rounds and reports
medians; figures are compared within one child (ratios), never across machines. The
subscriber's count of the woken taps is checked against what the children made. Runs on
the CPU too (`--quick`), where it says nothing about a TPU. The reports are written by
bench/report.py (`tpu_page`, `tpu_live_page`).

Live: what a tap of 64 KiB to 4 MiB a step costs against the floor of moving its bytes,
woken and dormant, and how soon a long loop's taps arrive. Each cell of the grid is a
`fori_loop` that taps `x` every step, timed in steady state as the issue does: a few
calls back to back (`_calls`), then every tap run in the subscriber (one
`barrier_wait`), µs a step, medians of interleaved rounds. The floor: the same values
returned as `scan` outputs and fetched with `np.asarray`. Live loops: a 2500-step loop
of two 4096² matmuls a step (~1.4 ms) and a 60-step loop of ~100 ms steps, each tapping
its step index to a function in this process; the time of its first tap after the call
starts, and the largest gap between taps. Cells of more than 400 MiB a call are left out
(a TPU host moves them in seconds a call; the rate is that of 100 steps).

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
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from processes import Processes, run_child
from report import bytes_of, tpu_live_page, tpu_page

STEPS = 400  # loop steps a call
SMALL = 16  # float32: 64 B a tap
BIG = 2**18  # float32: 1 MiB a tap


def cost_child(quick: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd
    import tapd.debug

    rounds = 3 if quick else int(os.environ.get("TPU_BENCH_ROUNDS", "7"))
    loop_calls, step_calls = (2, 50) if quick else (5, 300)
    made = {"loss": 0, "big": 0}

    def noop(*_: Any) -> None:
        return None

    def closure(arg: Any, transforms: Any) -> None:
        return None

    def tapped(kind: str, x: Any, i: Any) -> Any:
        if kind == "tap":
            return tapd.tap(x, "loss" if x.size == SMALL else "big")
        if kind == "dormant":
            return tapd.tap(x, "nobody")
        if kind == "jax":
            jax.debug.callback(noop, x)
        elif kind == "tapd.debug":
            tapd.debug.callback(noop, x)
        elif kind == "id_tap":
            return tapd.id_tap(closure, x)
        elif kind == "untaken":  # a host callback in a branch never taken
            lax.cond(x[0] > 1e30, lambda: jax.debug.callback(noop, x), lambda: None)
        return x

    def loop(kind: str, size: int, dynamic: bool) -> Callable[[Any], Any]:
        def body(i: Any, x: Any) -> Any:
            return tapped(kind, x, i) * 0.999 + 0.001

        if kind == "outputs":  # the floor: the values stacked as scan outputs, fetched
            run = jax.jit(lambda x: lax.scan(lambda c, _: (c * 0.999 + 0.001, c), x, length=STEPS))

            def fetch(x: Any) -> Any:
                out, ys = run(x)
                return out, jax.device_get(ys)

            return fetch
        if dynamic:
            f = jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))
            return lambda x: f(x, STEPS)
        return jax.jit(lambda x: lax.fori_loop(0, STEPS, body, x))

    def over_devices(form: str, kind: str) -> Callable[[Any], Any]:
        """The loop inside a shard_map, or a pmap, over every device (one chip: its one)."""
        from jax.sharding import Mesh
        from jax.sharding import PartitionSpec as P

        def body(i: Any, x: Any) -> Any:
            return tapped(kind, x, i) * 0.999 + 0.001

        def per_device(x: Any) -> Any:
            return lax.fori_loop(0, STEPS, body, x.reshape(SMALL)).reshape(x.shape)

        if form == "pmap":
            return jax.pmap(per_device)
        mesh = Mesh(jax.devices(), ("d",))
        if form == "shard_map in a loop":  # (a shard_map a step: gathered.threaded)
            each = jax.shard_map(
                lambda i, x: body(i, x), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
            )
            return jax.jit(lambda x: lax.fori_loop(0, STEPS, each, x))
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("d"), out_specs=P("d")))

    def step(kind: str) -> Callable[[Any], Any]:
        return jax.jit(lambda x: tapped(kind, x, 0) * 1.0001)

    def timed(function: Callable[[Any], Any], x: Any, calls: int) -> float:
        """Seconds for `calls` calls, until their results are ready: what the step pays.
        The taps' delivery is waited for after the clock stops (tapd's step never waits
        for a subscriber; jax.debug.callback's runs its no-op within the step), so that
        no variant's backlog falls into the next one's time."""
        out = function(x)
        jax.block_until_ready(out)
        tapd.barrier_wait(timeout=600)
        start = time.perf_counter()
        for _ in range(calls):
            out = function(x)
        jax.block_until_ready(out)
        seconds = time.perf_counter() - start
        tapd.barrier_wait(timeout=600)
        return seconds

    small, big = jnp.zeros(SMALL, jnp.float32), jnp.zeros(BIG, jnp.float32)
    variants: dict[str, tuple[Callable[[Any], Any], Any, int, int]] = {}
    for kind in ("none", "tap", "dormant", "jax", "tapd.debug", "id_tap", "outputs"):
        variants[f"loop64 {kind}"] = (loop(kind, SMALL, False), small, loop_calls, STEPS)
    for kind in ("none", "tap", "jax", "tapd.debug"):
        variants[f"while64 {kind}"] = (loop(kind, SMALL, True), small, loop_calls, STEPS)
    for kind in ("none", "tap", "dormant", "jax", "outputs"):
        variants[f"loop1M {kind}"] = (loop(kind, BIG, False), big, 1, STEPS)
    for kind in ("none", "tap", "dormant", "jax", "tapd.debug", "id_tap", "untaken"):
        variants[f"call {kind}"] = (step(kind), small, step_calls, 1)
    devices = jax.device_count()
    spread = jnp.zeros((devices, SMALL), jnp.float32)
    forms = {"smap64": "shard_map", "pmap64": "pmap", "smaploop64": "shard_map in a loop"}
    for form, made_as in forms.items():
        for kind in ("none", "tap", "dormant", "jax", "id_tap"):
            function = over_devices(made_as, kind)
            variants[f"{form} {kind}"] = (
                function,
                spread if form == "pmap64" else spread.reshape(-1),
                loop_calls,
                STEPS,
            )

    # Host callbacks of tapd's that one call runs (tapd.stats()): ~1 ms each on a TPU.
    callbacks: dict[str, int] = {}
    for name, (function, x, _, _) in variants.items():
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=600)
        before = tapd.stats().get("host_callbacks", 0)
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=600)
        callbacks[name] = tapd.stats().get("host_callbacks", 0) - before
        if name.endswith(" tap"):
            made["loss" if x.size % BIG else "big"] += 2 * per_call_of(name)
    # (a dormant step's steady state: its twin, if any)
    for name, (function, x, _, _) in variants.items():
        if name.endswith(" dormant"):
            settle_twins([function], x)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (function, x, calls, per_call) in variants.items():
            seconds = timed(function, x, calls)
            times[name].append(seconds / (calls * per_call) * 1e6)
            if name.endswith(" tap"):
                made["loss" if x.size % BIG else "big"] += (calls + 1) * per_call
    return {
        "callbacks": callbacks,
        "us": {name: statistics.median(values) for name, values in times.items()},
        "all_us": times,
        "made": made,
        "backend": tapd.stats().get("backend") if hasattr(tapd, "stats") else None,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
    }


def per_call_of(name: str) -> int:
    """Taps a call of variant `name` makes."""
    return 1 if name.startswith("call ") else STEPS


# ---- live: big taps and long loops (issue 51) -------------------------------------------

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
        cells.append((name, bytes_of(name) // 4, int(steps)))
    return cells


MOST_BYTES_A_CALL = 400 * 2**20
SMALL_CELLS = "64B:5000,1KiB:5000,4KiB:2000,64KiB:1000"  # issue 63's small taps


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


def live_child(
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


def parent(
    sinks: list[str], children: dict[str, dict[str, str]], flags: list[str]
) -> tuple[dict[str, Any], dict[str, int]]:
    """A daemon and a subscriber for each consumer of `sinks`, then one child per entry of
    `children` (its environment beside the daemon's endpoint), one at a time: their
    results, and how many taps each subscriber received."""
    with tempfile.TemporaryDirectory(prefix="tb-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon()
            started = {name: processes.start_sink(name) for name in sinks}
            results = {}
            for label, extra in children.items():
                env = {**os.environ, "TAPD_ENDPOINT": processes.endpoint, "TAPD_AUTOSTART": "0",
                       **extra}  # fmt: skip
                command = [sys.executable, __file__, *flags, "--child"]
                results[label] = run_child(command, env, f"child ({label})")
        finally:
            processes.stop_all()
        delivered = {name: sink.results()["processed"] for name, sink in started.items()}
    return results, delivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", choices=["cost", "live"], default="cost",
                        help="cost (the default: section tpu), live (tpu-live)")  # fmt: skip
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the report here (Markdown)")
    parser.add_argument("--log", default=None, help="write the raw results here (JSON)")
    parser.add_argument("--gather", default="off,on",
                        help="cost: the TAPD_GATHER settings to run, each in a child of its "
                        "own; SETTING:BYTES sets TAPD_GATHER_BYTES too, SETTING:taps=N "
                        "TAPD_GATHER_TAPS")  # fmt: skip
    parser.add_argument("--live-only", action="store_true", help="live: only the long loops")
    parser.add_argument("--sampled-only", action="store_true",
                        help="live: only the every=100 cell and its floor")  # fmt: skip
    parser.add_argument("--big-only", action="store_true", help="live: only the big taps' grid")
    parser.add_argument("--small-only", action="store_true",
                        help=f"live: only the small taps' grid ({SMALL_CELLS}; TPU_BIG_CELLS "
                        "overrides it)")  # fmt: skip
    args = parser.parse_args()
    if args.small_only:
        os.environ.setdefault("TPU_BIG_CELLS", SMALL_CELLS)
        args.big_only = True
    if args.which == "live":
        if args.child:
            child = live_child(args.quick, args.live_only, args.sampled_only, args.big_only)
            print(json.dumps(child))
            return
        chosen = ("quick", "live_only", "sampled_only", "big_only")
        flags = [f"--{name.replace('_', '-')}" for name in chosen if getattr(args, name)]
        results, delivered = parent(["big"], {"auto": {}}, ["live", *flags])
        result, got = results["auto"], delivered["big"]
        text = tpu_live_page(result, got, args.quick)
        raw: dict[str, Any] = {"result": result, "delivered": got}
    else:
        if args.child:
            print(json.dumps(cost_child(args.quick)))
            return
        children = {}
        for gather in args.gather.split(","):
            setting, _, size = gather.partition(":")
            children[gather] = {"TAPD_GATHER": setting}
            if size.startswith("taps="):
                children[gather]["TAPD_GATHER_TAPS"] = size.removeprefix("taps=")
            elif size:
                children[gather]["TAPD_GATHER_BYTES"] = size
        quick = ["--quick"] if args.quick else []
        results, delivered = parent(["loss", "big"], children, ["cost", *quick])
        text = tpu_page(results, delivered, args.quick, STEPS)
        raw = {"results": results, "delivered": delivered}
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.log:
        Path(args.log).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
