"""A tqdm bar that host code opens, a jitted loop updates through `jax.debug.callback`,
and host code closes as soon as the call returns: the pattern issue 62 found losing its
updates under tapd (the call returned at once; the bar closed empty).

Source: tqdm's documented manual use (`with tqdm(total=...) as pbar: ... pbar.update(n)`),
https://github.com/tqdm/tqdm#manual (MPL-2.0 and MIT), around JAX's documented
`jax.debug.callback` (https://docs.jax.dev/en/latest/debugging/print_breakpoint.html,
Apache-2.0) in a `fori_loop`. The results include how far the bar was when it closed
(stock JAX: full), so that a bar closed early fails the gallery's "same results" check.
The timed loop is the jitted call alone (`CALL_SECONDS`), not the close, which waits for
the updates already dispatched. Loop shape: `fori_loop`, an ordered callback a step.
"""

import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

ORDERED = True

N = 40
CALL_SECONDS = 0.0  # the jitted call's time in the last main(): the worker reads it
bar = None


def update(i):
    bar.update(1)


@jax.jit
def loop(x):
    def body(i, x):
        jax.debug.callback(update, i, ordered=True)
        return jnp.tanh(x @ x.T) + i

    return jax.lax.fori_loop(0, N, body, x)


def main():
    global bar, CALL_SECONDS
    with tqdm(total=N, desc="closed after the call") as bar:
        begin = time.perf_counter()
        out = loop(jnp.eye(32))
        out.block_until_ready()
        CALL_SECONDS = time.perf_counter() - begin
    return out, bar.n


if __name__ == "__main__":
    print(main()[1], "of", N, "updates in the bar when it closed")
