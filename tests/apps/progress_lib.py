"""Stands in for a sampling library's progress-bar code: it imports host_callback
itself, at its top, as such libraries did before JAX removed it (jax 0.8.0)."""

from __future__ import annotations

from typing import Any

import jax
import jax.experimental.host_callback as hcb_alias
from jax import lax
from jax.experimental import host_callback

seen: list[int] = []  # what the progress tap function was given, in this process


def _update(value: Any, transforms: Any) -> None:
    seen.append(int(value))


def run_chain(steps: int) -> int:
    """A jitted loop that reports its progress through host_callback.id_tap."""

    def body(i: jax.Array, total: jax.Array) -> jax.Array:
        host_callback.id_tap(_update, i)  # a module function of this library
        return total + i

    total = jax.jit(lambda: lax.fori_loop(0, steps, body, 0))()
    host_callback.barrier_wait()
    return int(total)


def same_module() -> bool:
    return hcb_alias is host_callback
