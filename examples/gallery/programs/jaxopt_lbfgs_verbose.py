"""JAXopt 0.8.5: L-BFGS with `verbose=True` on an l2-regularized logistic regression
(one ordered `jax.debug.print` line an iteration, jaxopt/_src/base.py `log_info`).

Source: JAXopt's docs, "Unconstrained optimization" (LBFGS, `verbose`) and its
objective `jaxopt.objective.binary_logreg`, https://jaxopt.github.io/stable/unconstrained.html
(Apache-2.0). The data are synthetic and small (scikit-learn's dataset loaders are left
out). Loop shape: `while_loop` (the solver) around a zoom line search's own
`while_loop`; the print is ordered. Pinned: jaxopt 0.8.5.
"""

import jax
import jax.numpy as jnp
import jaxopt
from jaxopt import objective

ORDERED = True  # jaxopt prints with ordered=True: the lines come in program order

key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
X = jax.random.normal(key_x, (200, 10))
y = (X @ jax.random.normal(key_w, (10,)) > 0).astype(jnp.int32)


def fun(w, l2reg, X, y):
    return objective.binary_logreg(w, (X, y)) + 0.5 * l2reg * jnp.sum(w**2)


solver = jaxopt.LBFGS(fun=fun, maxiter=25, tol=1e-6, verbose=True)
run = jax.jit(solver.run)


def main():
    params, state = run(jnp.zeros(X.shape[1]), l2reg=0.1, X=X, y=y)
    return params, state.iter_num, state.error


if __name__ == "__main__":
    print(main())
