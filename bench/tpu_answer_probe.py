"""What one answer of a paced gathered loop costs on a TPU, and why (issue 51).

bench/tpu_loop_cost_probe.py found a paced loop's answers cost ~6.6 ms each on the TPU
v5e where a bare host callback with a result costs ~0.7 ms. This probe runs the same
500-step loop (two 4096² matmuls a step, ~1.4 ms) and times, in one process:

- `none`: the loop alone;
- `tap`: `id_tap` of the step index to a no-op in this process (gathered, paced), with
  the answers counted and the host's time inside them;
- `tap-switch`: the same under `sys.setswitchinterval(1e-4)` (Python's GIL hand-over
  every 0.1 ms instead of 5 ms): if an answer waits for the GIL, this shortens it;
- `callback-64`: plain JAX, `io_callback` with an int32[2] result every 64 steps in a
  `cond` (what a paced loop's answer is, without tapd): the TPU's own cost of one;
- `callback-64-thread`: the same while another Python thread of the process spins
  (holds the GIL): what a busy thread does to an answer;
- `dep`: plain JAX, chunks of 64 steps each begun by an `io_callback` whose result
  bounds the chunk (the device waits for it, as for a paced loop's answer);
- `dep-late`: the same, each answer bounding the chunk after the next one (the device
  need not wait for it);
- `chunks-dynamic`, `chunks-static`: plain JAX, no callback: the loop as chunks of 64
  steps, each an inner `while` with a bound in the carry, or a `fori_loop` of 64
  (its time scaled to 500 steps);
- `flat`: plain JAX, one `while` of 500 steps, a `switch` at each step's start: an
  answer (its result the chunk's end) where a chunk of 64 ends, else nothing;
- `ordered`: plain JAX, an ordered `io_callback` (no result) every 64 steps;
- `every100`, `every100-unpaced`: bench/tpu_live.py's `every=100` cell (1 MiB a step,
  1000 steps), paced and not, against `every100-none`, the loop untapped.

    python bench/tpu_answer_probe.py   # prints seconds a call, medians of 3
    PROBE_ALL=1 python bench/tpu_answer_probe.py   # also tap-switch, callback-64-thread, ordered
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

import tapd
from tapd.emitter import lifecycle
from tapd.emitter.gathered import host

N = int(__import__("os").environ.get("PROBE_N", "4096"))
STEPS, EVERY = 500, 64
answer_times: list[float] = []


def arrived(*_: object) -> None:
    pass


def matmuls(c):  # type: ignore[no-untyped-def]
    for _ in range(2):
        c = (c @ c) * (1.0 / N)
    return c


def program(kind: str):  # type: ignore[no-untyped-def]
    if kind.startswith("callback"):

        def answer(i):  # type: ignore[no-untyped-def]
            return np.array([i, 1], np.int32)

        def body(i, carry):  # type: ignore[no-untyped-def]
            c, got = carry
            c = matmuls(c)
            got = lax.cond(
                i % EVERY == EVERY - 1,
                lambda: io_callback(answer, jax.ShapeDtypeStruct((2,), jnp.int32), i)[1],
                lambda: got,
            )
            return c, got

        return jax.jit(lambda c: lax.fori_loop(0, STEPS, body, (c, np.int32(0))))

    if kind == "dep":  # chunks whose steps the last answer gives (what tapd's pace does)

        def steps_next(done):  # type: ignore[no-untyped-def]
            return np.int32(EVERY)

        def chunk(carry):  # type: ignore[no-untyped-def]
            done, c = carry
            end = lax.min(
                done + io_callback(steps_next, jax.ShapeDtypeStruct((), jnp.int32), done), STEPS
            )
            return lax.while_loop(
                lambda inner: inner[0] < end,
                lambda inner: (inner[0] + 1, matmuls(inner[1])),
                (done, c),
            )

        return jax.jit(lambda c: lax.while_loop(lambda carry: carry[0] < STEPS, chunk, (0, c))[1])
    if kind == "dep-late":  # the same, each answer bounding the chunk after next

        def steps_later(done):  # type: ignore[no-untyped-def]
            return np.int32(EVERY)

        def late_chunk(carry):  # type: ignore[no-untyped-def]
            done, bound, c = carry
            answer = io_callback(steps_later, jax.ShapeDtypeStruct((), jnp.int32), done)
            end = lax.min(done + bound, STEPS)
            done, c = lax.while_loop(
                lambda inner: inner[0] < end,
                lambda inner: (inner[0] + 1, matmuls(inner[1])),
                (done, c),
            )
            return done, answer, c

        return jax.jit(
            lambda c: lax.while_loop(
                lambda carry: carry[0] < STEPS, late_chunk, (0, np.int32(EVERY), c)
            )[2]
        )
    if kind in ("chunks-dynamic", "chunks-static"):  # chunks of 64 steps, no callback

        def block(carry):  # type: ignore[no-untyped-def]
            done, c = carry
            if kind == "chunks-static":
                c = lax.fori_loop(0, EVERY, lambda _, c: matmuls(c), c)
                return done + EVERY, c
            end = done + EVERY
            return lax.while_loop(
                lambda inner: inner[0] < end,
                lambda inner: (inner[0] + 1, matmuls(inner[1])),
                (done, c),
            )

        blocks = EVERY * (STEPS // EVERY)  # (whole blocks: 448 of the 500 steps)
        return jax.jit(lambda c: lax.while_loop(lambda carry: carry[0] < blocks, block, (0, c))[1])
    if kind == "flat":  # one loop, a switch a step: an answer where the chunk ends

        def steps_next(i):  # type: ignore[no-untyped-def]
            return np.int32(EVERY)

        def flat_body(carry):  # type: ignore[no-untyped-def]
            i, end, c = carry
            index = jnp.where(i == end, 2, jnp.where(i % 7 == 3, 1, 0))

            def answer(end):  # type: ignore[no-untyped-def]
                return i + io_callback(steps_next, jax.ShapeDtypeStruct((), jnp.int32), i)

            end = lax.switch(index, [lambda end: end, lambda end: end + 0, answer], end)
            return i + 1, end, matmuls(c)

        return jax.jit(
            lambda c: lax.while_loop(
                lambda carry: carry[0] < STEPS, flat_body, (0, np.int32(EVERY), c)
            )[2]
        )
    if kind == "ordered":

        def noted(i):  # type: ignore[no-untyped-def]
            return None

        def body(i, c):  # type: ignore[no-untyped-def]
            c = matmuls(c)
            lax.cond(
                i % EVERY == EVERY - 1,
                lambda: io_callback(noted, None, i, ordered=True),
                lambda: None,
            )
            return c

        return jax.jit(lambda c: lax.fori_loop(0, STEPS, body, c))

    def body(i, c):  # type: ignore[no-untyped-def]
        c = matmuls(c)
        return c if kind == "none" else tapd.id_tap(arrived, i, result=c)

    return jax.jit(lambda c: lax.fori_loop(0, STEPS, body, c))


def sampled(steps: int):  # type: ignore[no-untyped-def]
    """bench/tpu_live.py's `every=100` cell: 1 MiB a step, one in 100 kept."""

    def body(i, x):  # type: ignore[no-untyped-def]
        return tapd.tap(x * 0.999 + 0.001, "sampled", every=100)

    return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))


def timed_answers() -> None:
    """Flush.answered and Flush.poll, timed (the host's share of an answer)."""
    for name in ("answered", "poll"):
        original = getattr(host.Flush, name)

        def wrapped(self, *args, _original=original):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return _original(self, *args)
            finally:
                answer_times.append(time.perf_counter() - start)

        setattr(host.Flush, name, wrapped)


def spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def main() -> None:
    timed_answers()
    c = jnp.full((N, N), 1.0, jnp.float32)
    kinds = ("none", "tap", "callback-64", "dep", "chunks-dynamic", "chunks-static", "flat")
    if os.environ.get("PROBE_ALL"):
        kinds += ("dep-late",)
    if os.environ.get("PROBE_ALL"):
        kinds += ("tap-switch", "callback-64-thread", "ordered")
    functions = {k: program(k.split("-")[0] if k.startswith("tap") else k) for k in kinds}
    if "callback-64-thread" in functions:
        functions["callback-64-thread"] = functions["callback-64"]
    kinds += ("every100", "every100-unpaced", "every100-none")
    x = jnp.zeros(2**18, jnp.float32)
    settings = lifecycle.settings()
    functions["every100"] = sampled(1000).lower(x).compile()
    lifecycle._settings = dataclasses.replace(settings, gather_latency=0.0)
    functions["every100-unpaced"] = sampled(1000).lower(x).compile()
    lifecycle._settings = settings
    functions["every100-none"] = jax.jit(
        lambda x: lax.fori_loop(0, 1000, lambda i, x: x * 0.999 + 0.001, x)
    )
    times: dict[str, list[float]] = {k: [] for k in kinds}
    answers: dict[str, list[int]] = {k: [] for k in kinds}
    host_ms: dict[str, list[float]] = {k: [] for k in kinds}
    default = sys.getswitchinterval()
    for _ in range(3):
        for kind in kinds:
            function = functions[kind]
            arg = x if kind.startswith("every100") else c
            jax.block_until_ready(function(arg))
            tapd.barrier_wait()
            stop = threading.Event()
            spinner = threading.Thread(target=spin, args=(stop,), daemon=True)
            if kind == "callback-64-thread":
                spinner.start()
            sys.setswitchinterval(1e-4 if kind == "tap-switch" else default)
            answer_times.clear()
            start = time.perf_counter()
            jax.block_until_ready(function(arg))
            times[kind].append(time.perf_counter() - start)
            sys.setswitchinterval(default)
            stop.set()
            answers[kind].append(len(answer_times))
            host_ms[kind].append(1e3 * sum(answer_times))
            tapd.barrier_wait()
    for kind in kinds:
        base = statistics.median(times["every100-none" if kind.startswith("every") else "none"])
        seconds = statistics.median(times[kind])
        if kind.startswith("chunks"):  # (448 steps: compared a step)
            seconds *= STEPS / (EVERY * (STEPS // EVERY))
        count = statistics.median(answers[kind]) if answers[kind] else 0
        print(
            f"{kind:20s} {seconds:.4f} s a call, added {1e3 * (seconds - base):7.1f} ms"
            f" ({1e6 * (seconds - base) / STEPS:6.1f} µs a step); tapd answers a call"
            f" {count}, host time in them {statistics.median(host_ms[kind]):.2f} ms"
        )
    print(f"(callback-64: {STEPS // EVERY} answers a call)")


if __name__ == "__main__":
    main()
