"""A JAX emitter on a GPU for tests/gpu: `python gpu_emitter_app.py SCENARIO [ARGS]`
taps into the daemon at $TAPD_ENDPOINT and prints one JSON line of results last."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import tapd
from tapd.emitter import lifecycle
from tapd.native import library

SMALL = 257  # float32s: not a multiple of 8 bytes, so padding shows
BIG = 1024 * 1024 // 2 + 3  # float16s: a little over 1 MiB, so records cross the ring's end


def environment() -> dict[str, Any]:
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "local_hardware_id": getattr(device, "local_hardware_id", None),
        "backend": tapd.backend(),
        "handler_platforms": sorted(lifecycle.handler_platforms()),
        "cuda_handler": library.has_handler("cuda"),
        "cuda_reason": library.handler_reason("cuda"),
    }


def values(steps: str) -> dict[str, Any]:
    """Each step taps {"small": arange(257) + i (float32), "big": full(BIG, i) (float16),
    "count": i (int32)} with step=i; an int64 step cannot exist without x64, so the
    int32 step is the one copied into the record header by the device."""
    count = int(steps)

    def body(i: jax.Array, carry: jax.Array) -> jax.Array:
        small = jnp.arange(SMALL, dtype=jnp.float32) + i.astype(jnp.float32)
        big = jnp.full((BIG,), i, jnp.float16)
        tapd.tap({"small": small, "big": big, "count": i}, "gpu.values", step=i)
        return carry + small[0]

    started = time.perf_counter()
    total = jax.jit(lambda: lax.fori_loop(0, count, body, jnp.float32(0)))()
    total.block_until_ready()
    loop_s = time.perf_counter() - started
    tapd.barrier_wait(timeout=300)
    return {**environment(), "loop_s": loop_s, "total": float(total), "stats": tapd.stats()}


def isolation(steps: str) -> dict[str, Any]:
    """Step time of a GPU loop (eight 512x512 matmuls a step): untapped, and tapped
    into a handler that sleeps (the test starts it with --sleep-ms)."""
    count = int(steps)
    weights = jnp.full((512, 512), 0.001, jnp.float32)

    def make(tap: bool) -> Any:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            for _ in range(8):
                x = jnp.tanh(x @ weights)
            if tap:
                tapd.tap(x[0, :4], "gpu.slow", step=i)
            return x

        return jax.jit(lambda x: lax.fori_loop(0, count, body, x))

    x = jnp.ones((512, 512), jnp.float32)
    untapped, tapped = make(False), make(True)
    untapped(x).block_until_ready()
    tapped(x).block_until_ready()
    tapd.barrier_wait(timeout=300)  # compiled, warm, drained
    timings: dict[str, list[float]] = {"untapped": [], "tapped": []}
    for _ in range(3):
        for name, function in (("untapped", untapped), ("tapped", tapped)):
            started = time.perf_counter()
            function(x).block_until_ready()
            jax.effects_barrier()
            timings[name].append(time.perf_counter() - started)
    started = time.perf_counter()
    tapd.barrier_wait(timeout=300)
    return {**environment(), "untapped_s": min(timings["untapped"]),
            "tapped_s": min(timings["tapped"]), "barrier_s": time.perf_counter() - started,
            "stats": tapd.stats()}  # fmt: skip


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
