"""The control-flow, order and several-device cases of tests/apps/debug_cases.py (which
registers them)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from debug_cases import X, case
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# ---- control flow and order ----------------------------------------------------------


@case("control")
def scan_fori_and_while(api: Any, rec: Any) -> None:
    def body(c: jax.Array, x: jax.Array) -> Any:
        api.callback(rec, c, x)
        return c + x, None

    jax.jit(lambda xs: lax.scan(body, 0.0, xs))(X)
    jax.jit(lambda: lax.fori_loop(0, 3, lambda i, c: (api.print("i={} c={}", i, c), c * 2)[1], 1))()

    def cond(c: jax.Array) -> jax.Array:
        api.print("cond {}", c)
        return c < 3

    jax.jit(lambda c: lax.while_loop(cond, lambda c: (api.callback(rec, c), c + 1)[1], c))(0)


@case("control")
def cond_and_switch(api: Any, rec: Any) -> None:
    f = jax.jit(
        lambda p, x: lax.cond(
            p, lambda: api.callback(rec, "t", x), lambda: api.callback(rec, "f", x)
        )
    )
    f(True, 1.0)
    f(False, 2.0)
    branches = [lambda x, i=i: api.print("branch {} {}", i, x) for i in range(3)]
    g = jax.jit(lambda i, x: lax.switch(i, branches, x))
    for i in (2, 0, 1, 5):
        g(i, 1.5)


@case("control")
def batched_predicates(api: Any, rec: Any) -> None:
    jax.vmap(
        lambda p, x: lax.cond(
            p, lambda: api.callback(rec, "t", x), lambda: api.callback(rec, "f", x)
        )
    )(jnp.array([True, False]), jnp.array([1.0, 2.0]))

    def body(c: jax.Array) -> jax.Array:
        api.callback(rec, c)
        return c + 1

    jax.vmap(lambda x: lax.while_loop(lambda c: c < 3, body, x))(jnp.array([0, 2]))


@case("control")
def batched_while_condition_ordered(api: Any, rec: Any) -> None:
    def cond(c: jax.Array) -> jax.Array:
        api.print("x: {x}", x=c, ordered=True)
        return c < 5

    jax.vmap(lambda x: lax.while_loop(cond, lambda c: c + 1, x))(jnp.arange(2))


@case("control", any_order=True)
def batched_while_condition_unordered(api: Any, rec: Any) -> None:
    def cond(c: jax.Array) -> jax.Array:
        api.print("x: {x}", x=c)
        return c < 5

    jax.vmap(lambda x: lax.while_loop(cond, lambda c: c + 1, x))(jnp.arange(2))


@case("control")
def ordered_between_sites_and_steps(api: Any, rec: Any) -> None:
    @jax.jit
    def f(x: jax.Array) -> jax.Array:
        api.callback(rec, "first", x, ordered=True)
        api.print("second {}", x, ordered=True)
        y = jnp.sin(x)
        api.callback(rec, "third", y, ordered=True)
        return y

    g = jax.jit(lambda x: (api.callback(rec, "g", x, ordered=True), x + 1)[1])
    x = jnp.float32(0.5)
    for _ in range(3):
        x = g(f(x))


# (an unordered callback's calls: jax 0.12 makes a batch's last to first here, 0.10 first
# to last)
@case("control", any_order=True)
def scan_under_vmap(api: Any, rec: Any) -> None:
    def body(c: jax.Array, x: jax.Array) -> Any:
        api.callback(rec, c, x)
        return c + x, None

    jax.vmap(lambda xs: lax.scan(body, 0.0, xs))(jnp.arange(6.0).reshape(2, 3))


# ---- several devices -----------------------------------------------------------------


def _mesh(axis_types: Any = None) -> Any:
    if axis_types is None:
        return jax.make_mesh((4,), ("i",))
    return jax.make_mesh((4,), ("i",), axis_types=axis_types)


@case("devices", any_order=True)
def pmap_runs_per_device(api: Any, rec: Any) -> None:
    jax.pmap(lambda v: api.callback(rec, v))(jnp.arange(8.0).reshape(4, 2))
    jax.pmap(lambda v, w: api.print("p {} {}", v, w), in_axes=(0, None))(jnp.arange(4.0), 9.0)

    def body(c: jax.Array) -> jax.Array:
        api.print("hello: {}", c)
        return c + 1

    jax.pmap(lambda x: lax.while_loop(lambda c: c < 3, body, x))(jnp.arange(4))
    jax.pmap(lambda v: api.callback(rec, "constant", 1.0))(jnp.arange(4.0))


@case("devices", any_order=True)
def shard_map_runs_per_shard(api: Any, rec: Any) -> None:
    mesh = _mesh()
    xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))

    def block(v: jax.Array) -> jax.Array:
        api.callback(rec, v, v.sum())
        return v

    jax.jit(jax.shard_map(block, mesh=mesh, in_specs=P("i"), out_specs=P("i")))(xs)
    constant = jax.shard_map(
        lambda v: (api.callback(rec, "constant", 2.0), v)[1],
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    jax.jit(constant)(xs)
    for partitioned in (False, True):
        jax.jit(
            jax.shard_map(
                lambda v, p=partitioned: (api.print("s {}", v, partitioned=p), v)[1],
                mesh=mesh,
                in_specs=P("i"),
                out_specs=P("i"),
            )
        )(xs)


@case("devices", any_order=True)
def sharded_jit(api: Any, rec: Any) -> None:
    mesh = _mesh()
    xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    jax.jit(lambda v: api.callback(rec, "gathered", v * 2))(xs)
    jax.jit(lambda v: api.callback(rec, "partitioned", v * 2, partitioned=True))(xs)
    replicated = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
    jax.jit(lambda v: api.print("r {}", v, partitioned=True))(replicated)


@case("devices", any_order=True)
def explicit_mesh(api: Any, rec: Any) -> None:
    mesh = _mesh((jax.sharding.AxisType.Explicit,))
    xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    with jax.set_mesh(mesh):
        jax.jit(lambda v: api.callback(rec, "gathered", v * 2))(xs)
        jax.jit(lambda v: api.callback(rec, "partitioned", v * 2, partitioned=True))(xs)


@case("devices", any_order=True)
def vmap_inside_pmap(api: Any, rec: Any) -> None:
    jax.pmap(jax.vmap(lambda v: api.callback(rec, v)))(jnp.arange(8.0).reshape(4, 2))
