"""A scan with jax-tqdm's progress bar (jax.debug.callback(..., ordered=True) under
lax.cond, bound by `from jax.debug import callback` when jax_tqdm is imported), run as
`python [-m tapd.debug] debug_tqdm_script.py STEPS` (tests/test_debug_runtime.py)."""

from __future__ import annotations

import json
import sys
import threading

import jax
import jax.numpy as jnp
import jax_tqdm
import jax_tqdm.base
from jax import lax

steps = int(sys.argv[1])
threads: set[str] = set()
original = jax_tqdm.base.callback


def watched(function, *args, **kwargs):  # type: ignore[no-untyped-def]
    """The library's callback, noting which thread runs each of its functions."""

    def noted(*a, **k):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return function(*a, **k)

    return original(noted, *args, **kwargs)


jax_tqdm.base.callback = watched


@jax_tqdm.scan_tqdm(steps, print_rate=5, desc="scan", ncols=60, ascii=True)
def step(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return carry + x, carry


total, _ = jax.jit(lambda xs: lax.scan(step, 0.0, xs))(jnp.arange(steps, dtype=jnp.float32))
jax.effects_barrier()
print(json.dumps({
    "total": float(total),
    "threads": sorted(threads),
    "callback_from": original.__module__,
    "argv": sys.argv,
}))  # fmt: skip
