"""Optax's L-BFGS in a `jax.lax.while_loop`, printing each iteration's objective value
and gradient norm with `jax.debug.print`.

Source: Optax's docs, the L-BFGS example (`run_opt`: `optax.value_and_grad_from_state`,
`opt.update(..., value=, grad=, value_fn=)`, a `while_loop` whose criterion reads
`count` and `grad` from the state with `optax.tree_utils.tree_get`),
https://optax.readthedocs.io/en/latest/_collections/examples/lbfgs.html (Apache-2.0);
the print of value and gradient norm each iteration is the docs' "print_info" made a
`jax.debug.print` inside the loop. The objective: the docs' Rosenbrock-like `fun` on 8
variables. Loop shape: `while_loop` around the zoom line search's own `while_loop`s.
Pinned: optax 0.2.8.
"""

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu

ORDERED = False


def fun(w):
    return jnp.sum(100.0 * (w[1:] - w[:-1] ** 2) ** 2 + (1.0 - w[:-1]) ** 2)


def run_opt(init_params, fun, opt, max_iter, tol):
    value_and_grad_fun = optax.value_and_grad_from_state(fun)

    def step(carry):
        params, state = carry
        value, grad = value_and_grad_fun(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=fun)
        params = optax.apply_updates(params, updates)
        jax.debug.print(
            "iteration {i}: value {v}, gradient norm {g}",
            i=otu.tree_get(state, "count"),
            v=value,
            g=otu.tree_norm(grad),
        )
        return params, state

    def continuing_criterion(carry):
        _, state = carry
        iter_num = otu.tree_get(state, "count")
        grad = otu.tree_get(state, "grad")
        err = otu.tree_norm(grad)
        return (iter_num == 0) | ((iter_num < max_iter) & (err >= tol))

    init_carry = (init_params, opt.init(init_params))
    return jax.lax.while_loop(continuing_criterion, step, init_carry)


opt = optax.lbfgs()
run = jax.jit(lambda w: run_opt(w, fun, opt, max_iter=40, tol=1e-3)[0])


def main():
    return run(jnp.zeros(8))


if __name__ == "__main__":
    print(main())
