"""Where a long gathered loop's added time goes on a TPU (issue 51): the 1.4 ms loop of
bench/tpu_live.py (two 4096² matmuls a step), 500 steps, tapping its step index, against
the same loop carrying, in plain JAX, what the gathered rewrite carries.

    python bench/tpu_loop_cost_probe.py   # on the TPU; prints seconds a call, medians

- `none`: the loop alone;
- `tap`: `id_tap` of the step index to a no-op in this process (gathered, paced);
- `unpaced`: the same, `gather_latency` 0 (one chunk: flushed at the end);
- `log`: plain JAX, the loop also carrying an int32[1024] log and its length, writing
  one entry a step (what a gathered tap's record is, without tapd);
- `log+row`: the same and the tapped value into an int32[1024] buffer.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
from tapd.emitter import lifecycle

N, STEPS = int(__import__("os").environ.get("PROBE_N", "4096")), 500


def arrived(*_: object) -> None:
    pass


def program(kind: str):  # type: ignore[no-untyped-def]
    def matmuls(c):  # type: ignore[no-untyped-def]
        for _ in range(2):
            c = (c @ c) * (1.0 / N)
        return c

    if kind in ("none", "tap", "unpaced"):

        def body(i, c):  # type: ignore[no-untyped-def]
            c = matmuls(c)
            return c if kind == "none" else tapd.id_tap(arrived, i, result=c)

        return jax.jit(lambda c: lax.fori_loop(0, STEPS, body, c))

    def carrying(i, carry):  # type: ignore[no-untyped-def]
        c, log, count, rows = carry
        c = matmuls(c)
        log = lax.dynamic_update_index_in_dim(log, np.int32(0), count, 0)
        if kind == "log+row":
            rows = lax.dynamic_update_index_in_dim(rows, i, count, 0)
        return c, log, (count + 1) % 1024, rows

    def run(c):  # type: ignore[no-untyped-def]
        zeros = jnp.zeros(1024, jnp.int32)
        out = lax.fori_loop(0, STEPS, carrying, (c, zeros, np.int32(0), zeros))
        return out[0], out[1].sum() + out[3].sum()

    return jax.jit(run)


def main() -> None:
    c = jnp.full((N, N), 1.0, jnp.float32)
    settings = lifecycle.settings()
    functions = {}
    for kind in ("none", "tap", "unpaced", "log", "log+row"):
        if kind == "unpaced":
            lifecycle._settings = dataclasses.replace(settings, gather_latency=0.0)
        functions[kind] = program(kind).lower(c).compile()
        lifecycle._settings = settings
    times: dict[str, list[float]] = {kind: [] for kind in functions}
    for _ in range(3):
        for kind, function in functions.items():
            jax.block_until_ready(function(c))
            tapd.barrier_wait()
            start = time.perf_counter()
            jax.block_until_ready(function(c))
            times[kind].append(time.perf_counter() - start)
            tapd.barrier_wait()
    base = statistics.median(times["none"])
    for kind, values in times.items():
        seconds = statistics.median(values)
        added = 1e6 * (seconds - base) / STEPS
        print(f"{kind:8s} {seconds:.4f} s a call, added {added:.1f} µs a step")


if __name__ == "__main__":
    main()
