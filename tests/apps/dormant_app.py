"""A long-running JAX job for the dormant-tap tests, driven from stdin.

Each line `run N` runs N more steps (each taps "acts" and "sampled", the latter with
`every=SAMPLE_EVERY`, and calls an id_tap function that counts its calls), waits for
the taps (effects barrier, then barrier_wait), and prints one JSON line: the step
counter, tapd.stats(), and how many times the id_tap function ran. `quit` ends it.

With DORMANT_APP_ACTS_ONLY=1 a step taps "acts" alone (a computation whose every site
may be dormant: the twin tests of tests/test_dormant.py), and each line says how many
calls its twin served (tapd/emitter/dormant_twin.py).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp

import tapd

SAMPLE_EVERY = 3
calls = 0
lock = threading.Lock()


def count_call(value: Any, meta: Any = None) -> None:
    global calls
    with lock:
        calls += 1


ACTS_ONLY = os.environ.get("DORMANT_APP_ACTS_ONLY") == "1"


@jax.jit
def step(i: jax.Array) -> jax.Array:
    x = jnp.full((16,), i, jnp.float32)
    x = tapd.tap(x, "acts", step=i)
    if ACTS_ONLY:
        return x.sum()
    x = tapd.tap(x * 2, "sampled", step=i, every=SAMPLE_EVERY)
    x = tapd.id_tap(lambda v, t: count_call(v), x)
    return x.sum()


def twin_calls() -> int:
    from tapd.emitter import dormant_twin

    return dormant_twin.calls_served()


def main() -> None:
    done = 0
    print(json.dumps({"ready": True, "backend": tapd.backend()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        for _ in range(int(words[1])):
            step(jnp.int32(done)).block_until_ready()
            done += 1
        jax.effects_barrier()
        tapd.barrier_wait(timeout=60)
        with lock:
            ran = calls
        said = {"steps": done, "stats": tapd.stats(), "id_tap_calls": ran}
        print(json.dumps({**said, "twin_calls": twin_calls()}), flush=True)


if __name__ == "__main__":
    main()
