"""jax-tqdm's `loop_tqdm` over a `fori_loop`: a progress bar in a jitted loop.

Source: jax-tqdm's README, "loop_tqdm" (the bar decorates the `fori_loop` body, whose
first argument is the step), https://github.com/jeremiecoullon/jax-tqdm (MIT). The body
here steps a small random walk (as the README's loops do: a tiny carry), 1000 steps.
Loop shape: `fori_loop` with a `cond` around each ordered callback. Pinned: jax-tqdm 0.4.0.
"""

import jax
import jax.numpy as jnp
from jax_tqdm import loop_tqdm

ORDERED = True

N = 1000


@loop_tqdm(N, print_rate=25)
def body(i, carry):
    key, x = carry
    key, sub = jax.random.split(key)
    return key, 0.99 * x + jax.random.normal(sub, x.shape)


@jax.jit
def walk(x0):
    return jax.lax.fori_loop(0, N, body, (jax.random.PRNGKey(1), x0))[1]


def main():
    return walk(jnp.zeros(64))


if __name__ == "__main__":
    print(main()[:4])
