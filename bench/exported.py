"""Tapped computations that travel (issue 34): what an exported call costs, and what a
persistent-cache hit saves.

(a) Per call: a jitted step `x * 1.0001` on 16 float32 with one `tapd.tap` that a
subscriber process takes, called in a Python loop, `x = step(x)`: the function jitted in
this process; the same function exported with `jax.export`, serialized, deserialized
(`tapd.deserialize`) and called as `exported.call` (JAX's Python path per call) and as
`jax.jit(exported.call)` (how a server calls it). Interleaved within each repeat, in one
process; medians. Target: the jitted exported call <= 1.1x the function jitted here.

(b) A cache hit: a model with taps in a scan (an MLP's forward and backward over 32
layers, so that compiling takes a while), first called in a fresh process with JAX's
persistent compilation cache in an empty directory (cold: trace, compile, write), then
in another fresh process on the same directory (warm: trace, load), which also traces
one other tapped function first so that its sites are in another order. Time to the
first result, side by side, and the taps each delivered.

    python bench/exported.py [--quick] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


def per_call_child(quick: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import export
    from processes import Processes

    import tapd

    workdir = Path(tempfile.mkdtemp(prefix="tapd-export-", dir="/tmp"))
    procs = Processes(workdir)
    procs.start_daemon(flags=["--startup-grace", "0"])
    os.environ["TAPD_ENDPOINT"] = procs.endpoint
    try:
        procs.start_sink("bench.export")

        def step(x: Any) -> Any:
            return tapd.tap(x, "bench.export") * 1.0001

        argument = jnp.ones(16, jnp.float32)
        blob = export.export(jax.jit(step))(jax.ShapeDtypeStruct((16,), jnp.float32)).serialize()
        loaded = tapd.deserialize(blob)
        variants = {
            "jitted here": jax.jit(step),
            "exported, jax.jit(exported.call)": jax.jit(loaded.call),
            "exported, exported.call": loaded.call,
        }
        for function in variants.values():
            jax.block_until_ready(function(function(argument)))
        tapd.barrier_wait(timeout=120)
        calls = 500 if quick else 2000
        repeats = 3 if quick else 7
        us: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(repeats):
            for name, function in variants.items():
                x = argument
                started = time.perf_counter()
                for _ in range(calls):
                    x = function(x)
                x.block_until_ready()
                us[name].append((time.perf_counter() - started) / calls * 1e6)
                tapd.barrier_wait(timeout=120)
        return {"us": us, "calls": calls, "stats": tapd.stats()}
    finally:
        procs.stop_all()


def cache_child(directory: str, other_first: bool) -> dict[str, Any]:
    """The first call of the model, timed from before tracing, with the cache in
    `directory`; `other_first`: trace and call another tapped function first."""
    import jax
    import jax.numpy as jnp

    import tapd

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    if other_first:
        jax.jit(lambda x: tapd.tap(x, "bench.cache.other") + 1)(jnp.ones(3)).block_until_ready()
    layers = 32
    weights = jnp.ones((layers, 64, 64), jnp.float32) * 0.01

    def loss(w: Any, x: Any) -> Any:
        def layer(h: Any, wi: Any) -> Any:
            h = jnp.tanh(h @ wi)
            tapd.tap(jnp.linalg.norm(h), "bench.cache.norm")
            return h, None

        h, _ = jax.lax.scan(layer, x, w)
        return (h**2).sum()

    model = jax.jit(jax.value_and_grad(loss))
    hits_before = events.count("/jax/compilation_cache/cache_hits")
    started = time.perf_counter()
    _, grads = model(weights, jnp.ones((8, 64), jnp.float32))
    jax.block_until_ready(grads)
    first_call = time.perf_counter() - started
    tapd.barrier_wait(timeout=120)
    return {
        "first_call_s": first_call,
        "model_hits": events.count("/jax/compilation_cache/cache_hits") - hits_before,
        "delivered": tapd.stats()["delivered"],
    }


def run_child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", *argv]
    result = subprocess.run(
        command, env={**os.environ, **env}, capture_output=True, text=True, timeout=1800
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{argv} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def cache_runs(quick: bool) -> list[dict[str, Any]]:
    """Cold then warm, each in a fresh process, with one daemon and a subscriber taking
    the model's taps (so that they are copied and delivered); twice unless quick."""
    from processes import Processes

    workdir = Path(tempfile.mkdtemp(prefix="tapd-cache-", dir="/tmp"))
    procs = Processes(workdir)
    procs.start_daemon(flags=["--startup-grace", "0"])
    env = {"TAPD_ENDPOINT": procs.endpoint, "TAPD_AUTOSTART": "0"}
    try:
        procs.start_sink("bench.cache.*")
        runs = []
        for attempt in range(1 if quick else 2):
            directory = workdir / f"cache{attempt}"
            cold = run_child(["cache", str(directory), "0"], env)
            warm = run_child(["cache", str(directory), "1"], env)
            runs.append({"cold": cold, "warm": warm})
        return runs
    finally:
        procs.stop_all()


def report(per_call: dict[str, Any], caches: list[dict[str, Any]], quick: bool) -> str:
    from report import code_revision, machine_description, median, table

    lines = ["# Exported and cached tapped computations", ""]
    lines += [table(["", ""], [[k, v] for k, v in machine_description()]), ""]
    lines += [f"code: {code_revision(BENCH_DIR.parent)}", ""]
    us = {name: median(values) for name, values in per_call["us"].items()}
    here = us["jitted here"]
    rows = [[name, f"{value:.2f}", f"{value / here:.2f}"] for name, value in us.items()]
    lines += ["## (a) Per call, one woken tap, 16 float32", ""]
    lines += [table(["variant", "µs/call", "÷ jitted here"], rows), ""]
    ratio = us["exported, jax.jit(exported.call)"] / here
    lines += [
        f"Target: the jitted exported call <= 1.1x the function jitted here: {ratio:.2f}x, "
        f"{'met' if ratio <= 1.1 else 'NOT met'}. Medians of {len(per_call['us']['jitted here'])} "
        f"repeats of {per_call['calls']} calls; taps delivered: {per_call['stats']['delivered']}.",
        "",
    ]
    rows = []
    for index, run in enumerate(caches):
        cold, warm = run["cold"], run["warm"]
        rows.append(
            [
                str(index + 1),
                f"{cold['first_call_s']:.2f}",
                f"{warm['first_call_s']:.2f}",
                f"{cold['first_call_s'] - warm['first_call_s']:.2f}",
                f"{cold['first_call_s'] / warm['first_call_s']:.1f}",
                f"{cold['model_hits']} / {warm['model_hits']}",
                f"{cold['delivered']} / {warm['delivered']}",
            ]
        )
    header = [
        "run",
        "cold first call (s)",
        "warm first call (s)",
        "saved (s)",
        "cold ÷ warm",
        "cache hits cold / warm",
        "taps delivered cold / warm",
    ]
    lines += ["## (b) A persistent-cache hit in a second process", "", table(header, rows), ""]
    lines += [
        "Cold: a fresh process, an empty cache directory (trace, compile, write). Warm: "
        "another fresh process on the same directory, which first traces another tapped "
        "function (its sites in another order). The model: value_and_grad of a 32-layer "
        "tanh MLP in a `lax.scan` tapping each layer's activation norm.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_DIR))
    if args.child:
        kind, *rest = args.child
        if kind == "per_call":
            out = per_call_child(rest == ["quick"])
        else:
            out = cache_child(rest[0], rest[1] == "1")
        print(json.dumps(out), flush=True)
        return
    env = {"TAPD_BACKEND": "native", "TAPD_AUTOSTART": "0"}
    per_call = run_child(["per_call", *(["quick"] if args.quick else [])], env)
    caches = cache_runs(args.quick)
    text = report(per_call, caches, args.quick)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
