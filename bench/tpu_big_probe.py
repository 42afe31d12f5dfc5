"""Where a big tap's cost goes on a TPU when nothing (or little) of it moves (issue 51).

Plain JAX, no tapd: a `fori_loop` of `x * 0.999 + 0.001` over a 1 MiB float32 row, with
what a gathered computation adds to it, one piece at a time. µs a call, medians of 3
rounds of 5 calls back to back (the last call blocked on):

- `none`: the loop alone;
- `write`: each step writes `x` into row `i % 8` of a carried f32[8, 256K] buffer (what a
  gathered tap does, kept or not), the buffer an output not fetched;
- `write-cond0`, `write-cond1`: the same write inside a `lax.cond` on a flag passed in
  (0: a dormant tap, which writes nothing; 1: a woken one);
- `pack`: `write`, then the buffer as bytes (bitcast to uint8, with a 4-byte head
  concatenated: gathered.host.pack), the bytes an output not fetched;
- `pack-u32`: the same packed as uint32 words (no change of element width);
- `pack-cond0`: `write-cond0`, the packing itself in a `cond` on the flag (zeros else);
- `fetch-f32`, `fetch-u8`, `fetch-u32`: `write` with its buffer (as f32, as packed
  uint8, as packed uint32) fetched with `np.asarray` each call;
- `KIND@tiles`: KIND with the buffer shaped f32[8, 2048, 128] (a row whole (8, 128) tiles
  of the TPU's layout, not one row of each of 2048 tiles).

Only some kinds: `PROBE_KINDS=write,write@tiles`.

    python bench/tpu_big_probe.py          # steps 8 and 1000
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROW = 2**18  # float32 elements: 1 MiB
ROWS = 8


def variant(kind: str, steps: int) -> Callable[..., Any]:
    kind, _, shaped = kind.partition("@")
    shape = (ROWS, ROW // 128, 128) if shaped == "tiles" else (ROWS, ROW)
    cond = "cond" in kind
    width = np.uint32 if kind.endswith("u32") else np.uint8

    def body(i: Any, carry: Any) -> Any:
        x, buffer, flag = carry
        x = x * 0.999 + 0.001
        if kind == "none":
            return x, buffer, flag

        def write(b: Any) -> Any:
            return lax.dynamic_update_index_in_dim(b, x.reshape(shape[1:]), i % ROWS, 0)

        buffer = lax.cond(flag > 0, write, lambda b: b, buffer) if cond else write(buffer)
        return x, buffer, flag

    def packed(buffer: Any) -> Any:
        head = jnp.zeros((1,), np.int32)
        if width == np.uint8:
            parts = [lax.bitcast_convert_type(p, np.uint8).reshape(-1) for p in (head, buffer)]
        else:
            parts = [lax.bitcast_convert_type(p, np.uint32).reshape(-1) for p in (head, buffer)]
        return lax.concatenate(parts, 0)

    def run(x: Any, flag: Any) -> Any:
        buffer = jnp.zeros(shape, np.float32)
        x, buffer, flag = lax.fori_loop(0, steps, body, (x, buffer, flag))
        if kind in ("none", "write", "write-cond0", "write-cond1", "fetch-f32"):
            return x, buffer
        if kind == "pack-cond0":
            size = packed(buffer).shape
            return x, lax.cond(flag > 0, packed, lambda b: jnp.zeros(size, np.uint8), buffer)
        return x, packed(buffer)

    jitted = jax.jit(run)
    fetch = kind.startswith("fetch")
    flag = jnp.int32(1 if kind.endswith("cond1") else 0)

    def call(x: Any) -> Any:
        out = jitted(x, flag)
        if fetch:
            np.asarray(out[1])
        return out

    return call


KINDS = (
    "none",
    "write",
    "write-cond0",
    "write-cond1",
    "pack",
    "pack-u32",
    "pack-cond0",
    "fetch-f32",
    "fetch-u8",
    "fetch-u32",
)


def medians_us(
    calls: dict[str, Callable[[Any], Any]], x: Any, per_round: int, rounds: int = 3
) -> dict[str, float]:
    """µs a call of each of `calls` on `x`: each run once first (compiled), then in
    `rounds` interleaved rounds of `per_round` calls back to back, the last blocked on;
    the median of the rounds."""
    for call in calls.values():
        jax.block_until_ready(call(x))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(per_round):
                out = call(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / per_round * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    step_counts = [int(s) for s in os.environ.get("PROBE_STEPS", "8,1000").split(",")]
    x = jnp.zeros(ROW, jnp.float32)
    chosen = os.environ.get("PROBE_KINDS")
    kinds = chosen.split(",") if chosen else KINDS
    calls: dict[str, Callable[..., Any]] = {}
    for steps in step_counts:
        for kind in kinds:
            calls[f"{steps} {kind}"] = variant(kind, steps)
    medians = medians_us(calls, x, per_round=5)
    print(f"device {jax.devices()[0]}, JAX {jax.__version__}")
    for steps in step_counts:
        base = medians.get(f"{steps} none", 0.0)
        for kind in kinds:
            us = medians[f"{steps} {kind}"]
            print(f"steps {steps:5d} {kind:12s} {us:10.1f} µs a call  added {us - base:10.1f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
