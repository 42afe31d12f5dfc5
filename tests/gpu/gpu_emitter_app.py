"""A JAX emitter on a GPU for tests/gpu: `python gpu_emitter_app.py SCENARIO [ARGS]`
taps into the daemon at $TAPD_ENDPOINT and prints one JSON line of results last."""

from __future__ import annotations

import dataclasses
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


# The checksum scenario: each step taps four sites of odd sizes (records of 56 + 8 to
# 16,392 bytes, so they often cross the ring's end), uint32 values k * (i + 1) for
# k < n: the subscriber checks every record's sum against that.
CHECKSUM_SIZES = (1, 65, 1025, 4097)  # uint32s per site


def checksums(steps: str) -> dict[str, Any]:
    count = int(steps)
    ramps = [jnp.arange(n, dtype=jnp.uint32) for n in CHECKSUM_SIZES]

    def body(i: jax.Array, carry: jax.Array) -> jax.Array:
        scale = (i + 1).astype(jnp.uint32)
        for n, ramp in zip(CHECKSUM_SIZES, ramps, strict=True):
            tapd.tap(ramp * scale, f"gpu.checksum.{n}", step=i)
        return carry + 1

    started = time.perf_counter()
    total = jax.jit(lambda: lax.fori_loop(0, count, body, jnp.int32(0)))()
    total.block_until_ready()
    loop_s = time.perf_counter() - started
    tapd.barrier_wait(timeout=300)
    return {**environment(), "loop_s": loop_s, "stats": tapd.stats(),
            "commit": library.cuda_commit(0)}  # fmt: skip


def interleaved(steps: str) -> dict[str, Any]:
    """The benchmark setup the first GPU run hung in (bench/gpu_bench.py cost): 1 MiB
    taps with no subscriber, the native tap, portable tap and callback loops
    interleaved, a barrier after each tapped run, into this process's ring (its size
    from TAPD_BUFFER_BYTES). Any platform."""
    count = int(steps)
    settings = tapd.configure()  # (from TAPD_*)

    def loop(mode: str) -> Any:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            x = x * 0.999 + 0.001
            if mode == "callback":
                jax.debug.callback(lambda v: None, x)
            elif mode != "none":
                tapd.tap(x, "gpu.interleaved")
            return x

        return jax.jit(lambda x: lax.fori_loop(0, count, body, x))

    x = jnp.zeros(2**18, jnp.float32)  # 1 MiB
    loops = {}
    for mode in ("none", "tap", "portable", "callback"):
        # A loop keeps the backend it was lowered (first run) with: as bench/gpu_bench.py.
        backend = "portable" if mode == "portable" else settings.backend
        lifecycle._settings = dataclasses.replace(settings, backend=backend)
        loops[mode] = loop(mode)
        loops[mode](x).block_until_ready()
    lifecycle._settings = settings
    started = time.perf_counter()
    for _ in range(3):
        for mode, function in loops.items():
            function(x).block_until_ready()
            jax.effects_barrier()
            if mode in ("tap", "portable"):
                tapd.barrier_wait(timeout=60)
    return {**environment(), "seconds": time.perf_counter() - started, "stats": tapd.stats()}


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
