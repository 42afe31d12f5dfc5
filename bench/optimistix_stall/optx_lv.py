"""optimistix 0.1.0 docs/examples/optimise_diffeq.ipynb (verbose least_squares of a
vmapped Diffrax solve), timed, each printed line made to cost LINE_DELAY s on the host.
MODES: comma list of kind:delay (kind stock|tapd; stock ones first: tapd is installed at
the first tapd one). Each mode runs REPEATS times (the first compiles)."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diffrax as dfx
import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx
import probe

DELAY = [0.0]
printed = []


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


def vector_field(t, y, parameters):
    prey, predator = y
    a, b, c, d = parameters
    return jnp.stack([a * prey - b * prey * predator, -c * predator + d * prey * predator])


def solve(parameters, y0, saveat):
    term = dfx.ODETerm(vector_field)
    t0, t1 = saveat.subs.ts[0], saveat.subs.ts[-1]
    sol = dfx.diffeqsolve(
        term,
        dfx.Tsit5(),
        t0,
        t1,
        0.1,
        y0,
        args=parameters,
        saveat=saveat,
        adjoint=dfx.DirectAdjoint(),
    )
    return sol.ys


def get_data():
    y0s = jnp.array([[9.0, 9.0], [10.0, 10.0], [11.0, 11.0]])
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    batch = eqx.filter_jit(eqx.filter_vmap(solve, in_axes=(None, 0, None)))
    return y0s, batch(jnp.array([0.1, 0.02, 0.4, 0.02]), y0s, saveat)


def residuals(parameters, y0s__values):
    y0s, values = y0s__values
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    return values - eqx.filter_vmap(solve, in_axes=(None, 0, None))(parameters, y0s, saveat)


def make():
    @jax.jit
    def fit(init, y0s, values):
        solver = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8, verbose=True)
        return optx.least_squares(residuals, solver, init, args=(y0s, values)).value

    return fit


if os.environ.get("INSTALL") == "1":
    import tapd

    tapd.install_debug()
y0s, values = get_data()
init = jnp.zeros(4)
repeats = int(os.environ.get("REPEATS", "3"))
installed = False
fit = make()
for mode in os.environ.get("MODES", "stock:0.05,tapd:0.05,tapd:0").split(","):
    kind, delay, *overrides = mode.split(":")
    if kind == "tapd" and overrides != globals().get("CURRENT", []):
        CURRENT = overrides
        import dataclasses

        from tapd.emitter import lifecycle

        BASE = globals().setdefault("BASE", lifecycle.settings())
        changes = {}
        for item in overrides:
            key, value = item.split("=")
            try:
                changes[key] = float(value) if key == "gather_latency" else int(value)
            except ValueError:
                changes[key] = value
        lifecycle._settings = dataclasses.replace(BASE, **changes)
        fit = make()
    if kind == "tapd" and not installed:
        import tapd

        probe.instrument()
        installed = True
    DELAY[0] = float(delay)
    for attempt in range(repeats):
        start = len(printed)
        sampler = (
            probe.Sampler()
            if (kind == "tapd" and float(delay) > 0 and attempt == repeats - 1)
            else probe.NoSampler()
        )
        t0 = time.perf_counter()
        with sampler:
            out = fit(init, y0s, values)
            out.block_until_ready()
        t1 = time.perf_counter()
        before = sum(1 for t in printed[start:] if t <= t1)
        jax.effects_barrier()
        t_all = time.perf_counter()
        print(
            f"RESULT optx {kind} delay={delay} {overrides} run={attempt} loop_s={t1 - t0:.3f} "
            f"lines_before_return={before} lines={len(printed) - start} "
            f"all_s={t_all - t0:.3f} value={out.tolist()}",
            file=err,
            flush=True,
        )
        if kind == "tapd" and attempt == repeats - 1:
            print(probe.summary(since=t0), file=err, flush=True)
            print(sampler.report(), file=err, flush=True)
            print(probe.timeline(t0, printed), file=err, flush=True)
            print(
                "  stats:",
                {k: v for k, v in tapd.stats().items() if not isinstance(v, dict)},
                file=err,
                flush=True,
            )
