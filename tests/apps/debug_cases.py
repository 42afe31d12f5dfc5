"""The cases tests/apps/debug_app.py runs with `jax.debug` and with `tapd.debug`.

Each case is `case(api, rec)`: `api` is `jax.debug` or `tapd.debug`, `rec` a callback
that records its arguments. GROUPS maps a group name to its cases; the "devices" group
runs with 4 CPU devices. ANY_ORDER names the cases whose calls JAX itself makes in no
fixed order (per device, or unordered callbacks of one computation). The control-flow
and several-device cases are in debug_cases_flow.py.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Case = Callable[[Any, Any], None]
GROUPS: dict[str, dict[str, Case]] = {}
ANY_ORDER: set[str] = set()


def case(group: str, *, any_order: bool = False) -> Callable[[Case], Case]:
    def register(function: Case) -> Case:
        name = function.__name__
        GROUPS.setdefault(group, {})[name] = function
        if any_order:
            ANY_ORDER.add(name)
        return function

    return register


X = jnp.arange(3.0)

# ---- values and printing -------------------------------------------------------------


@case("values")
def jit_pytree_static_and_python_scalars(api: Any, rec: Any) -> None:
    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        api.callback(rec, x, {"a": x * 2, "b": (x, None)}, "static", 3, 2.5, k=x.astype(int))
        return x

    f(X)
    f(X + 1)


@case("values")
def dtypes_and_shapes(api: Any, rec: Any) -> None:
    @jax.jit
    def f(x: jax.Array) -> None:
        api.callback(
            rec,
            x > 1,
            x.astype(jnp.int8),
            x.astype(jnp.uint32),
            x.astype(jnp.float16),
            x.astype(jnp.bfloat16),
            x.astype(jnp.complex64),
            jnp.zeros((0, 2)),
            x[0],
            jnp.ones((2, 1, 2)),
        )

    f(X)


@case("values")
def prng_keys(api: Any, rec: Any) -> None:
    jax.jit(lambda k, raw: api.callback(rec, k, raw))(jax.random.key(3), jax.random.PRNGKey(4))


@case("values")
def outside_jit(api: Any, rec: Any) -> None:
    api.callback(rec, 1.0, np.arange(3), "s", k=np.float32(2.5))
    api.print("eager {} {x}", 1, x=np.float32(2.5))
    for i in range(3):
        api.print("loop {i}", i=i)
    api.print("no arguments")
    api.callback(rec, jax.random.key(1), jax.random.PRNGKey(2))


@case("values", any_order=True)  # unordered prints of one computation
def print_formats(api: Any, rec: Any) -> None:
    @jax.jit
    def f(x: jax.Array, n: jax.Array) -> None:
        api.print("{x:.3f} | {n:>5} | {n:#x}", x=x[1], n=n)
        api.print("{} and {}", x, {"lr": 0.1, "x": x, "t": (n, None)})
        api.print("{x!r} {x!s} {x.shape} {x.dtype} {{braces}}", x=x)
        api.print("{0} {1} {0}", x, n)
        api.print("values:", x, n, skip_format_check=True)
        api.print("static {s} {arr}", s="text", arr=x)
        api.print("", x, skip_format_check=True)
        api.print("big {}", jnp.arange(2000.0))

    f(X, jnp.int32(7))


@case("values")
def printoptions_of_trace_time(api: Any, rec: Any) -> None:
    f = jax.jit(lambda x: api.print("x={}", x / 3))
    with np.printoptions(precision=2, suppress=True):
        f(X)
    f(X)  # printed with the options of trace time


@case("values")
def outside_jit_raises(api: Any, rec: Any) -> None:
    def bad(x: Any) -> None:
        raise KeyError(f"bad {float(x)}")

    api.callback(bad, 1.5)  # JAX runs it now, and raises what it raised


# jax.debug's two-call form, `callback(ordered=True)(f, x)`, came in jax 0.9.
TWO_CALL_FORM = inspect.signature(jax.debug.callback).parameters["callback"].default is None


@case("values" if TWO_CALL_FORM else "not_in_this_jax")
def two_call_forms(api: Any, rec: Any) -> None:
    @jax.jit
    def f(x: jax.Array) -> None:
        api.callback(ordered=True)(rec, x, k=x)
        api.print(ordered=True)("two {x}", x=x)

    f(X)


@case("values")
def nested_jit_and_donation(api: Any, rec: Any) -> None:
    inner = jax.jit(lambda x: (api.callback(rec, x), x * 2)[1])
    jax.jit(lambda x: inner(x) + 1)(X)
    jax.jit(lambda x: (api.callback(rec, x), x + 1)[1], donate_argnums=0)(jnp.ones(2))


@case("values")
def log_records(api: Any, rec: Any) -> None:
    if not hasattr(jax.debug, "log"):
        return
    jax.jit(lambda x: api.log("logged {}", x))(X)


# ---- transformations -----------------------------------------------------------------


@case("transforms")
def vmap_unrolls_each_element(api: Any, rec: Any) -> None:
    jax.vmap(lambda x, y: api.callback(rec, x, y, "s"))(jnp.arange(6.0).reshape(3, 2), X)
    jax.vmap(lambda x, y: api.callback(rec, x, y), in_axes=(1, None))(jnp.ones((2, 3)), X)
    jax.jit(jax.vmap(lambda x: api.print("v {}", x)))(X)


@case("transforms")
def nested_vmaps(api: Any, rec: Any) -> None:
    xs = jnp.arange(6.0).reshape(2, 3)
    jax.vmap(jax.vmap(lambda v: api.callback(rec, v)))(xs)
    jax.vmap(jax.vmap(lambda v, w: api.callback(rec, v, w), in_axes=(0, None)), in_axes=(1, 0))(
        xs, X
    )
    jax.jit(jax.vmap(jax.vmap(lambda v: api.callback(rec, v, ordered=True)), in_axes=1))(xs)


@case("transforms")
def vmap_of_unbatched_arguments(api: Any, rec: Any) -> None:
    jax.vmap(lambda x: api.callback(rec, 1.0))(X)
    jax.vmap(lambda x: api.callback(rec))(X)
    jax.jit(jax.vmap(lambda x: api.print("none")))(X)


@case("transforms")
def jvp_and_grad_see_primals(api: Any, rec: Any) -> None:
    def f(x: jax.Array) -> jax.Array:
        y = jnp.sin(x)
        api.callback(rec, x, y, ordered=True)
        return y * 2

    jax.jvp(f, (1.0,), (2.0,))
    jax.grad(f)(1.0)
    jax.jit(jax.grad(f))(2.0)
    jax.value_and_grad(f)(3.0)
    jax.vjp(f, 4.0)[1](1.0)
    jax.linearize(f, 5.0)[1](3.0)
    jax.vmap(jax.grad(f))(X)
    jax.grad(lambda x: jnp.sum(jax.vmap(f)(x)))(X)


@case("transforms")
def tangents_in_custom_rules(api: Any, rec: Any) -> None:
    @jax.custom_jvp
    def g(x: jax.Array) -> jax.Array:
        return jnp.sin(x)

    @g.defjvp
    def g_jvp(primals: Any, tangents: Any) -> Any:
        api.callback(rec, "tangent", tangents[0])
        return g(primals[0]), jnp.cos(primals[0]) * tangents[0]

    jax.jvp(g, (1.0,), (2.0,))  # the rule sees a tangent value: called
    jax.grad(g)(1.0)  # the tangent is linear, transposed: not called

    @jax.custom_vjp
    def h(x: jax.Array) -> jax.Array:
        return x * 3

    def h_fwd(x: jax.Array) -> Any:
        api.callback(rec, "fwd", x)
        return x * 3, x

    def h_bwd(res: Any, ct: Any) -> Any:
        api.callback(rec, "bwd", res, ct)
        return (ct * 3,)

    h.defvjp(h_fwd, h_bwd)
    jax.grad(h)(2.0)
    jax.jit(jax.grad(h))(5.0)


@case("transforms")
def grad_of_scan(api: Any, rec: Any) -> None:
    def h(w: jax.Array) -> jax.Array:
        def body(c: jax.Array, x: jax.Array) -> Any:
            api.callback(rec, "x", x, ordered=True)
            api.callback(rec, "c", c, ordered=True)
            return c * w + x, None

        return lax.scan(body, 1.0, X)[0]

    jax.grad(h)(2.0)
    jax.jit(jax.grad(h))(3.0)


@case("transforms")
def checkpoint_saving_everything(api: Any, rec: Any) -> None:
    policy = jax.checkpoint_policies.everything_saveable
    f = jax.checkpoint(lambda x: (api.print("y {}", x + 1), jnp.exp(x + 1))[1], policy=policy)
    jax.grad(f)(2.0)


@case("transforms")
def checkpoint_saving_nothing(api: Any, rec: Any) -> None:
    policy = jax.checkpoint_policies.nothing_saveable
    f = jax.checkpoint(lambda x: (api.print("y {}", x + 1), jnp.exp(x + 1))[1], policy=policy)
    jax.grad(f)(2.0)


# ---- refusals at trace time ----------------------------------------------------------


_REFUSALS: dict[str, Callable[[Any], Any]] = {
    "not_callable": lambda api: api.callback("this is not debug.print!"),
    "unused_positional": lambda api: api.print("x", 1, 2),
    "unused_keyword": lambda api: api.print("x {x}", x=1, y=2),
    "missing_keyword": lambda api: api.print("x {y}", x=1),
    "missing_index": lambda api: api.print("{} {}", 1),
    "bad_format": lambda api: api.print("x {", 1),
}
if TWO_CALL_FORM:
    _REFUSALS["callback_two_call_form_arguments"] = lambda api: api.callback(ordered=True, x=1)
    _REFUSALS["print_two_call_form_arguments"] = lambda api: api.print(ordered=True, x=1)
for _name, _call in _REFUSALS.items():
    GROUPS.setdefault("refusals", {})[_name] = lambda api, rec, call=_call: jax.jit(
        lambda: call(api)
    )()

import debug_cases_flow  # noqa: E402  (registers the control-flow and device cases)

__all__ = ["ANY_ORDER", "GROUPS", "debug_cases_flow"]
