"""A Flax Linen MLP trained with Optax's Adam in a jitted `lax.scan`, with a jax-tqdm
progress bar over the steps (`@scan_tqdm`: ordered `jax.debug.callback`s that open,
update and close a tqdm bar).

Sources (each Apache-2.0 or MIT): jax-tqdm's README, "scan_tqdm" (the bar decorates the
scan's body; the scan runs over `jnp.arange(n)`), https://github.com/jeremiecoullon/jax-tqdm
(MIT); Flax's Linen quick start (`nn.Module`, `init`, `apply`),
https://flax.readthedocs.io/en/latest/linen_intro.html (Apache-2.0); Optax's "Getting
started" training step (`optax.adam`, `update`, `apply_updates`),
https://optax.readthedocs.io/en/latest/getting_started.html (Apache-2.0). Regression on
synthetic data, small. Loop shape: `scan` whose body has a `cond` around each callback.
Pinned: flax 0.12.8, optax 0.2.8, jax-tqdm 0.4.0.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax_tqdm import scan_tqdm

ORDERED = True  # jax-tqdm's callbacks are ordered

N_STEPS = 200


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(1)(x)


key_x, key_init = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(key_x, (128, 4))
y = jnp.sin(x.sum(axis=1, keepdims=True))
model = MLP()
params = model.init(key_init, x)
optimizer = optax.adam(1e-2)


def loss_fn(params, x, y):
    return jnp.mean((model.apply(params, x) - y) ** 2)


@scan_tqdm(N_STEPS, print_rate=10)
def step(carry, i):
    params, opt_state = carry
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


@jax.jit
def train(params):
    (params, _), losses = jax.lax.scan(step, (params, optimizer.init(params)), jnp.arange(N_STEPS))
    return params, losses


def main():
    return train(params)


if __name__ == "__main__":
    print(main()[1][-1])
