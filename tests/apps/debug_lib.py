"""A library that calls `jax.debug` and `io_callback` on its users' behalf, as optimizers'
`verbose=True` printing, progress bars and RL loops do (tests/test_debug_runtime.py). It
binds the names at import, in the ways such libraries do."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax import debug, lax
from jax.experimental import io_callback

threads: list[str] = []
progress: list[int] = []


def _note(step: Any, loss: Any) -> None:
    threads.append(threading.current_thread().name)


def _progress(step: Any) -> None:
    progress.append(int(step))
    threads.append(threading.current_thread().name)


@jax.jit
def solve(x: jax.Array) -> jax.Array:
    """A `verbose=True` loop: prints and calls back every step, and updates a progress
    bar through `io_callback` with no result (the BlackJAX/NumPyro/Diffrax way)."""

    def body(step: jax.Array, x: jax.Array) -> jax.Array:
        loss = jnp.sum(x**2)
        debug.print("step {step}: loss {loss:.4f}", step=step, loss=loss)
        jax.debug.callback(_note, step, loss, ordered=True)
        io_callback(_progress, None, step, ordered=True)
        return x * 0.5

    return lax.fori_loop(0, 4, body, x)


def with_result(x: jax.Array) -> jax.Array:
    """An io_callback that returns a value: always JAX's."""
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.jit(lambda v: io_callback(lambda a: a * 10, shape, v))(x)
