"""A JAX process for tests/test_live.py: gathered loops (TAPD_GATHER=on, portable) whose
taps are timed as they reach their tap function in this process.

    python tests/apps/live_app.py timed KIND STEPS     # KIND: while (a host sleep a step)
                                                       # or scan (a matmul a step)
    python tests/apps/live_app.py thresholds           # loops at the log's edges

Prints one JSON line: for `timed`, each call's start, end and arrival times (seconds,
one clock) and the values that arrived; for `thresholds`, per case the values that
arrived and the eager reference.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

import tapd

arrivals: list[tuple[float, int]] = []


def arrived(value: Any, transforms: Any) -> None:
    arrivals.append((time.perf_counter(), int(np.asarray(value).reshape(-1)[0])))


def sleep(seconds: Any) -> Any:
    time.sleep(float(seconds))
    return np.float32(0)


def timed(kind: str, steps: int) -> dict[str, Any]:
    if kind == "while":

        def body(carry: Any) -> Any:
            i, x = carry
            x = x + io_callback(sleep, jax.ShapeDtypeStruct((), np.float32), 0.02)
            return i + 1, tapd.id_tap(arrived, i, result=x)

        program = jax.jit(lambda x: lax.while_loop(lambda c: c[0] < steps, body, (0, x))[1])
        operand = jnp.float32(0)
    else:

        def scan_body(c: Any, i: Any) -> Any:
            c = jnp.tanh(c @ c) * 0.5
            return tapd.id_tap(arrived, i, result=c), None

        program = jax.jit(lambda x: lax.scan(scan_body, x, jnp.arange(steps))[0])
        operand = jnp.full((1000, 1000), 0.001, jnp.float32)
    program = program.lower(operand).compile()
    calls = []
    for _ in range(2):  # the second starts at the pace the first taught the host
        arrivals.clear()
        start = time.perf_counter()
        jax.block_until_ready(program(operand))
        end = time.perf_counter()
        tapd.barrier_wait()
        calls.append(
            {
                "start": start,
                "end": end,
                "times": [t for t, _ in arrivals],
                "values": [v for _, v in arrivals],
            }
        )
    return {"calls": calls, "host_callbacks": tapd.stats()["host_callbacks"]}


def thresholds() -> dict[str, Any]:
    """Loops whose taps fill the log (TAPD_GATHER_TAPS) exactly, by one less or more,
    twice over, and by a tap of two sites a step: every value arrives once, in order.
    With LIVE_THRESHOLD_ROW, each tap is a vector of that many int32 copies of its
    value (for logs bound by TAPD_GATHER_BYTES)."""
    got: list[list[int]] = []
    row = int(os.environ.get("LIVE_THRESHOLD_ROW", "0"))

    def note(value: Any, transforms: Any) -> None:
        array = np.asarray(value).reshape(-1)
        first = int(array[0])
        got[-1].append(first if (array == first).all() else -1)  # (-1: a mixed vector)

    def tapped(value: Any) -> Any:
        return value if not row else jnp.full((row,), value, jnp.int32)

    def scan_program(length: int, per_step: int) -> Any:
        def body(c: Any, k: Any) -> Any:
            for j in range(per_step):
                c = tapd.id_tap(note, tapped(k * per_step + j), result=c)
            return c, None

        return jax.jit(lambda: lax.scan(body, 0, jnp.arange(length))[0])

    def while_program(length: int, per_step: int) -> Any:
        def body(carry: Any) -> Any:
            k, c = carry
            for j in range(per_step):
                c = tapd.id_tap(note, tapped(k * per_step + j), result=c)
            return k + 1, c

        return jax.jit(lambda: lax.while_loop(lambda c: c[0] < length, body, (0, 0))[1])

    results = {}
    for kind, make in (("scan", scan_program), ("while", while_program)):
        for length in (7, 8, 9, 15, 16, 17, 33):
            for per_step in (1, 3):
                program = make(length, per_step)
                got.append([])
                for _ in range(2):
                    jax.block_until_ready(program())
                tapd.barrier_wait()
                results[f"{kind} {length}x{per_step}"] = {
                    "got": got[-1],
                    "expected": list(range(length * per_step)) * 2,
                }
    return {"cases": results}


def main() -> None:
    if "LIVE_LATER_BYTES" in os.environ:  # (how many flushed bytes may wait for the thread)
        from tapd.emitter import taps_as_outputs

        taps_as_outputs.LATER_BYTES = int(os.environ["LIVE_LATER_BYTES"])
    mode = sys.argv[1]
    result = timed(sys.argv[2], int(sys.argv[3])) if mode == "timed" else thresholds()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
