"""One-off: what `tap(..., ordered=False)` saves per tap, against an ordered tap.

    TAPD_BACKEND=portable python bench/unordered_cost.py [--steps N] [--repeats R]

Starts its own daemon (no subscriber, dormancy off: the taps are read and counted unrouted), then
times a jitted `fori_loop` of N steps tapping a 16-float vector: untapped, ordered and
unordered, interleaved R times; prints the median µs each tap adds, as one JSON line.
Not a test: the figures depend on the machine (docs/TAPPING.md, "Ordered, strict and
unordered taps").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2000)
parser.add_argument("--repeats", type=int, default=9)
args = parser.parse_args()

directory = tempfile.mkdtemp(prefix="tapd-b-", dir="/tmp")
endpoint = f"ipc://{directory}/tapd.sock"
# No subscriber, yet the taps are to be copied: dormancy off for the daemon and for us.
os.environ["TAPD_DORMANT"] = "0"
daemon = subprocess.Popen(
    [sys.executable, "-m", "tapd", "start", "--endpoint", endpoint, "--startup-grace", "0"],
    stdout=subprocess.PIPE,
    text=True,
)
assert daemon.stdout is not None and daemon.stdout.readline().startswith("tapd ready:")
os.environ["TAPD_ENDPOINT"] = endpoint

import jax  # noqa: E402  (after the endpoint is set)
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import tapd  # noqa: E402


def loop(mode: str) -> Callable[[jax.Array], jax.Array]:
    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        x = x * 0.999 + 0.001
        if mode != "none":
            x = tapd.tap(x, f"bench.{mode}", ordered=mode == "ordered")
        return x

    return jax.jit(lambda x: lax.fori_loop(0, args.steps, body, x))


def timed(function: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    started = time.perf_counter()
    function(x).block_until_ready()
    jax.effects_barrier()
    return (time.perf_counter() - started) / args.steps * 1e6


x = jnp.zeros(16, jnp.float32)
modes = {mode: loop(mode) for mode in ("none", "ordered", "unordered")}
for function in modes.values():
    timed(function, x)  # compile, warm up
samples: dict[str, list[float]] = {mode: [] for mode in modes}
for _ in range(args.repeats):
    for mode, function in modes.items():  # interleaved: they share the machine's noise
        samples[mode].append(timed(function, x))
median = {mode: statistics.median(values) for mode, values in samples.items()}
tapd.barrier_wait(timeout=120)
print(json.dumps({
    "backend": tapd.backend(), "jax": jax.__version__, "steps": args.steps,
    "untapped_us": round(median["none"], 2),
    "ordered_added_us": round(median["ordered"] - median["none"], 2),
    "unordered_added_us": round(median["unordered"] - median["none"], 2),
}))  # fmt: skip
daemon.terminate()
daemon.wait(timeout=30)
