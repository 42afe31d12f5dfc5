"""Optimistix 0.1.0: fitting the Lotka-Volterra parameters through a vmapped Diffrax solve,
with `verbose=True` (one `jax.debug.print` line a step, optimistix/_misc.py).

Source: Optimistix's docs notebook "Optimising a parameterised ODE",
https://github.com/patrick-kidger/optimistix/blob/main/docs/examples/optimise_diffeq.ipynb
(Apache-2.0). The same problem, solver and settings, written out here; the plot is left
out. Loop shape: optimistix's equinox `while_loop` around a `vmap` of Diffrax's adaptive
`while_loop`s, the print inside the outer loop's body. Pinned: optimistix 0.1.0,
diffrax 0.7.2, equinox 0.13.8 (examples/gallery/requirements.txt).
"""

import diffrax as dfx
import equinox as eqx
import jax.numpy as jnp
import optimistix as optx

ORDERED = False  # jax.debug.print's default: JAX promises no order between lines


def vector_field(t, y, parameters):
    prey, predator = y
    alpha, beta, gamma, delta = parameters
    d_prey = alpha * prey - beta * prey * predator
    d_predator = -gamma * predator + delta * prey * predator
    return jnp.stack([d_prey, d_predator])


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
        adjoint=dfx.DirectAdjoint(),  # forward-mode autodiff, for Levenberg-Marquardt
    )
    return sol.ys


def get_data():
    y0s = jnp.stack([jnp.array([9.0, 9.0]), jnp.array([10.0, 10.0]), jnp.array([11.0, 11.0])])
    true_parameters = jnp.array([0.1, 0.02, 0.4, 0.02])
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    batch_solve = eqx.filter_jit(eqx.filter_vmap(solve, in_axes=(None, 0, None)))
    return y0s, batch_solve(true_parameters, y0s, saveat)


def residuals(parameters, y0s__values):
    y0s, values = y0s__values
    saveat = dfx.SaveAt(ts=jnp.linspace(0, 30, 20))
    pred_values = eqx.filter_vmap(solve, in_axes=(None, 0, None))(parameters, y0s, saveat)
    return values - pred_values


y0s, values = get_data()
solver = optx.LevenbergMarquardt(rtol=1e-8, atol=1e-8, verbose=True)


def main():
    sol = optx.least_squares(residuals, solver, jnp.zeros(4), args=(y0s, values))
    return sol.value, sol.stats["num_steps"]


if __name__ == "__main__":
    print(main())
