"""How long fetching one array of 4-100 MiB takes on a TPU, by its shape and by how the
host allocates its memory (issue 51).

tapd's packed buffers leave as one uint32 array; on the TPU v5e a woken loop whose
single output is above ~16 MiB cost 1.6-4.2 times the floor of its bytes as `scan`
outputs (bench/RESULTS-tpu.md, session 19). Plain JAX: a computation that makes the
array (x + 1, so that it is computed each call), then `np.asarray` of it; ms a call,
medians of 3 rounds of 3 calls, each shape beside the others. `sliced 16 MiB` fetches
the [n/128, 128] array as slices of 16 MiB (each sliced on the device, then fetched).
`f32 [8, n/8]` is the floor's form (a loop's 8 rows as `scan` outputs).

    python bench/tpu_fetch_probe.py [--sizes 16,32] [--malloc]

With `--malloc`, each run is repeated in a child process whose glibc never maps memory
of its own for a large block (MALLOC_MMAP_THRESHOLD_=1 GiB, MALLOC_TRIM_THRESHOLD_=4
GiB): where the cliff is the host's page faults on freshly mapped memory, it goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SLICE_WORDS = 16 * 2**20 // 4


def shapes() -> dict[str, object]:
    import jax.numpy as jnp

    return {
        "u32 vector": lambda words: ((words,), jnp.uint32),
        "u32 [n/128, 128]": lambda words: ((words // 128, 128), jnp.uint32),
        "f32 [8, n/8]": lambda words: ((8, words // 8), jnp.float32),
    }


def run(sizes: list[int]) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
    print(f"device {jax.devices()[0]}, JAX {jax.__version__}, {env or 'default malloc'}")
    for mib in sizes:
        words = mib * 2**20 // 4
        calls = {}
        for name, shape in shapes().items():
            form, dtype = shape(words)  # type: ignore[operator]
            x = jnp.zeros(form, dtype)
            step = jax.jit(lambda x: x + 1)
            calls[name] = lambda step=step, x=x: np.asarray(step(x))
        rows = SLICE_WORDS // 128
        pieces = -(-words // SLICE_WORDS)
        x2 = jnp.zeros((words // 128, 128), jnp.uint32)
        step2 = jax.jit(lambda x: x + 1)
        slicers = [
            jax.jit(lambda y, i=i, rows=rows: y[i * rows : (i + 1) * rows]) for i in range(pieces)
        ]

        def sliced(step2=step2, x2=x2, slicers=slicers) -> None:
            y = step2(x2)
            parts = [s(y) for s in slicers]
            for p in parts:
                p.copy_to_host_async()
            for p in parts:
                np.asarray(p)

        calls["sliced 16 MiB"] = sliced
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():  # (compiled)
            call()
        for _ in range(3):
            for name, call in calls.items():
                start = time.perf_counter()
                for _ in range(3):
                    call()
                times[name].append((time.perf_counter() - start) / 3 * 1e3)
        line = ", ".join(f"{name} {statistics.median(t):7.2f}" for name, t in times.items())
        print(f"{mib:3d} MiB: {line} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,8,16,24,28,32,64,100")
    parser.add_argument("--malloc", action="store_true")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if not args.malloc:
        run(sizes)
        return
    for extra in ({}, {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**32)}):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.update(extra)
        subprocess.run([sys.executable, __file__, "--sizes", args.sizes], env=env, check=True)


if __name__ == "__main__":
    main()
