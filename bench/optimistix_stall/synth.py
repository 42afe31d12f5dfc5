"""Hand-written loop shapes like optimistix's: an outer loop of unknown length that prints
each step, with inner loops of unknown length, a print inside `cond`, equinox's loops.
Run under `python -m tapd.debug` (or not: stock). SHAPES: comma list (default all);
DELAYS: comma list of per-line costs; STEPS outer steps; INNER inner trips; SIZE."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax
import jax.numpy as jnp
import probe
from jax import lax

printed = []
DELAY = [0.0]


class SlowOut:
    def __init__(self, inner):
        self.inner = inner

    def write(self, text):
        if "\n" in text:
            if DELAY[0] > 0:
                time.sleep(DELAY[0])
            printed.append(time.perf_counter())
        return self.inner.write(text)

    def flush(self):
        self.inner.flush()

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.stdout = SlowOut(sys.stdout)
err = sys.stderr
STEPS = int(os.environ.get("STEPS", "40"))
INNER = int(os.environ.get("INNER", "300"))
SIZE = int(os.environ.get("SIZE", "64"))


def inner_work(x, w, n):
    """A while loop of `n` trips (a traced count: unknown length)."""

    def body(c):
        i, x = c
        return i + 1, jnp.tanh(x @ w) * 0.5 + 0.5 * x

    return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]


def bounded_inner(x, w, n):
    """equinox's bounded while loop (nested scans of conds), as Diffrax's DirectAdjoint."""
    import equinox.internal as eqxi

    def body(c):
        i, x = c
        return i + 1, jnp.tanh(x @ w) * 0.5 + 0.5 * x

    return eqxi.while_loop(lambda c: c[0] < n, body, (0, x), max_steps=4 * INNER, kind="bounded")[1]


def outer(kind, printer, inner):
    def fit(x, w, n):
        def cond(c):
            return c[0] < STEPS

        def body(c):
            i, x = c
            x = inner(x, w, n)
            loss = jnp.sum(x * x)
            if printer == "plain":
                jax.debug.print("step {i} loss {l} x {x}", i=i, l=loss, x=x[0, :4])
            elif printer == "cond":
                lax.cond(
                    loss > -1.0,
                    lambda: jax.debug.print("step {i} loss {l} x {x}", i=i, l=loss, x=x[0, :4]),
                    lambda: None,
                )
            return i + 1, x

        if kind == "lax":
            return lax.while_loop(cond, body, (0, x))[1]
        import equinox.internal as eqxi

        return eqxi.while_loop(cond, body, (0, x), max_steps=STEPS + 1, kind=kind)[1]

    return jax.jit(fit)


SHAPES = {
    "fori_plain": None,
    "while_inner_plain": ("lax", "plain", inner_work),
    "while_inner_cond": ("lax", "cond", inner_work),
    "while_bounded_cond": ("lax", "cond", bounded_inner),
    "eqx_checkpointed_inner": ("checkpointed", "plain", inner_work),
    "eqx_lax_bounded_cond": ("lax", "cond", bounded_inner),
}


def fori(x, w, n):
    def body(i, x):
        x = inner_work(x, w, n)
        jax.debug.print("step {i} loss {l} x {x}", i=i, l=jnp.sum(x * x), x=x[0, :4])
        return x

    return lax.fori_loop(0, STEPS, body, x)


x0 = jnp.full((SIZE, SIZE), 0.1, jnp.float32)
w = jnp.eye(SIZE, dtype=jnp.float32) * 0.9
n = jnp.int32(INNER)
tapped = "tapd" in sys.modules
for shape in os.environ.get("SHAPES", ",".join(SHAPES)).split(","):
    spec = SHAPES[shape]
    f = jax.jit(fori) if spec is None else outer(*spec)
    for delay in [float(d) for d in os.environ.get("DELAYS", "0,0.05").split(",")]:
        DELAY[0] = delay
        for attempt in range(int(os.environ.get("REPEATS", "2"))):
            start = len(printed)
            sampler = (
                probe.Sampler()
                if (bool(os.environ.get("REPORT")) and attempt > 0 and delay > 0)
                else probe.NoSampler()
            )
            t0 = time.perf_counter()
            with sampler:
                out = f(x0, w, n)
                out.block_until_ready()
            t1 = time.perf_counter()
            before = sum(1 for t in printed[start:] if t <= t1)
            jax.effects_barrier()
            print(
                f"RESULT synth {shape} tapd={tapped} delay={delay} run={attempt} "
                f"loop_s={t1 - t0:.3f} lines_before_return={before} "
                f"lines={len(printed) - start} all_s={time.perf_counter() - t0:.3f}",
                file=err,
                flush=True,
            )
            if os.environ.get("REPORT") and attempt and delay:
                print(probe.summary(since=t0), file=err, flush=True)
                print(sampler.report(8), file=err, flush=True)
