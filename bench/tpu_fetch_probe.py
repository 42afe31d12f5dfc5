"""How long fetching one array of 4-64 MiB takes on a TPU, by its shape (issue 51).

tapd's packed buffers leave as one uint32 vector; on the TPU v5e a woken loop whose
single output is above ~10 MiB cost 1.6-4.2 times the floor of its bytes as `scan`
outputs (bench/RESULTS-tpu.md, session 19). Plain JAX: a computation that makes the
array (x + 1, so that it is computed each call), then `np.asarray` of it; ms a call,
medians of 3 rounds of 3 calls, each shape beside the others.

    python bench/tpu_fetch_probe.py
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {
    "u32 vector": lambda words: (words,),
    "u32 [n/128, 128]": lambda words: (words // 128, 128),
    "u32 [n/1024, 8, 128]": lambda words: (words // 1024, 8, 128),
}


def main() -> None:
    print(f"device {jax.devices()[0]}, JAX {jax.__version__}")
    for mib in (4, 8, 9, 10, 12, 16, 32, 64):
        words = mib * 2**20 // 4
        calls = {}
        for name, shape in SHAPES.items():
            x = jnp.zeros(shape(words), jnp.uint32)
            step = jax.jit(lambda x: x + 1)
            calls[name] = (step, x)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for step, x in calls.values():  # (compiled)
            np.asarray(step(x))
        for _ in range(3):
            for name, (step, x) in calls.items():
                start = time.perf_counter()
                for _ in range(3):
                    np.asarray(step(x))
                times[name].append((time.perf_counter() - start) / 3 * 1e3)
        line = ", ".join(f"{name} {statistics.median(t):7.2f}" for name, t in times.items())
        print(f"{mib:3d} MiB: {line} ms", flush=True)


if __name__ == "__main__":
    main()
