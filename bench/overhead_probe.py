"""Per-tap cost on one emitter backend, measured in its own process (the backend is
chosen once per process). Prints one JSON object; bench/run.py runs it per backend.

For each payload size: a jitted `fori_loop` of N steps whose body updates a float32
vector of that size, untapped, tapped with `tapd.tap`, and with a no-op
`jax.debug.callback`, interleaved and repeated; the added µs per step is the tap's
cost. Beside it, the cost of copying the same bytes with numpy, hot (same source and
destination every time) and rotating through a 256 MB destination, as the ring does.
Also the isolation check: a step doing real work (a few 128x128 matmuls), untapped vs
tapped while a subscriber sleeps 10 ms per tap and the ring has room.

The per-tap cost is that of a tap that is copied: no subscriber takes these taps, so
this process runs with TAPD_DORMANT=0 (bench/dormant.py measures dormant taps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
from tapd.emitter import tapping

RING_BYTES = 256 * 10**6


def loop(size: int, steps: int, mode: str, consumer: str) -> Callable[[jax.Array], jax.Array]:
    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        x = x * 0.999 + 0.001
        if mode in ("tap", "tap_unordered"):
            tapping.ordered_taps = mode == "tap"  # read while jit traces the body
            tapd.tap(x, consumer)
            tapping.ordered_taps = True
        elif mode == "callback":
            jax.debug.callback(lambda v: None, x)
        return x

    return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))


def timed(function: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    started = time.perf_counter()
    function(x).block_until_ready()
    jax.effects_barrier()
    return time.perf_counter() - started


def memcpy_us(size_bytes: int, count: int) -> tuple[float, float]:
    """(hot, rotating) µs to copy `size_bytes` with numpy."""
    source = np.ones(size_bytes // 4, np.float32)
    hot = np.empty_like(source)
    started = time.perf_counter()
    for _ in range(count):
        np.copyto(hot, source)
    hot_us = (time.perf_counter() - started) / count * 1e6
    ring = np.ones(RING_BYTES // 4, np.float32)  # written once: no page faults below
    position = 0
    started = time.perf_counter()
    for _ in range(count):
        if position + source.size > ring.size:
            position = 0
        ring[position : position + source.size] = source
        position += source.size
    return hot_us, (time.perf_counter() - started) / count * 1e6


def per_tap_cost(sizes: list[int], steps: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for size_bytes in sizes:
        x = jnp.zeros(size_bytes // 4, jnp.float32)
        modes = {m: loop(x.size, steps, m, f"overhead.{size_bytes}")
                 for m in ("none", "tap", "tap_unordered", "callback")}  # fmt: skip
        for function in modes.values():
            timed(function, x)  # compile and warm up
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for mode, function in modes.items():  # interleaved: shared noise
                samples[mode].append(timed(function, x) / steps * 1e6)
        tapd.barrier_wait(timeout=600)
        median = {m: statistics.median(v) for m, v in samples.items()}
        hot, rotating = memcpy_us(size_bytes, max(50, min(steps, 2000)))
        rows.append({
            "bytes": size_bytes, "untapped_us": median["none"],
            "tap_added_us": median["tap"] - median["none"],
            "unordered_tap_added_us": median["tap_unordered"] - median["none"],
            "callback_added_us": median["callback"] - median["none"],
            "memcpy_hot_us": hot, "memcpy_rotating_us": rotating,
        })  # fmt: skip
    return rows


def isolation(steps: int, repeats: int) -> dict[str, Any]:
    """A ~400 µs step: untapped, tapped into a subscriber that sleeps 10 ms per tap, and
    with a no-op `jax.debug.callback` of the same value in the tap's place."""
    weights = jnp.full((128, 128), 0.01, jnp.float32)

    def make(mode: str) -> Callable[[jax.Array], jax.Array]:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            for _ in range(8):
                x = jnp.tanh(x @ weights)
            if mode == "tap":
                tapd.tap(x[0, :4], "overhead.isolation")
            elif mode == "callback":
                jax.debug.callback(lambda v: None, x[0, :4])
            return x

        return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    x = jnp.ones((128, 128), jnp.float32)
    variants = {mode: make(mode) for mode in ("none", "tap", "callback")}
    for function in variants.values():
        timed(function, x)
    tapd.barrier_wait(timeout=600)
    samples: dict[str, list[float]] = {mode: [] for mode in variants}
    vs_untapped, vs_callback = [], []
    for _ in range(repeats):
        seconds = {mode: timed(function, x) for mode, function in variants.items()}
        for mode, value in seconds.items():
            samples[mode].append(value / steps * 1e6)
        vs_untapped.append(seconds["tap"] / seconds["none"])
        vs_callback.append(seconds["tap"] / seconds["callback"])
    started = time.perf_counter()
    tapd.barrier_wait(timeout=600)
    return {
        "steps": steps, "untapped_us": statistics.median(samples["none"]),
        "tapped_us": statistics.median(samples["tap"]),
        "callback_us": statistics.median(samples["callback"]),
        "ratio": statistics.median(vs_untapped), "vs_callback": statistics.median(vs_callback),
        "barrier_s": time.perf_counter() - started,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--backend", required=True, choices=["native", "portable"])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--isolation-steps", type=int, default=100)
    args = parser.parse_args()
    os.environ["TAPD_DORMANT"] = "0"  # (read when the emitter starts, at its first tap)
    tapd.configure(endpoint=args.endpoint, backend=args.backend, policy="block")
    result = {
        "backend": args.backend,
        "per_tap": per_tap_cost([64, 64 * 1024, 1024 * 1024], args.steps, args.repeats),
        "isolation": isolation(args.isolation_steps, args.repeats),
        "stats": tapd.stats(),
    }
    assert tapd.backend() == args.backend
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
