"""What a tap costs per call of a jitted step, one call per Python step (issue 26); and,
called so, what the daemon's coalescing wait saves (`--coalesce`) and what an exported
call costs (issue 34): bench/RESULTS.md sections 9 (calls), 11 (coalesce), 12 (exported).

    python bench/per_call.py [calls] [--quick] [--output PATH]
    python bench/per_call.py coalesce [--quick] [--output PATH]
    python bench/per_call.py exported [--quick] [--output PATH]

Calls. Each variant is `x = step(x)` called in a Python loop, `step` a jitted `x * 1.0001`
on a 64 B (16 float32) or a 1 MiB array, with (or without) one tap or callback of `x`:
untapped; a dormant `tapd.tap` (no taker: its site's slot says EVERY_DORMANT, set by hand
as the daemon would); a woken one (a subscriber process takes it); a strict one
(`ordered="strict"`, dormant); host_callback's `id_tap` of a no-op closure and `id_print`
to an `output_stream` (both run in this process, from its local ring, by its receiver
thread, while the loop runs; id_print's texts rendered by its print worker, a child
process, once it has started: tapd/print_worker.py), and a strict `id_tap`; a no-op
`jax.debug.callback`; a no-op `io_callback`. Timed from the first call to
`block_until_ready()` of the last; woken and in-process taps are drained (`barrier_wait`,
untimed) between runs. Once per backend, each in its own process, the variants interleaved
within each repeat; the table gives the median over repeats.

Targets (native): a dormant tap's call <= 1.5 x the untapped call's, and an `id_tap`'s or
`id_print`'s (issue 33); a woken one <= 1.5 x plus its copy: a numpy copy of the same
bytes, measured in the same process as the tap makes it, into the next slot of a buffer
the ring's size, out of cache (1 MiB: ~3x a copy into one warm buffer, which the first
figures used). Portable: a tap's added time <= 0.25 of what a no-op `jax.debug.callback`
adds.

Coalesce: what the daemon's coalescing wait (`tapd start --coalesce`) saves when taps come
a few thousand a second. A jitted step that does some work (a 256 x 256 matrix product,
~0.3 ms here) and taps 64 B, called once per Python step, 2000 calls a run: taps reach the
daemon a few thousand a second, a handful at each of its rounds. A subscriber process
takes them with a no-op handler. Per variant: the step's µs per call (untapped and tapped,
in the same process) and the daemon's CPU per tap. The daemon runs with `--coalesce 0`
(each round passed on at once) or the default (2 ms), each in a JAX process of its own,
the two alternating over the repeats; medians.

Exported: tapped computations that travel: what an exported call costs, and what a
persistent-cache hit saves. (a) Per call: a jitted step `x * 1.0001` on 16 float32 with
one `tapd.tap` that a subscriber process takes, called in a Python loop, `x = step(x)`:
the function jitted in this process; the same function exported with `jax.export`,
serialized, deserialized (`tapd.deserialize`) and called as `exported.call` (JAX's Python
path per call) and as `jax.jit(exported.call)` (how a server calls it). Interleaved within
each repeat, in one process; medians. Target: the jitted exported call <= 1.1x the
function jitted here.

(b) A cache hit: a model with taps in a scan (an MLP's forward and backward over 32
layers, so that compiling takes a while), first called in a fresh process with JAX's
persistent compilation cache in an empty directory (cold: trace, compile, write), then in
another fresh process on the same directory (warm: trace, load), which also traces one
other tapped function first so that its sites are in another order. Time to the first
result, side by side, and the taps each delivered.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from processes import Processes, run_backend_child
from report import code_revision, machine_description, median, number, table

BENCH_DIR = Path(__file__).resolve().parent
COALESCE_VARIANTS = {"0": "--coalesce 0 (each round at once)", "default": "default (2 ms)"}


SIZES = {"64 B": 16, "1 MiB": 2**18}  # float32 elements


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    kind: str  # "none", "dormant", "woken", "strict", "debug.callback", "io_callback"


VARIANTS = [
    Variant("plain", "no tap", "none"),
    Variant("dormant", "tapd.tap, dormant", "dormant"),
    Variant("woken", "tapd.tap, woken", "woken"),
    Variant("strict", 'tapd.tap(ordered="strict"), dormant', "strict"),
    Variant("id_tap", "id_tap of a no-op closure", "id_tap"),
    Variant("id_print", "id_print to an output_stream", "id_print"),
    Variant("id_tap_strict", 'id_tap(ordered="strict") of a no-op closure', "id_tap_strict"),
    Variant("callback", "jax.debug.callback, no-op", "debug.callback"),
    Variant("io", "io_callback, no-op", "io_callback"),
]


def _noop(*_: Any) -> None:
    return None


def child(quick: bool) -> dict[str, Any]:
    """This backend's measurements (TAPD_BACKEND is set), in this process."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    import tapd
    from tapd.emitter import lifecycle
    from tapd.protocol.ring_format import EVERY_DORMANT

    workdir = Path(tempfile.mkdtemp(prefix="tapd-call-", dir="/tmp"))
    procs = Processes(workdir)
    procs.start_daemon(flags=["--startup-grace", "0"])
    os.environ["TAPD_ENDPOINT"] = procs.endpoint
    repeats = 3 if quick else 7
    try:
        steps: dict[tuple[str, str], Any] = {}
        for size in SIZES:
            procs.start_sink(f"bench.call.woken.{size}")
            for variant in VARIANTS:
                steps[variant.key, size] = _step(variant, size, tapd, jax, io_callback)
        arrays = {size: jnp.ones(n, jnp.float32) for size, n in SIZES.items()}
        for (_, size), step in steps.items():  # compile (registers the sites), warm up
            jax.block_until_ready(step(step(arrays[size])))
        tapd.barrier_wait(timeout=120)
        native = lifecycle.get_sender().native
        assert native is not None, "the benchmark needs the ring (a local daemon)"
        for size in SIZES:
            for kind in ("dormant", "strict"):
                for site in native.sites_of(f"bench.call.{kind}.{size}"):
                    native.ring.set_site_every(site, EVERY_DORMANT)
        calls = {"64 B": 2000, "1 MiB": 200}
        if quick:
            calls = {size: n // 4 for size, n in calls.items()}
        seconds: dict[str, list[float]] = {}
        for _ in range(repeats):
            for (key, size), step in steps.items():
                x = arrays[size]
                started = time.perf_counter()
                for _ in range(calls[size]):
                    x = step(x)
                x.block_until_ready()
                elapsed = time.perf_counter() - started
                seconds.setdefault(f"{key}|{size}", []).append(elapsed / calls[size] * 1e6)
                if key in ("woken", "id_tap", "id_print", "id_tap_strict"):
                    tapd.barrier_wait(timeout=120)
        copies = {
            size: _copy_us(n, lifecycle.get_sender().settings.buffer_bytes)
            for size, n in SIZES.items()
        }
        return {"backend": tapd.backend(), "us": seconds, "copy_us": copies, "stats": tapd.stats()}
    finally:
        procs.stop_all()


def _copy_us(elements: int, ring_bytes: int) -> dict[str, float]:
    """µs to copy `elements` float32: "warm", into one buffer again and again (cache
    resident at 64 B); "ring", as the tap copies, into the next slot of a buffer the
    ring's size (256 MB by default), so that each copy lands in memory out of cache."""
    import numpy as np

    source = np.ones(elements, np.float32)
    ring = np.ones(max(ring_bytes // 4, 2 * elements), np.float32)  # touched: no page faults
    slots = len(ring) // elements
    result = {}
    for kind in ("warm", "ring"):
        started = time.perf_counter()
        for i in range(200):
            slot = 0 if kind == "warm" else i % slots
            np.copyto(ring[slot * elements : (slot + 1) * elements], source)
        result[kind] = (time.perf_counter() - started) / 200 * 1e6
    return result


class _Discard:
    """An `output_stream` that keeps nothing (id_print's formatting still runs)."""

    def write(self, text: str) -> None:
        return None


def _step(variant: Variant, size: str, tapd: Any, jax: Any, io_callback: Any) -> Any:
    name = f"bench.call.{variant.kind}.{size}"

    def step(x: Any) -> Any:
        if variant.kind in ("dormant", "woken"):
            x = tapd.tap(x, name)
        elif variant.kind == "strict":
            x = tapd.tap(x, name, ordered="strict")
        elif variant.kind == "id_tap":
            x = tapd.id_tap(lambda arg, transforms: None, x)
        elif variant.kind == "id_tap_strict":
            x = tapd.id_tap(lambda arg, transforms: None, x, ordered="strict")
        elif variant.kind == "id_print":
            x = tapd.id_print(x, what="x", output_stream=_Discard())
        elif variant.kind == "debug.callback":
            jax.debug.callback(_noop, x)
        elif variant.kind == "io_callback":
            io_callback(_noop, None, x)
        return x * 1.0001

    return jax.jit(step)


def calls_report(results: dict[str, dict[str, Any]], quick: bool) -> str:
    lines = ["# Per-call cost of a tapped step (one call per Python step)", ""]
    lines += [table(["", ""], [[k, v] for k, v in machine_description()]), ""]
    lines += [f"code: {code_revision(BENCH_DIR.parent)}", ""]
    verdicts = []
    for backend, result in results.items():
        us = {key: median(values) for key, values in result["us"].items()}
        rows = []
        for size in SIZES:
            plain = us[f"plain|{size}"]
            callback_added = us[f"callback|{size}"] - plain
            for variant in VARIANTS:
                value = us[f"{variant.key}|{size}"]
                added = value - plain
                rows.append(
                    [
                        size,
                        variant.label,
                        number(value, 2),
                        "-" if variant.key == "plain" else number(added, 2),
                        f"{value / plain:.2f}",
                        "-" if variant.key == "plain" else f"{added / callback_added:.3f}",
                    ]
                )
            copy = result["copy_us"][size]["ring"]
            dormant, woken = us[f"dormant|{size}"] / plain, us[f"woken|{size}"] / plain
            if backend == "native" and size == "64 B":
                for key in ("id_tap", "id_print"):
                    ratio = us[f"{key}|{size}"] / plain
                    verdicts.append(
                        f"- native, {size}: {key} {ratio:.2f}x the untapped call (target "
                        f"<= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})"
                    )
            if backend == "native":
                verdicts.append(
                    f"- native, {size}: dormant {dormant:.2f}x the untapped call (target "
                    f"<= 1.5: {'met' if dormant <= 1.5 else 'NOT met'}); woken {woken:.2f}x "
                    f"(target <= 1.5 + the tap's copy {copy / plain:.2f} = "
                    f"{1.5 + copy / plain:.2f}: "
                    f"{'met' if woken <= 1.5 + copy / plain else 'NOT met'})"
                )
            else:
                share = (us[f"dormant|{size}"] - plain) / callback_added
                verdicts.append(
                    f"- {backend}, {size}: a dormant tap adds {share:.3f} of what a no-op "
                    f"jax.debug.callback adds (target <= 0.25: "
                    f"{'met' if share <= 0.25 else 'NOT met'})"
                )
        header = ["size", "variant", "µs/call", "added µs", "÷ untapped", "added ÷ callback's"]
        lines += [f"## {backend} backend", "", table(header, rows), ""]
    lines += ["## Against the targets", "", *verdicts, ""]
    lines += [
        "Medians of "
        + ("3" if quick else "7")
        + " repeats; 2000 calls a run at 64 B, 200 at 1 MiB. `added ÷ callback's`: the "
        "variant's added time over a no-op `jax.debug.callback`'s at the same size. The tap's "
        "copy: a numpy copy of its bytes into the next slot of a buffer the ring's size, "
        "as the tap writes the ring (out of cache; "
        + ", ".join(
            f"{size}: {copy['ring']:.1f} µs, {copy['warm']:.1f} µs into one warm buffer"
            for size, copy in next(iter(results.values()))["copy_us"].items()
        )
        + ").",
        "",
    ]
    return "\n".join(lines)


def coalesce_child(coalesce: str, calls: int) -> dict[str, Any]:
    """One variant's run, in this process: its own daemon, sink and JAX step."""
    import jax
    import jax.numpy as jnp

    import tapd

    workdir = Path(tempfile.mkdtemp(prefix="tapd-coalesce-", dir="/tmp"))
    procs = Processes(workdir)
    flags = ["--startup-grace", "0", *(["--coalesce", "0"] if coalesce == "0" else [])]
    procs.start_daemon(flags=flags)
    os.environ["TAPD_ENDPOINT"] = procs.endpoint
    try:
        procs.start_sink("bench.coalesce")
        w = jnp.full((256, 256), 1.0 / 256, jnp.float32)

        def work(x: Any) -> Any:
            return jnp.tanh(x @ w)

        def tapped(x: Any) -> Any:
            tapd.tap(x[0, :16], "bench.coalesce")
            return work(x)

        steps = {"untapped": jax.jit(work), "tapped": jax.jit(tapped)}
        x0 = jnp.ones((256, 256), jnp.float32)
        for step in steps.values():
            jax.block_until_ready(step(step(x0)))
        tapd.barrier_wait(timeout=60)
        us: dict[str, float] = {}
        for name, step in steps.items():
            cpu_before = procs.daemon_cpu_seconds()
            x = x0
            started = time.perf_counter()
            for _ in range(calls):
                x = step(x)
            x.block_until_ready()
            us[name] = (time.perf_counter() - started) / calls * 1e6
            tapd.barrier_wait(timeout=120)
            us[f"daemon|{name}"] = (procs.daemon_cpu_seconds() - cpu_before) / calls * 1e6
        return us
    finally:
        procs.stop_all()


def coalesce_report(runs: dict[str, list[dict[str, float]]], calls: int, quick: bool) -> str:
    rows = []
    daemon = {}
    for key, label in COALESCE_VARIANTS.items():
        m = {name: median([run[name] for run in runs[key]]) for name in runs[key][0]}
        daemon[key] = m["daemon|tapped"]
        rows.append(
            [
                label,
                number(m["untapped"], 1),
                number(m["tapped"], 1),
                f"{m['tapped'] / m['untapped']:.2f}",
                number(m["daemon|tapped"], 1),
            ]
        )
    header = ["daemon", "untapped µs/call", "tapped µs/call", "÷ untapped", "daemon CPU µs/tap"]
    saved = 1 - daemon["default"] / daemon["0"] if daemon["0"] else 0.0
    return "\n".join(
        [
            "# The daemon's coalescing wait, at a few thousand taps a second",
            "",
            table(header, rows),
            "",
            f"- With the default wait the daemon spends {number(daemon['default'], 1)} µs "
            f"of CPU a tap against {number(daemon['0'], 1)} µs without: {saved:.0%} less.",
            "",
            f"{calls} calls a run, medians of {len(runs['0'])} runs a variant, alternating. "
            "Daemon CPU: its user + system time over the run (clock ticks), a tap's share.",
            "",
        ]
    )


def export_child(quick: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from jax import export

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


def exported_child(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
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

    workdir = Path(tempfile.mkdtemp(prefix="tapd-cache-", dir="/tmp"))
    procs = Processes(workdir)
    procs.start_daemon(flags=["--startup-grace", "0"])
    env = {"TAPD_ENDPOINT": procs.endpoint, "TAPD_AUTOSTART": "0"}
    try:
        procs.start_sink("bench.cache.*")
        runs = []
        for attempt in range(1 if quick else 2):
            directory = workdir / f"cache{attempt}"
            cold = exported_child(["cache", str(directory), "0"], env)
            warm = exported_child(["cache", str(directory), "1"], env)
            runs.append({"cold": cold, "warm": warm})
        return runs
    finally:
        procs.stop_all()


def exported_report(per_call: dict[str, Any], caches: list[dict[str, Any]], quick: bool) -> str:
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
    parser.add_argument("measure", nargs="?", choices=["calls", "coalesce", "exported"],
                        default="calls", help="calls (default), coalesce, exported")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        children = {
            "calls": lambda: child(args.quick),
            "coalesce": lambda: coalesce_child(rest[0], int(rest[1])),
            "export": lambda: export_child(args.quick),
            "cache": lambda: cache_child(rest[0], rest[1] == "1"),
        }
        print(json.dumps(children[kind]()), flush=True)
        return
    quick = ["--quick"] if args.quick else []
    if args.measure == "calls":
        backends = ("native", "portable")
        results = {b: run_backend_child(__file__, b, ["calls", *quick]) for b in backends}
        text = calls_report(results, args.quick)
    elif args.measure == "coalesce":
        os.environ.setdefault("TAPD_AUTOSTART", "0")
        calls, repeats = (500, 2) if args.quick else (2000, 5)
        runs: dict[str, list[dict[str, float]]] = {key: [] for key in COALESCE_VARIANTS}
        for _ in range(repeats):
            for key in COALESCE_VARIANTS:
                argv = ["coalesce", key, str(calls)]
                runs[key].append(run_backend_child(__file__, "native", argv))
        text = coalesce_report(runs, calls, args.quick)
    else:
        env = {"TAPD_BACKEND": "native", "TAPD_AUTOSTART": "0"}
        per_call = exported_child(["export", *quick], env)
        text = exported_report(per_call, cache_runs(args.quick), args.quick)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
