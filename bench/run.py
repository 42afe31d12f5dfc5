"""tapd benchmark: step-time overhead, end-to-end throughput, delivery latency.

The first section of `python -m bench cpu` (bench/__main__.py), which writes its report
into bench/RESULTS.md; by hand:

    .venv/bin/python bench/run.py            # full run (a few minutes), prints its report
    .venv/bin/python bench/run.py --output PATH   # and writes it to PATH
    .venv/bin/python bench/run.py --quick    # ~1 minute smoke run
    .venv/bin/python bench/run.py --backend portable   # pick tapd's emitter backend

This process is the JAX emitter. It starts its own tapd daemon on an ipc socket in a
fresh 0700 directory under /tmp, and one real subscriber process (processes.py sink)
per consumer name, each waited for through the daemon's own subscriber list. All the
variants of a measurement run interleaved, repeat after repeat, and every figure is the
median over the repeats: the machine is small and shared, so compare the ratios taken
within this one run rather than absolute numbers across runs.

1. Step time of a jitted `lax.fori_loop` (a 64-float update per step): untapped,
   `tapd.tap` each step (subscriber handler no-op, or sleeping), and in-process
   `jax.debug.callback` (no-op, or sleeping). The loop is timed until
   `jax.effects_barrier()` returns; tapd's `barrier_wait()` is timed separately.
2. Throughput JAX -> subscriber handler for 64 B, 64 KiB and 1 MiB float32 payloads,
   from the first tap to `barrier_wait()` returning, beside raw pyzmq PUSH/PULL over
   ipc and a multiprocessing.Queue pipeline moving the same arrays; then 64 B taps
   handled by a per-tap handler beside a batch handler (TapBatch); with the daemon's CPU
   (user + system, /proc/<pid>/stat) per tap and per MB around each. Its code, and the
   baselines', are throughput.py's (`throughput.py once` runs this section alone).
3. Delivery latency at a steady, modest tap rate: the handler's `time.time()` minus
   `meta.time` (when the tap ran in the emitter).
4. Per-tap cost and isolation on each emitter backend (`dormant.py probe`, one process
   per backend).
5. Multi-host throughput (multihost.py): taps/s and MB/s reaching one subscriber from
   one JAX process with 4 CPU devices, and from a 2-process `jax.distributed` job with
   4 devices and its own daemon per process, the subscriber following both daemons.
The benchmarks that run in processes of their own (dormant.py, per_call.py, ...) are the
suite's other sections, each run by bench/__main__.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import multihost
import numpy as np
import throughput
from jax import lax
from processes import BENCH_DIR, Processes
from report import (
    code_revision,
    load_average,
    machine_description,
    median,
    number,
    publish,
    size_name,
    table,
    with_spread,
)

import tapd

COMMAND = ".venv/bin/python bench/run.py"
BARRIER_TIMEOUT = throughput.BARRIER_TIMEOUT
VECTOR = 64  # floats updated per step in the step-time loop


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much of everything to run."""

    step_repeats: int  # step time: cheap, noisy, so many
    load: throughput.Load  # throughput (section 2): repeats, taps per size, handler taps
    steps: int  # fori_loop length for the fast variants
    steps_tapd_sleep: int  # fewer: each tap costs the handler `sleep_ms`
    steps_callback_sleep: int  # fewer still: each step costs the loop `sleep_ms`
    sleep_ms: float
    latency: tuple[tuple[float, float], ...]  # (taps per second, seconds) runs
    idle_seconds: float  # watching the daemon's CPU use with no taps
    multihost_repeats: int
    multihost: dict[int, int]  # multi-host: bytes per device-tap -> steps (taps per device)


FULL = Plan(
    step_repeats=15,
    load=throughput.FULL,
    steps=2000,
    steps_tapd_sleep=200,
    steps_callback_sleep=50,
    sleep_ms=10.0,
    latency=((200.0, 3.0), (1.0, 10.0)),
    idle_seconds=5.0,
    multihost_repeats=7,
    multihost={64: 3000, 1024 * 1024: 200},
)
QUICK = Plan(
    step_repeats=3,
    load=throughput.QUICK,
    steps=1000,
    steps_tapd_sleep=100,
    steps_callback_sleep=20,
    sleep_ms=10.0,
    latency=((200.0, 1.0), (1.0, 3.0)),
    idle_seconds=2.0,
    multihost_repeats=3,
    multihost={64: 500, 1024 * 1024: 40},
)


# ---- 1. step time ---------------------------------------------------------------------


@dataclasses.dataclass
class StepCase:
    """One variant of the stepped loop and its timings, one entry per repeat."""

    key: str  # a..e as in the docstring
    label: str
    steps: int
    loop: Callable[[jax.Array, int], jax.Array]
    tapped: bool = False  # tapd taps: also time barrier_wait
    loop_s: list[float] = dataclasses.field(default_factory=list)
    barrier_s: list[float] = dataclasses.field(default_factory=list)

    def us_per_step(self) -> list[float]:
        return [s / self.steps * 1e6 for s in self.loop_s]


def update(x: jax.Array) -> jax.Array:
    """The per-step computation: a small elementwise update of a 64-float vector."""
    return x * 0.999 + 0.001 * jnp.sin(x)


def stepped_loop(
    side_effect: Callable[[jax.Array, jax.Array], Any] | None,
) -> Callable[[jax.Array, int], jax.Array]:
    """jit(x, n -> fori_loop of n `update` steps), calling `side_effect(i, x)` each step."""

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        x = update(x)
        if side_effect is not None:
            side_effect(i, x)
        return x

    return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))


def tap_each_step(name: str) -> Callable[[jax.Array, int], jax.Array]:
    return stepped_loop(lambda i, x: tapd.tap(x, name, step=i))


def callback_each_step(function: Callable[[Any], None]) -> Callable[[jax.Array, int], jax.Array]:
    return stepped_loop(lambda i, x: jax.debug.callback(function, x))


def _noop(_: Any) -> None:
    pass


def _sleeper(sleep_ms: float) -> Callable[[Any], None]:
    def sleep(_: Any) -> None:
        time.sleep(sleep_ms / 1000)

    return sleep


def step_cases(plan: Plan) -> list[StepCase]:
    """The variants, each with an untapped loop of the same length to compare against."""
    plain = stepped_loop(None)
    tapd_noop = tap_each_step("bench.steps.noop")
    tapd_sleep = tap_each_step("bench.steps.sleep")
    cb_noop = callback_each_step(_noop)
    cb_sleep = callback_each_step(_sleeper(plan.sleep_ms))
    ms = f"{plan.sleep_ms:g} ms"
    n, n_tapd, n_cb = plan.steps, plan.steps_tapd_sleep, plan.steps_callback_sleep
    return [
        StepCase("a", "untapped", n, plain),
        StepCase("b", "tapd.tap, no-op handler", n, tapd_noop, tapped=True),
        StepCase("d", "debug.callback, no-op", n, cb_noop),
        StepCase("a", "untapped", n_tapd, plain),
        StepCase("b", "tapd.tap, no-op handler", n_tapd, tapd_noop, tapped=True),
        StepCase("c", f"tapd.tap, handler sleeps {ms}", n_tapd, tapd_sleep, tapped=True),
        StepCase("a", "untapped", n_cb, plain),
        StepCase("d", "debug.callback, no-op", n_cb, cb_noop),
        StepCase("e", f"debug.callback sleeping {ms}", n_cb, cb_sleep),
    ]


def time_step_case(case: StepCase, steps: int | None = None) -> tuple[float, float]:
    """Seconds for the loop until effects_barrier(), then for barrier_wait() (tapd only)."""
    x = jnp.zeros(VECTOR, jnp.float32)
    started = time.perf_counter()
    case.loop(x, case.steps if steps is None else steps).block_until_ready()
    jax.effects_barrier()
    looped = time.perf_counter()
    if case.tapped:
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    return looped - started, time.perf_counter() - looped


def measure_step_time(procs: Processes, plan: Plan) -> list[StepCase]:
    """Measurement 1: interleave every variant, `plan.step_repeats` times."""
    sinks = [
        procs.start_sink("bench.steps.noop"),
        procs.start_sink("bench.steps.sleep", sleep_ms=plan.sleep_ms),
    ]
    cases = step_cases(plan)
    for case in cases:  # compile, connect, and run each loop once outside the timing
        time_step_case(case, steps=3)
    for repeat in range(plan.step_repeats):
        for case in cases:
            loop_s, barrier_s = time_step_case(case)
            case.loop_s.append(loop_s)
            case.barrier_s.append(barrier_s)
        print(f"  step time: repeat {repeat + 1}/{plan.step_repeats} done", flush=True)
    for sink in sinks:
        procs.stop(sink.process)
    return cases


def step_table(cases: list[StepCase]) -> tuple[str, list[str]]:
    """The step-time table and the two headline ratios (slow handler / no-op handler)."""
    plain = {c.steps: median(c.us_per_step()) for c in cases if c.key == "a"}
    rows = []
    for case in cases:
        per_step = median(case.us_per_step())
        base = plain[case.steps]
        barrier = with_spread(case.barrier_s, 1e3, 1) if case.tapped else "-"
        rows.append([
            f"({case.key}) {case.label}", str(case.steps), with_spread(case.us_per_step()),
            f"x{number(per_step / base, 1)}", number(per_step - base), barrier,
        ])  # fmt: skip
    header = [
        "variant", "steps", "µs/step: median (min-max)", "vs untapped, same steps",
        "added µs/step", "barrier_wait ms",
    ]  # fmt: skip

    def paired(slow: str, fast: str, steps: int) -> float:
        """Median over repeats of slow/fast, each pair run back to back in one repeat."""
        a, b = (next(c for c in cases if c.key == k and c.steps == steps) for k in (slow, fast))
        return median([x / y for x, y in zip(a.loop_s, b.loop_s, strict=True)])

    n_tapd = next(c.steps for c in cases if c.key == "c")
    n_cb = next(c.steps for c in cases if c.key == "e")
    headline = [
        f"tapd: step time with the sleeping handler / with the no-op handler, {n_tapd} steps: "
        f"x{paired('c', 'b', n_tapd):.2f}",
        f"jax.debug.callback: step time sleeping / no-op, {n_cb} steps: "
        f"x{paired('e', 'd', n_cb):.1f}",
    ]
    return table(header, rows), headline


# ---- 3. latency -----------------------------------------------------------------------


@dataclasses.dataclass
class LatencyRun:
    """Taps at one steady rate and the delivery latencies the handler saw."""

    rate: float  # taps per second asked for
    count: int
    achieved_rate: float = 0.0
    latencies_ms: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


def paced_taps(step: Callable[[jax.Array, int], jax.Array], run: LatencyRun) -> None:
    """`run.count` jitted calls, each tapping once, started `1/run.rate` s apart."""
    x = jnp.zeros(16, jnp.float32)
    started = last = time.perf_counter()
    for i in range(run.count):
        delay = started + i / run.rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # pacing the taps, not waiting for readiness
        last = time.perf_counter()
        step(x, i).block_until_ready()
    run.achieved_rate = (run.count - 1) / (last - started) if run.count > 1 else 0.0
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)


def measure_latency(procs: Processes, plan: Plan) -> list[LatencyRun]:
    """Measurement 3: paced single taps of 16 floats at each planned rate; the
    subscriber's handler records now - meta.time for every tap."""
    consumer = "bench.latency"
    sink = procs.start_sink(consumer, latency=True)
    step = jax.jit(lambda x, i: tapd.tap(x + i, consumer, step=i))
    step(jnp.zeros(16, jnp.float32), -1).block_until_ready()  # compile, warm up
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    runs = [LatencyRun(rate, round(rate * seconds)) for rate, seconds in plan.latency]
    for run in runs:
        paced_taps(step, run)
    procs.stop(sink.process)
    latencies = np.array(sink.results()["latencies_s"][1:]) * 1e3  # [0]: the warm-up tap
    start = 0
    for run in runs:  # the sink saw the runs' taps in order
        run.latencies_ms = latencies[start : start + run.count]
        start += run.count
    return runs


def latency_table(runs: list[LatencyRun]) -> str:
    rows = []
    for run in runs:
        ms = run.latencies_ms
        percentiles = [f"{np.percentile(ms, p):.2f}" for p in (50, 90, 99)]
        rows.append([
            f"{run.rate:g}", str(len(ms)), f"{run.achieved_rate:.1f}", *percentiles,
            f"{ms.max():.2f}",
        ])  # fmt: skip
    header = ["target taps/s", "taps", "achieved taps/s", "p50 ms", "p90 ms", "p99 ms", "max ms"]
    return table(header, rows)


def idle_daemon_cpu(procs: Processes, seconds: float) -> str:
    """The daemon's CPU use, as a share of one core, over `seconds` without taps
    (this emitter still connected), after the last tap's barrier."""
    before = procs.daemon_cpu_seconds()
    time.sleep(seconds)  # the measurement window itself
    share = (procs.daemon_cpu_seconds() - before) / seconds
    return f"daemon CPU while idle for {seconds:g} s, this emitter attached: {share:.1%} of a core"


# ---- the run --------------------------------------------------------------------------


def describe_method(plan: Plan) -> str:
    """What exactly was run, for RESULTS.md."""
    sizes = ", ".join(f"{size_name(s)} x {c}" for s, c in plan.load.counts.items())
    return "\n".join([
        f"- Every figure is the median of {plan.step_repeats} (step time) or {plan.load.repeats} "
        "(throughput) repeats; the variants of a measurement are interleaved within each "
        "repeat, so they share the same noise. Ratios in the tables are between medians.",
        f"- Step time: `lax.fori_loop` of `x = x*0.999 + 0.001*sin(x)` on {VECTOR} float32, "
        "jitted with the trip count as an argument (compiled once, warmed up). Timed from "
        "dispatch to `block_until_ready()` + `jax.effects_barrier()`; for tapd, "
        "`tapd.barrier_wait()` (every tap handled) is timed after that, separately.",
        f"- The sleeping tapd handler (c) runs {plan.steps_tapd_sleep} steps, not "
        f"{plan.steps}: each tap costs it {plan.sleep_ms:g} ms, so its barrier_wait is "
        f"about {plan.steps_tapd_sleep * plan.sleep_ms / 1000:g} s per repeat. The taps fit "
        "easily in the emitter's buffer (or ring) and the daemon's credit window, so the "
        "loop never waits for the handler. The sleeping debug.callback (e) runs "
        f"{plan.steps_callback_sleep} steps. Each variant is compared with an untapped loop "
        "of the same length.",
        f"- Throughput: {sizes} taps of a float32 array from a jitted fori_loop, timed from "
        "dispatch to `barrier_wait()` returning (every tap handled by the no-op handler of "
        "a subscriber process). The baselines send the same number of same-size numpy "
        "arrays from a producer process to a consumer process: raw pyzmq PUSH/PULL over "
        "ipc (zero-copy send and receive) and a `multiprocessing.Queue`; timed from the "
        "first send until the consumer has received the last one. MB = 10^6 bytes. "
        "`tapd ÷ pyzmq` is tapd's throughput as a fraction of raw pyzmq's.",
        "- Latency: "
        + ", then ".join(f"{rate:g} taps/s for {seconds:g} s" for rate, seconds in plan.latency)
        + ", one jitted call per tap (16 float32); latency = the handler's `time.time()` - "
        "`meta.time` (when the tap ran in the emitter). The sparse run shows the delay of "
        "a daemon that has gone quiet; its p90/p99 rest on few samples.",
        "- Processes: this one (JAX emitter), one tapd daemon, one subscriber process per "
        "consumer name, all on the same machine and cores: the daemon and subscriber "
        "compete with the tapped loop for CPU, which is part of what (b) and (c) measure.",
        f"- Handlers: {plan.load.handler_taps} taps of 64 B (16 float32) from the same jitted "
        "fori_loop per repeat, to a subscriber process whose handler only counts: per tap "
        "(`handler(value, meta)`), or per batch (`@sub.on(name, batch=True)`: a TapBatch "
        "per site per message, stacked leaves and meta columns). The two alternate within "
        "each repeat, their order flipped every repeat; timed from dispatch to "
        "`barrier_wait()` returning.",
        multihost.method(plan.multihost, plan.multihost_repeats),
    ])  # fmt: skip


def render(
    plan: Plan,
    machine: list[tuple[str, str]],
    sections: list[tuple[str, str]],
    command: str,
    quick: bool,
) -> str:
    """The whole RESULTS.md text."""
    lines = ["# tapd benchmark results", ""]
    if quick:
        lines += ["**Quick smoke run (`--quick`): small counts, few repeats.**", ""]
    lines += ["## Machine", "", table(["", ""], [list(row) for row in machine]), ""]
    lines += ["## Reproduce", "", "```", command, "```", ""]
    lines += ["## Method", "", describe_method(plan), ""]
    for title, body in sections:
        lines += [f"## {title}", "", body, ""]
    return "\n".join(lines)


def run(
    plan: Plan, workdir: Path, backend: str | None
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Start the daemon, run the measurements; return the result sections
    (title, text) and facts about the run (what, value) for the machine table."""
    procs = Processes(workdir)
    try:
        endpoints = procs.start_daemon()
        print(f"daemon ready at {', '.join(endpoints)}", flush=True)
        throughput.configure_emitter(procs.endpoint, backend)
        print("1. step time", flush=True)
        steps, headline = step_table(measure_step_time(procs, plan))
        print("2. throughput", flush=True)
        rates = throughput.throughput_table(throughput.measure_throughput(procs, plan.load))
        handlers = throughput.handlers_table(
            throughput.measure_handlers(procs, plan.load), plan.load.handler_taps
        )
        print("3. latency", flush=True)
        latency = latency_table(measure_latency(procs, plan))
        idle = idle_daemon_cpu(procs, plan.idle_seconds)
        print("4. per-tap cost and isolation, by backend", flush=True)
        backends = measure_backends(procs, plan)
        counters = procs.daemon_stats()["counters"]
    finally:
        procs.stop_all()
    print("5. multi-host throughput", flush=True)
    section_started = time.monotonic()
    try:
        several = multihost.render(
            multihost.measure(workdir, plan.multihost, plan.multihost_repeats, backend)
        )
        print(f"  multi-host: {time.monotonic() - section_started:.0f} s", flush=True)
    except (RuntimeError, TimeoutError, OSError) as exc:  # report it; keep the other sections
        print(f"  multi-host: failed: {exc}", flush=True)
        several = f"**Failed**, so no figures:\n\n```\n{exc}\n```"
    log = procs.daemon_log_text().strip()
    health = [
        f"- daemon counters: `{json.dumps(counters, sort_keys=True)}`",
        f"- emitter counters (`tapd.stats()`): `{json.dumps(tapd.stats(), sort_keys=True)}`",
        "- daemon warnings/errors: " + (f"\n\n```\n{log}\n```" if log else "none"),
    ]
    sections = [
        ("1. Step time", table_with_notes(steps, headline)),
        ("2. Throughput, JAX -> subscriber handler", rates + "\n\n" + handlers),
        ("3. Delivery latency", latency + "\n\n- " + idle),
        ("4. Per-tap cost on the JAX loop and isolation, both backends", backends),
        (
            "5. Multi-host throughput: 2 processes x 4 devices vs 1 x 4, one subscriber",
            several,
        ),
    ]
    sections.append(("Health of the run", "\n".join(health)))
    return sections, [("tapd emitter backend", emitter_backend())]


# ---- 4. per-tap cost and isolation, by backend --------------------------------------


def measure_backends(procs: Processes, plan: Plan) -> str:
    """Run `dormant.py probe` once per backend (the backend is per process)."""
    procs.start_sink("overhead.isolation", sleep_ms=plan.sleep_ms)
    results = []
    for backend in ("native", "portable"):
        argv = [sys.executable, str(BENCH_DIR / "dormant.py"), "probe", "--endpoint",
                procs.endpoint, "--backend", backend, "--steps", str(plan.steps),
                "--repeats", str(plan.load.repeats),
                "--isolation-steps", str(max(20, plan.steps_tapd_sleep // 2))]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            results.append({"backend": backend, "error": done.stderr.strip()[-300:]})
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows, isolation_rows = [], []
    for result in results:
        if "error" in result:
            rows.append([result["backend"], "unavailable: " + result["error"]] + [""] * 7)
            continue
        for row in result["per_tap"]:
            rows.append([
                result["backend"], size_name(row["bytes"]), f"{row['untapped_us']:.2f}",
                f"{row['tap_added_us']:.2f}", f"{row['unordered_tap_added_us']:.2f}",
                f"{row['callback_added_us']:.2f}",
                f"{row['tap_added_us'] / row['callback_added_us']:.3f}",
                f"{row['memcpy_hot_us']:.2f} / {row['memcpy_rotating_us']:.2f}",
                f"{row['tap_added_us'] / row['memcpy_rotating_us']:.2f}",
            ])  # fmt: skip
        iso = result["isolation"]
        isolation_rows.append([
            result["backend"], str(iso["steps"]), f"{iso['untapped_us']:.1f}",
            f"{iso['tapped_us']:.1f}", f"{iso['callback_us']:.1f}", f"x{iso['ratio']:.3f}",
            f"x{iso['vs_callback']:.3f}", f"{iso['barrier_s']:.2f}",
        ])  # fmt: skip
    per_tap = table(
        ["backend", "payload", "untapped µs/step", "tap adds µs", "unordered tap adds µs",
         "no-op debug.callback adds µs",
         "tap ÷ callback", "numpy copy µs: hot / rotating 256 MB", "tap ÷ rotating copy"],
        rows,
    )  # fmt: skip
    isolation = table(
        ["backend", "steps", "untapped µs/step", "tapped µs/step (handler sleeps 10 ms)",
         "no-op debug.callback in its place µs/step", "tapped ÷ untapped",
         "tapped ÷ callback in its place", "barrier_wait s"],
        isolation_rows,
    )  # fmt: skip
    return (
        f"{per_tap}\n\nIsolation: a step of eight 128x128 matmuls, tapped into a subscriber "
        f"that sleeps {plan.sleep_ms:g} ms per tap, while the buffer or ring has room.\n\n"
        f"{isolation}"
    )


def emitter_backend() -> str:
    """The backend this process's taps used (tapd versions without a choice: portable)."""
    from tapd.emitter import lifecycle

    probe = getattr(lifecycle, "backend", None)
    if probe is None:
        return "portable (jax.debug.callback); this tapd has no other"
    return str(probe())


def table_with_notes(text: str, notes: list[str]) -> str:
    note = (
        "(Ratios below: median over the repeats of the per-repeat ratio; the two loops of "
        "each pair run back to back.)"
    )
    return text + "\n\n" + note + "\n\n" + "\n".join(f"- **{n}**" for n in notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~1 minute smoke run")
    parser.add_argument(
        "--output",
        type=Path,
        help="Markdown file to write (default: none; `python -m bench cpu` puts the report "
        "into bench/RESULTS.md)",
    )
    parser.add_argument(
        "--backend",
        help="emitter backend for tapd.configure(backend=...), e.g. portable or native "
        "(default: tapd's own default)",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    output = args.output
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup in `finally`
    machine = machine_description()
    machine.append(("tapd revision", code_revision(BENCH_DIR.parent)))
    workdir = Path(tempfile.mkdtemp(prefix="tapdb-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    started = time.monotonic()
    try:
        sections, facts = run(plan, workdir, args.backend)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    machine += facts
    machine.append(("load average at end", load_average()))
    machine.append(("benchmark wall time", f"{time.monotonic() - started:.0f} s"))
    command = " ".join([COMMAND, *sys.argv[1:]])
    text = render(plan, machine, sections, command, args.quick)
    publish(text, output)


if __name__ == "__main__":
    main()
