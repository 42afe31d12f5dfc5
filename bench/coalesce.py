"""What the daemon's coalescing wait (`tapd start --coalesce`) saves when taps come a few
thousand a second.

A jitted step that does some work (a 256 x 256 matrix product, ~0.3 ms here) and taps
64 B, called once per Python step, 2000 calls a run: taps reach the daemon a few
thousand a second, a handful at each of its rounds. A subscriber process takes them
with a no-op handler. Per variant: the step's µs per call (untapped and tapped, in the
same process) and the daemon's CPU per tap. The daemon runs with `--coalesce 0` (each
round passed on at once) or the default (2 ms), each in a JAX process of its own, the
two alternating over the repeats; medians.

    python bench/coalesce.py [--quick] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
VARIANTS = {"0": "--coalesce 0 (each round at once)", "default": "default (2 ms)"}


def child(coalesce: str, calls: int) -> dict[str, Any]:
    """One variant's run, in this process: its own daemon, sink and JAX step."""
    import jax
    import jax.numpy as jnp
    from processes import Processes

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


def report(runs: dict[str, list[dict[str, float]]], calls: int, quick: bool) -> str:
    from report import median, number, table

    rows = []
    daemon = {}
    for key, label in VARIANTS.items():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls and runs")
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--child", nargs=2, metavar=("COALESCE", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_DIR))
    os.environ.setdefault("TAPD_AUTOSTART", "0")
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))), flush=True)
        return
    from processes import run_backend_child

    calls, repeats = (500, 2) if args.quick else (2000, 5)
    runs: dict[str, list[dict[str, float]]] = {key: [] for key in VARIANTS}
    for _ in range(repeats):
        for key in VARIANTS:
            runs[key].append(run_backend_child(__file__, "native", [key, str(calls)]))
    text = report(runs, calls, args.quick)
    print(text)
    if args.output is not None:
        args.output.write_text(text)


if __name__ == "__main__":
    main()
