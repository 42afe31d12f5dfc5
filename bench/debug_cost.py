"""What `tapd.debug.callback` costs beside `jax.debug.callback` (issues 28 and 32), each
backend in a process of its own. Its callbacks never leave the process (the local ring,
tapd/emitter/local_path.py): no daemon runs during these measurements.

(a) In a jitted `fori_loop` of 2000 steps, one no-op callback per step: µs per step
    added over the untapped loop, `tapd.debug.callback` against `jax.debug.callback`.
    Target: tapd's added <= 0.05 of JAX's.
(b) One jitted call per Python step (blocks of 250 calls of `x * 1.0001` on 16 floats), with one
    no-op callback (`tapd.debug.callback`, and an `id_tap` of a closure): the call's
    time ÷ the untapped call's, and to `barrier_wait`: the callbacks still to run when
    the last call is done are work the loop's thread pays for later, under the same GIL.
    Target (issue 32): tapd's added cost to `barrier_wait` <= 0.1 of what a no-op
    `jax.debug.callback` adds.
(b2) The same with a step that works (a 256 x 256 matrix product, ~0.3 ms here; blocks
    of 100 calls), as a small model's step does. Target: tapd's added cost <= 0.1 of JAX's.
(d) The first `jax.debug.print` under `tapd.install_debug()` in a new process with no
    daemon (autostart on, as users have it): seconds from the compiled call's return to
    the printed line, and whether a daemon exists afterwards. Target: <= 0.3 s, none.
(c) A 200-step `fori_loop` whose every step multiplies a 256 x 256 matrix and calls a
    50 ms callback on one value of its result: the loop's time (to
    `block_until_ready`, the callbacks still running after it for tapd) ÷ the untapped
    loop's. Target: <= 1.1 for tapd (JAX's: 200 x 50 ms). tapd's callbacks are waited
    for (`barrier_wait`, untimed) before the next run.
(c') The same callback on one value of the step's input, read before the product
    overwrites the loop's carry: XLA copies the carry every step for that, callback or
    not, which the control row (the value carried out of the loop, no callback) shows.
(e) A tqdm bar closed right after the call (issue 62): a jitted 100-step `fori_loop`
    whose steps update the bar through `jax.debug.callback`, each update taking 5 ms;
    the bar is closed as soon as the call returns (no `block_until_ready`). Stock
    `jax.debug` against `tapd.install_debug()` (each backend, and the TPU's gathered
    path forced on the CPU), each in a process of its own: the updates the bar had when
    it closed, the call's time, and the call's time to the close. Target: 100/100 at
    the close, and tapd's call <= 0.1 of stock's (the call does not wait; the close may).

Each variant interleaved with the others within a repeat; medians over repeats.

    python bench/debug_cost.py [--quick] [--output bench/DEBUG.md]
    python bench/debug_cost.py --bars [--quick]     # (e) alone, printed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent


def _noop(*_: Any) -> None:
    return None


def _sleep_50ms(*_: Any) -> None:
    time.sleep(0.05)


def measure(quick: bool) -> dict[str, list[float]]:
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd
    import tapd.debug

    callbacks = {"none": None, "jax": jax.debug.callback, "tapd": tapd.debug.callback}
    repeats = 3 if quick else 7
    steps, calls, slow_steps = (500, 500, 40) if quick else (2000, 2000, 200)
    working_calls = calls // 4

    def loop(callback: Callable[..., Any] | None, function: Callable[..., Any]) -> Any:
        def body(i: Any, x: Any) -> Any:
            if callback is not None:
                callback(function, x)
            return x * 0.999 + 0.001 * jnp.sin(x)

        return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))

    w = jnp.full((256, 256), 1.0 / 256, jnp.float32)

    def working_loop(callback: Callable[..., Any] | None, reads: str = "result") -> Any:
        """(c)'s: a step with work in it (a 256 x 256 matrix product), which calls a
        50 ms callback on one value of the step's result (a logged metric), or of its
        input (`reads="input"`: the loop's carry, read before the product overwrites
        it; XLA then copies the carry every step, as it does for `reads="carry"`,
        which takes that value out of the loop without any callback)."""

        def body(i: Any, carry: Any) -> Any:
            x, total = carry
            if reads == "carry":
                total = total + x[0, 0]
            elif callback is not None and reads == "input":
                callback(_sleep_50ms, x[0, 0])
            y = jnp.tanh(x @ w)
            if callback is not None and reads == "result":
                callback(_sleep_50ms, y[0, 0])
            return y, total

        return jax.jit(lambda x, n: lax.fori_loop(0, n, body, (x, jnp.float32(0)))[0])

    def step(callback: Callable[..., Any] | None) -> Any:
        def call(x: Any) -> Any:
            if callback is not None:
                callback(_noop, x)
            return x * 1.0001

        return jax.jit(call)

    def id_tap_step() -> Any:
        closure = lambda arg, transforms: None  # noqa: E731 (a closure: runs in this process)
        return jax.jit(lambda x: tapd.id_tap(closure, x) * 1.0001)

    def working_step(callback: Callable[..., Any] | None) -> Any:
        def call(x: Any) -> Any:
            if callback is not None:
                callback(_noop, x[0, 0])
            return jnp.tanh(x @ w)

        return jax.jit(call)

    loops = {name: loop(cb, _noop) for name, cb in callbacks.items()}
    working_steps = {name: working_step(cb) for name, cb in callbacks.items()}
    slow = {name: working_loop(cb) for name, cb in callbacks.items() if name != "jax"}
    slow["tapd, input"] = working_loop(tapd.debug.callback, reads="input")
    slow["none, input carried"] = working_loop(None, reads="carry")
    steps_ = {name: step(cb) for name, cb in callbacks.items()}
    steps_["id_tap"] = id_tap_step()
    x = jnp.ones(64, jnp.float32)
    small = jnp.ones(16, jnp.float32)
    matrix = jnp.ones((256, 256), jnp.float32)
    for function in loops.values():
        jax.block_until_ready(function(x, 2))
    for function in slow.values():
        jax.block_until_ready(function(matrix, 2))
    for function in steps_.values():
        jax.block_until_ready(function(function(small)))
    for function in working_steps.values():
        jax.block_until_ready(function(function(matrix)))
    tapd.barrier_wait(timeout=120)
    us: dict[str, list[float]] = {}
    # (b) and (b2) in many short blocks, each variant's in turn: their times move by more
    # than tapd adds between seconds of one run (the two threads' placement on the two
    # cores: see bench/RESULTS.md §10), which a median of many blocks sees through. Each
    # timed block comes after `WARM_UP` untimed calls of its own variant and their
    # barrier: the variant before it leaves the caches in its own state, which the next
    # one's calls pay for (after a block of jax.debug.callback, a tapd.debug.callback
    # block of 250 calls took ~0.5 ms more than after one of its own, ~100 µs of it in
    # its first six calls).
    blocks = 10 if quick else BLOCKS
    for _ in range(blocks):
        for name, function in steps_.items():
            _warm_up(function, small)
            started = time.perf_counter()
            block = calls // 8
            us.setdefault(f"call|{name}", []).append(_per_call_us(function, small, block))
            tapd.barrier_wait(timeout=120)
            drained = (time.perf_counter() - started) / block * 1e6
            us.setdefault(f"drained|{name}", []).append(drained)
        for name, function in working_steps.items():
            _warm_up(function, matrix)
            us.setdefault(f"work|{name}", []).append(
                _per_call_us(function, matrix, working_calls // 5)
            )
            tapd.barrier_wait(timeout=120)
    for _ in range(repeats):
        for name, function in loops.items():
            started = time.perf_counter()
            jax.block_until_ready(function(x, steps))
            us.setdefault(f"loop|{name}", []).append((time.perf_counter() - started) / steps * 1e6)
            tapd.barrier_wait(timeout=120)
        for name, function in slow.items():
            started = time.perf_counter()
            jax.block_until_ready(function(matrix, slow_steps))
            us.setdefault(f"slow|{name}", []).append((time.perf_counter() - started) * 1e6)
            tapd.barrier_wait(timeout=300)  # 200 x 50 ms of callbacks, untimed
    us["slow|jax(200 x 50 ms)"] = [slow_steps * 50_000.0]
    return us


BLOCKS = 40  # of (b) and (b2), each variant


WARM_UP = 25  # untimed calls before each block of (b) and (b2)


def _warm_up(function: Callable[[Any], Any], x: Any) -> None:
    import tapd

    _per_call_us(function, x, WARM_UP)
    tapd.barrier_wait(timeout=120)


def _per_call_us(function: Callable[[Any], Any], x: Any, calls: int) -> float:
    """µs a call of `x = function(x)` called `calls` times, one Python step a call, to
    `block_until_ready()` of the last."""
    started = time.perf_counter()
    for _ in range(calls):
        x = function(x)
    x.block_until_ready()
    return (time.perf_counter() - started) / calls * 1e6


FIRST_PRINT = """
import sys, time
import jax
import tapd

tapd.install_debug()
printed = []
write = sys.stdout.write
def noting(text):
    if text.startswith("first"):
        printed.append(time.monotonic())
    return write(text)
sys.stdout.write = noting
f = jax.jit(lambda x: jax.debug.print("first {}", x))
f(1.0)
returned = time.monotonic()
tapd.barrier_wait()
sys.stderr.write(f"seconds {printed[0] - returned}\\n")
"""


def first_print(backend: str) -> dict[str, Any]:
    """(d), in a new process with its own runtime directory: the first print's delay
    after the compiled call returns, and what is left of a daemon afterwards."""
    runtime = Path(tempfile.mkdtemp(prefix="tapd-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    env = {**os.environ, "TAPD_RUNTIME_DIR": str(runtime), "TAPD_AUTOSTART": "1",
           "TAPD_BACKEND": backend}  # fmt: skip
    env.pop("TAPD_ENDPOINT", None)
    result = subprocess.run([sys.executable, "-c", FIRST_PRINT], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    seconds = [float(line.split()[1]) for line in result.stderr.splitlines()
               if line.startswith("seconds ")]  # fmt: skip
    if result.returncode != 0 or not seconds:
        raise RuntimeError(f"first print ({backend}) failed:\n{result.stderr[-3000:]}")
    left = sorted(path.name for path in runtime.iterdir())
    shutil.rmtree(runtime, ignore_errors=True)
    return {"seconds": max(seconds[0], 0.0), "left": left}


BAR_CLOSE = """
import io, json, sys, time
import jax, jax.numpy as jnp
from jax import lax
from tqdm import tqdm
import tapd

if sys.argv[1] != "jax":
    tapd.install_debug()


class RecordingTqdm(tqdm):
    at_close = None

    def close(self):
        if self.at_close is None:
            self.at_close = self.n
        super().close()


bars = []


def update(_):
    time.sleep(0.005)
    bars[-1].update(1)


def body(i, total):
    jax.debug.callback(update, i)
    return total + i


loop = jax.jit(lambda x: lax.fori_loop(0, 100, body, x))
runs = []
for repeat in range(int(sys.argv[2]) + 1):  # (the first compiles: not counted)
    bars.append(RecordingTqdm(total=100, file=io.StringIO()))
    started = time.perf_counter()
    out = loop(jnp.int32(0))
    called = time.perf_counter()
    bars[-1].close()
    closed = time.perf_counter()
    if repeat:
        runs.append([called - started, closed - started, bars[-1].at_close])
    jax.block_until_ready(out)
    jax.effects_barrier()
print(json.dumps(runs))
"""

# (e)'s variants: (label, the script's mode, the environment it runs in)
BAR_VARIANTS = [
    ("jax.debug", "jax", {}),
    ("tapd, native", "tapd", {"TAPD_BACKEND": "native"}),
    ("tapd, portable", "tapd", {"TAPD_BACKEND": "portable"}),
    ("tapd, gathered", "tapd", {"TAPD_BACKEND": "portable", "TAPD_GATHER": "on"}),
]


def bar_close(quick: bool) -> dict[str, list[list[float]]]:
    """(e), each variant in a new process: [call s, call-to-close s, updates at close] a
    repeat."""
    runs = {}
    for label, mode, settings in BAR_VARIANTS:
        env = {**os.environ, **settings}
        result = subprocess.run(
            [sys.executable, "-c", BAR_CLOSE, mode, "3" if quick else "7"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if result.returncode != 0 and "backend 'native' was asked for" in result.stderr:
            continue  # (a TPU: no native handler there; the gathered row is its path)
        if result.returncode != 0:
            raise RuntimeError(f"bar close ({label}) failed:\n{result.stderr[-3000:]}")
        runs[label] = json.loads(result.stdout.splitlines()[-1])
    return runs


def bar_report(runs: dict[str, list[list[float]]]) -> list[str]:
    from report import median, table

    stock = median([run[0] for run in runs["jax.debug"]])
    rows, verdicts = [], []
    for label, got in runs.items():
        call, closed = median([run[0] for run in got]), median([run[1] for run in got])
        at_close = sorted({int(run[2]) for run in got})
        rows.append([label, "/".join(map(str, at_close)) + "/100", f"{call * 1000:.1f}",
                     f"{closed * 1000:.1f}", f"{call / stock:.3f}"])  # fmt: skip
        if label != "jax.debug":
            met = at_close == [100] and call / stock <= 0.1
            verdicts.append(
                f"- {label}, (e): a bar closed right after the call had {at_close} of 100 "
                f"updates; the call took {call / stock:.3f} of stock's (target 100/100 and "
                f"<= 0.1: {'met' if met else 'NOT met'})"
            )
    header = ["(e) 100 steps, 5 ms updates, bar closed after the call", "updates at close",
              "call, ms", "call to close, ms", "call ÷ stock's"]  # fmt: skip
    return [table(header, rows), "", *verdicts, ""]


HEADER = ["measure", "no callback", "jax.debug.callback", "tapd.debug.callback",
          "id_tap(closure)", "tapd"]  # fmt: skip


def report(
    runs: dict[str, dict[str, list[float]]],
    first: dict[str, Any],
    bars: dict[str, list[list[float]]],
    quick: bool,
) -> str:
    from report import median, number, table

    sections = ["# tapd.debug.callback against jax.debug.callback", ""]
    verdicts = []
    for backend, us in runs.items():
        m = {key: median(values) for key, values in us.items()}

        def added(key: str, name: str, m: dict[str, float] = m) -> float:
            return m[f"{key}|{name}"] - m[f"{key}|none"]

        loop_share = added("loop", "tapd") / added("loop", "jax")
        shares = {
            name: added("drained", name) / added("drained", "jax") for name in ("tapd", "id_tap")
        }
        work_share = added("work", "tapd") / added("work", "jax")
        slow_ratio = m["slow|tapd"] / m["slow|none"]
        input_ratio = m["slow|tapd, input"] / m["slow|none"]
        carried_ratio = m["slow|none, input carried"] / m["slow|none"]
        rows = [
            ["(a) fori_loop, µs/step", number(m["loop|none"], 3), number(m["loop|jax"], 3),
             number(m["loop|tapd"], 3), "", f"added: {loop_share:.4f} of JAX's"],
            ["(b) one call per step, µs/call", number(m["call|none"], 2),
             number(m["call|jax"], 2), number(m["call|tapd"], 2), number(m["call|id_tap"], 2),
             f"{m['call|tapd'] / m['call|none']:.2f} x untapped"],
            ["(b) the same, to barrier_wait (every callback run), µs/call",
             number(m["drained|none"], 2), number(m["drained|jax"], 2),
             number(m["drained|tapd"], 2), number(m["drained|id_tap"], 2),
             f"added: {shares['tapd']:.3f} (id_tap {shares['id_tap']:.3f}) of JAX's"],
            ["(b2) one call per step, 256x256 matmul in it, µs/call", number(m["work|none"], 1),
             number(m["work|jax"], 1), number(m["work|tapd"], 1), "",
             f"added: {work_share:.3f} of JAX's"],
            ["(c) 256x256 matmul + 50 ms callback a step, ms/loop",
             number(m["slow|none"] / 1000, 1),
             number(m["slow|jax(200 x 50 ms)"] / 1000, 0) + " (at least)",
             number(m["slow|tapd"] / 1000, 1), "", f"{slow_ratio:.2f} x untapped"],
            ["(c') as (c), the callback on the step's input, ms/loop", "", "",
             number(m["slow|tapd, input"] / 1000, 1), "", f"{input_ratio:.2f} x untapped"],
            ["(c') control: no callback, the input carried out, ms/loop",
             number(m["slow|none, input carried"] / 1000, 1), "", "", "",
             f"{carried_ratio:.2f} x untapped"],
        ]  # fmt: skip
        sections += [
            f"#### {backend} backend",
            "",
            table(HEADER, rows),
            "",
        ]
        met = {name: "met" if share <= 0.1 else "NOT met" for name, share in shares.items()}
        verdicts += [
            f"- {backend}, (a): tapd's added per-step cost is {loop_share:.4f} of "
            f"jax.debug.callback's (target <= 0.05: {'met' if loop_share <= 0.05 else 'NOT met'})",
            f"- {backend}, (b): added to barrier_wait, tapd.debug.callback {shares['tapd']:.3f} "
            f"and id_tap of a closure {shares['id_tap']:.3f} of jax.debug.callback's (target "
            f"<= 0.1: {met['tapd']}, {met['id_tap']})",
            f"- {backend}, (b2): added {work_share:.3f} of JAX's (target <= 0.1: "
            f"{'met' if work_share <= 0.1 else 'NOT met'})",
            f"- {backend}, (c): with a 50 ms callback the loop takes {slow_ratio:.2f}x the loop "
            f"without (target <= 1.1: {'met' if slow_ratio <= 1.1 else 'NOT met'})",
        ]
    for backend, got in first.items():
        fast = got["seconds"] <= 0.3 and not got["left"]
        verdicts.append(
            f"- {backend}, (d): the first jax.debug.print under install_debug() printed "
            f"{got['seconds']:.3f} s after the compiled call returned; left in the runtime "
            f"directory afterwards: {got['left'] or 'nothing (no daemon)'} (target <= 0.3 s "
            f"and no daemon: {'met' if fast else 'NOT met'})"
        )
    return "\n".join(
        [
            *sections,
            *verdicts,
            "",
            *bar_report(bars),
            f"(b) and (b2): medians of {10 if quick else BLOCKS} blocks of "
            f"{62 if quick else 250} and {25 if quick else 100} calls, each variant's in turn, "
            f"each after {WARM_UP} untimed calls of its own; the others: medians "
            f"of {3 if quick else 7} repeats. Each backend in a process of its own. "
            "(c)'s JAX figure is not run: each of its steps waits for its callback, so it "
            "takes at least steps x 50 ms. `added`: over the untapped step, as a share of "
            "what a no-op jax.debug.callback adds.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "DEBUG.md")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bars", action="store_true", help="(e) alone, printed")
    args = parser.parse_args()
    sys.path.insert(0, str(BENCH_DIR))
    os.environ.setdefault("TAPD_AUTOSTART", "0")
    if args.child:  # one backend's measurements (TAPD_BACKEND), as JSON
        print(json.dumps(measure(args.quick)))
        return
    if args.bars:
        print("\n".join(bar_report(bar_close(args.quick))))
        return
    from processes import run_backend_child

    quick = ["--quick"] if args.quick else []
    backends = ("native", "portable")
    runs = {backend: run_backend_child(__file__, backend, quick) for backend in backends}
    first = {backend: first_print(backend) for backend in backends}
    bars = bar_close(args.quick)
    text = report(runs, first, bars, args.quick)
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
