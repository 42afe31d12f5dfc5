"""A program written for `jax.experimental.host_callback` (removed in JAX 0.8): gradient
descent on the Rosenbrock function in a jitted `while_loop`, logging each iteration's
step and loss to the host with `hcb.id_tap` and a tap function that keeps a history and
advances a tqdm bar; `hcb.barrier_wait()` before the history is read.

Source: the host_callback module's documented usage (JAX 0.4.x,
https://jax.readthedocs.io/en/jax-0.4.25/jax.experimental.host_callback.html, Apache-2.0):
`id_tap(tap_func, arg)` returning `arg`, a tap function of `(arg, transforms)`, taps
inside `while_loop`/`fori_loop` bodies, `barrier_wait` before reading what tap
functions wrote. Run it with `python -m tapd.hcb host_callback_logging.py` (the import
below then gives tapd's `id_tap`); the gallery's reference runs it with `id_tap` as the
ordered `jax.debug.callback` JAX's deprecation notes suggest. Loop shape: `while_loop`
with a nested `fori_loop` of inner steps, the tap between them.
"""

import jax
import jax.numpy as jnp
from jax.experimental import host_callback as hcb
from tqdm import tqdm

ORDERED = True  # id_tap's tap functions run in program order

history = []
bar = tqdm(desc="rosenbrock", unit="it", leave=False)


def log_step(arg, transforms):
    step, loss = arg
    history.append((int(step), float(loss)))
    bar.update(1)


def rosenbrock(p):
    return (1.0 - p[0]) ** 2 + 100.0 * (p[1] - p[0] ** 2) ** 2


@jax.jit
def minimize(p0):
    def cond(state):
        step, _, loss = state
        return (step < 40) & (loss > 1e-6)

    def body(state):
        step, p, _ = state
        p = jax.lax.fori_loop(0, 50, lambda _, p: p - 1e-3 * jax.grad(rosenbrock)(p), p)
        loss = rosenbrock(p)
        step, loss = hcb.id_tap(log_step, (step, loss))
        return step + 1, p, loss

    return jax.lax.while_loop(cond, body, (0, p0, rosenbrock(p0)))


def main():
    return minimize(jnp.array([-1.2, 1.0]))


if __name__ == "__main__":
    steps, p, loss = main()
    hcb.barrier_wait()
    bar.close()
    print(f"{int(steps)} steps, p={p}, loss={float(loss):.3g}, logged {len(history)}")
