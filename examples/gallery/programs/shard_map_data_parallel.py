"""A data-parallel training step with `jax.shard_map`: the batch split over a mesh
axis, gradients averaged with `pmean`, the step run in a jitted `fori_loop` that prints
the loss each step with `jax.debug.print`.

Source: JAX's docs, "Manual parallelism with shard_map", section "Neural networks" /
"Data parallelism" (`init_layer`, `predict`, `loss`, and `loss_dp` under `shard_map`
with `jax.lax.pmean` over the `'batch'` axis), https://docs.jax.dev/en/latest/notebooks/shard_map.html
(Apache-2.0). Here on a mesh of every device (one TPU v5e chip: a mesh of one; the
CPU: as many as XLA_FLAGS makes), with a plain SGD update. Loop shape: `fori_loop`
around `shard_map`; the print is in the loop body, outside the `shard_map`.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

ORDERED = False

mesh = Mesh(np.array(jax.devices()), ("batch",))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def init(key_init, layer_sizes, batch_size):
    key, *keys = jax.random.split(key_init, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))
    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))
    return params, (inputs, targets)


def predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def loss(params, batch):
    inputs, targets = batch
    predictions = predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P()))
def loss_and_grad_dp(params, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    return jax.lax.pmean(value, "batch"), jax.lax.pmean(grads, "batch")


@jax.jit
def train(params, batch):
    def step(i, params):
        value, grads = loss_and_grad_dp(params, batch)
        jax.debug.print("step {i}: loss {value}", i=i, value=value)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    return jax.lax.fori_loop(0, 30, step, params)


layer_sizes = [64, 128, 128, 8]
params, batch = init(jax.random.key(0), layer_sizes, 32 * len(jax.devices()))


def main():
    return train(params, batch)


if __name__ == "__main__":
    print(jax.tree.leaves(main())[-1])
