"""What a live gathered loop would pay on a TPU (issue 51), measured with JAX alone:
a host callback that never runs (in a branch never taken), with and without a result,
and one that runs each step, with and without a result (a round trip).

    python bench/tpu_live_probe.py   # on the TPU; prints µs a call, medians
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

STEPS = 400


def noop(*_):
    return None


def answer(*_):
    return np.int32(7)


def loop(kind: str):
    def body(i, c):
        c = c * 0.999 + 0.001
        if kind == "never":
            lax.cond(i < 0, lambda: jax.debug.callback(noop, c), lambda: None)
        elif kind == "never_result":
            r = lax.cond(
                i < 0,
                lambda: io_callback(answer, jax.ShapeDtypeStruct((), jnp.int32), c),
                lambda: jnp.int32(0),
            )
            c = c + r.astype(c.dtype) * 0
        elif kind == "each":
            jax.debug.callback(noop, c)
        elif kind == "each_result":
            r = io_callback(answer, jax.ShapeDtypeStruct((), jnp.int32), c)
            c = c + r.astype(c.dtype) * 0
        elif kind == "every100_result":
            r = lax.cond(
                i % 100 == 99,
                lambda: io_callback(answer, jax.ShapeDtypeStruct((), jnp.int32), c),
                lambda: jnp.int32(0),
            )
            c = c + r.astype(c.dtype) * 0
        elif kind == "every100":
            lax.cond(i % 100 == 99, lambda: jax.debug.callback(noop, c), lambda: None)
        return c

    return jax.jit(lambda x: lax.fori_loop(0, STEPS, body, x))


def timed(f, x, calls=20):
    jax.block_until_ready(f(x))
    start = time.perf_counter()
    for _ in range(calls):
        x = f(x)
    jax.block_until_ready(x)
    return (time.perf_counter() - start) / calls * 1e6


def main():
    x = jnp.ones((16,), jnp.float32)
    kinds = ["plain", "never", "never_result", "every100", "every100_result", "each", "each_result"]
    fs = {k: loop(k) for k in kinds}
    samples = {k: [] for k in kinds}
    for _ in range(5):
        for k in kinds:
            samples[k].append(timed(fs[k], x, 5 if k.startswith("each") else 20))
    kind = jax.devices()[0].device_kind
    print(f"device {kind}, jax {jax.__version__}, {STEPS}-step loop, µs a call")
    for k in kinds:
        print(f"{k:18s} {statistics.median(samples[k]):10.1f}")


if __name__ == "__main__":
    main()
