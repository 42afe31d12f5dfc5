"""JAX's own `jax.debug` examples: `jax.debug.print` under `vmap` and `grad`, and
`jax.debug.callback` inside a `cond`, run in a jitted `fori_loop`.

Source: JAX's docs, "Introduction to debugging" and "Runtime value debugging in JAX"
(the `f` that prints `x` and `sin(x)`, vmapped and differentiated; `log_value` as a
`jax.debug.callback`), https://docs.jax.dev/en/latest/debugging.html and
https://docs.jax.dev/en/latest/debugging/print_breakpoint.html (Apache-2.0). Their
functions, put in a loop of five steps so that there is a loop to time. Loop shape:
`fori_loop` around `vmap`, `grad` and `cond`. Unordered: JAX runs these callbacks in
another order on a TPU than on a CPU (under `vmap`), so lines compare as multisets.
"""

import jax
import jax.numpy as jnp

ORDERED = False

logged = []


def log_value(x):
    logged.append(float(x))


def f(x):
    jax.debug.print("jax.debug.print(x) -> {x}", x=x)
    y = jnp.sin(x)
    jax.debug.print("jax.debug.print(y) -> {y}", y=y)
    return y


def g(x):
    jax.lax.cond(x > 1.0, lambda: jax.debug.callback(log_value, x), lambda: None)
    return jnp.cos(x) * x


@jax.jit
def loop(xs):
    def body(i, xs):
        ys = jax.vmap(f)(xs)
        dx = jax.grad(lambda v: g(v).sum() if v.ndim else g(v))(xs.sum())
        return ys + dx + i

    return jax.lax.fori_loop(0, 5, body, xs)


def main():
    return loop(jnp.arange(3.0))


if __name__ == "__main__":
    print(main(), logged)
