"""What a tap costs on a TPU, per step of a loop and per call, against `jax.debug.callback`
and against moving the same values as outputs (bench/RESULTS-tpu.md).

    python bench/tpu.py [--quick] [--out bench/RESULTS-tpu.md] [--log PATH]

The parent starts a tapd daemon and a subscriber that takes the woken sites ("loss",
"big"), then runs one child process per `TAPD_GATHER` setting (`off`: one host callback
a tap; `on`: taps gathered on the device, tapd.emitter.gathered), one at a time (one
process at a time may hold the chip). Each child times every variant in interleaved
rounds and reports medians; figures are compared within one child (ratios), never
across machines. The subscriber's count of the woken taps is checked against what the
children made. Runs on the CPU too (`--quick`), where it says nothing about a TPU.
"""

from __future__ import annotations

import argparse
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

STEPS = 400  # loop steps a call
SMALL = 16  # float32: 64 B a tap
BIG = 2**18  # float32: 1 MiB a tap


def child(quick: bool) -> dict[str, Any]:
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
    from tpu_live import settle_twins  # (a dormant step's steady state: its twin, if any)

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


def added(us: dict[str, float], prefix: str, kind: str) -> float:
    return us[f"{prefix} {kind}"] - us[f"{prefix} none"]


def report(results: dict[str, dict[str, Any]], delivered: dict[str, int], quick: bool) -> str:
    first = next(iter(results.values()))
    lines = [
        "# What a tap costs on a TPU (bench/tpu.py)",
        "",
        f"Machine: {first['device']}, JAX {first['jax']}, Python {platform.python_version()}, "
        f"host {platform.machine()} ({os.cpu_count()} CPUs). {'Quick run. ' if quick else ''}"
        f"Loops: {STEPS} steps a call, µs a step; calls: µs a call; medians of interleaved "
        "rounds, each setting in one process of its own. In brackets: the host callbacks "
        "of tapd's that one call runs (tapd.stats()).",
        "",
        "| variant | " + " | ".join(f"TAPD_GATHER={g}" for g in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for name in first["us"]:
        cells = " | ".join(
            f"{r['us'][name]:.1f} ({r.get('callbacks', {}).get(name, '-')})"
            for r in results.values()
        )
        lines.append(f"| {name} | {cells} |")

    lines += ["", "Ratios (added cost over the untapped variant, each within its own process):", ""]
    lines.append("| figure | " + " | ".join(f"TAPD_GATHER={g}" for g in results) + " | target |")
    lines.append("|---|" + "---|" * (len(results) + 1))
    figures = [
        ("loop, 64 B: tapd.tap ÷ jax.debug.callback", "loop64", "tap", "jax", "≤ 0.02"),
        ("loop, dormant 64 B ÷ jax.debug.callback", "loop64", "dormant", "jax", "≤ 0.005"),
        ("loop, 1 MiB: tapd.tap ÷ scan outputs", "loop1M", "tap", "outputs", "≤ 1.5"),
        ("loop, tapd.debug.callback ÷ jax.debug.callback", "loop64", "tapd.debug", "jax", "≤ 0.02"),
        ("while, 64 B: tapd.tap ÷ jax.debug.callback", "while64", "tap", "jax", "(≤ 0.02)"),
        ("shard_map loop, 64 B: tapd.tap ÷ jax.debug.callback", "smap64", "tap", "jax", "≤ 0.02"),
        ("shard_map loop, dormant ÷ jax.debug.callback", "smap64", "dormant", "jax", "≤ 0.005"),
        ("shard_map loop, id_tap ÷ jax.debug.callback", "smap64", "id_tap", "jax", ""),
        ("pmap loop, 64 B: tapd.tap ÷ jax.debug.callback", "pmap64", "tap", "jax", "≤ 0.02"),
        ("pmap loop, dormant ÷ jax.debug.callback", "pmap64", "dormant", "jax", "≤ 0.005"),
        ("pmap loop, id_tap ÷ jax.debug.callback", "pmap64", "id_tap", "jax", ""),
        (
            "shard_map a step, 64 B: tapd.tap ÷ jax.debug.callback",
            "smaploop64",
            "tap",
            "jax",
            "≤ 0.02",
        ),
        (
            "shard_map a step, dormant ÷ jax.debug.callback",
            "smaploop64",
            "dormant",
            "jax",
            "≤ 0.005",
        ),
        ("call: tapd.tap ÷ jax.debug.callback", "call", "tap", "jax", "≤ 0.25"),
        ("call: id_tap closure ÷ jax.debug.callback", "call", "id_tap", "jax", "≤ 0.25"),
        ("call: dormant ÷ jax.debug.callback", "call", "dormant", "jax", ""),
        ("call: an untaken callback ÷ jax.debug.callback", "call", "untaken", "jax", ""),
    ]
    for text, prefix, kind, against, target in figures:
        cells = " | ".join(
            f"{added(r['us'], prefix, kind) / added(r['us'], prefix, against):.4f}"
            for r in results.values()
        )
        lines.append(f"| {text} | {cells} | {target} |")
    made = {g: r["made"] for g, r in results.items()}
    lines += ["", f"Woken taps made: {made}; the subscriber received: {delivered}.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="write the report here (Markdown)")
    parser.add_argument("--log", default=None, help="write the raw results here (JSON)")
    parser.add_argument(
        "--gather",
        default="off,on",
        help="the TAPD_GATHER settings to run, each in a child of its own; SETTING:BYTES "
        "sets TAPD_GATHER_BYTES too, SETTING:taps=N TAPD_GATHER_TAPS",
    )
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.quick)))
        return
    from processes import Processes, run_child

    with tempfile.TemporaryDirectory(prefix="tb-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon()
            sink = processes.start_sink("loss")
            big_sink = processes.start_sink("big")
            results = {}
            for gather in args.gather.split(","):
                setting, _, size = gather.partition(":")
                sized = {}
                if size.startswith("taps="):
                    sized["TAPD_GATHER_TAPS"] = size.removeprefix("taps=")
                elif size:
                    sized["TAPD_GATHER_BYTES"] = size
                env = {
                    **os.environ,
                    "TAPD_ENDPOINT": processes.endpoint,
                    "TAPD_AUTOSTART": "0",
                    "TAPD_GATHER": setting,
                    **sized,
                }
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    *(["--quick"] if args.quick else []),
                ]
                results[gather] = run_child(command, env, f"child (TAPD_GATHER={gather})")
        finally:
            processes.stop_all()
        delivered = {
            "loss": sink.results()["processed"],
            "big": big_sink.results()["processed"],
        }
    text = report(results, delivered, args.quick)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.log:
        Path(args.log).write_text(
            json.dumps({"results": results, "delivered": delivered}, indent=1)
        )


if __name__ == "__main__":
    main()
