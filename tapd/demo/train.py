"""The demo's JAX side: linear regression trained with a jitted `lax.scan`, tapping the
loss and the gradient norm of every step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import tapd

STEPS_PER_CALL = 5


def _loss(params: dict[str, Any], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def _train_chunk(
    params: dict[str, Any], first_step: jax.Array, x: jax.Array, y: jax.Array
) -> tuple[dict[str, Any], jax.Array]:
    def one_step(params: dict[str, Any], step: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        grad_norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree_util.tree_leaves(grads)))
        tapd.tap(loss, "loss", step=step)
        tapd.tap(grad_norm, "grad_norm", step=step)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return params, loss

    steps = first_step + jnp.arange(STEPS_PER_CALL)
    return lax.scan(one_step, params, steps)


def train(steps: int) -> float:
    """Run `steps` training steps (rounded up to whole chunks); return the last loss."""
    key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(key_x, (256, 8))
    true_w = jax.random.normal(key_w, (8,))
    y = x @ true_w + 0.5
    params = {"w": jnp.zeros(8), "b": jnp.zeros(())}
    losses = jnp.zeros(0)
    for first in range(0, steps, STEPS_PER_CALL):
        params, losses = _train_chunk(params, jnp.asarray(first), x, y)
    return float(losses[-1])
