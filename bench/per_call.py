"""What a tap costs per call of a jitted step (issue 26): one call per Python step.

Each variant is `x = step(x)` called in a Python loop, `step` a jitted `x * 1.0001` on a
64 B (16 float32) or a 1 MiB array, with (or without) one tap or callback of `x`:
untapped; a dormant `tapd.tap` (no taker: its site's slot says EVERY_DORMANT, set by
hand as the daemon would); a woken one (a subscriber process takes it); a strict one
(`ordered="strict"`, dormant); host_callback's `id_tap` of a no-op closure and `id_print`
to an `output_stream` (both run in this process, from its local ring, by its receiver
thread, while the loop runs; id_print's texts rendered by its print worker, a child
process, once it has started: tapd/print_worker.py), and a strict `id_tap`; a no-op
`jax.debug.callback`; a no-op `io_callback`. Timed from the first call to
`block_until_ready()` of the last; woken and in-process taps are drained
(`barrier_wait`, untimed) between runs. Once per backend, each in its own process, the
variants interleaved within each repeat; the table gives the median over repeats.

Targets (native): a dormant tap's call <= 1.5 x the untapped call's, and an `id_tap`'s
or `id_print`'s (issue 33); a woken one <= 1.5 x plus its copy: a numpy copy of the same
bytes, measured in the same process as the tap makes it, into the next slot of a buffer
the ring's size, out of cache (1 MiB: ~3x a copy into one warm buffer, which the first
figures used). Portable:
a tap's added time <= 0.25 of what a no-op `jax.debug.callback` adds.

    python bench/per_call.py [--quick] [--output PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
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
    from processes import Processes

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


def report(results: dict[str, dict[str, Any]], quick: bool) -> str:
    from report import code_revision, machine_description, median, number, table

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and repeats")
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_DIR))
    if args.child:
        print(json.dumps(child(args.quick)), flush=True)
        return
    from processes import run_backend_child

    quick = ["--quick"] if args.quick else []
    results = {
        backend: run_backend_child(__file__, backend, quick) for backend in ("native", "portable")
    }
    text = report(results, args.quick)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
