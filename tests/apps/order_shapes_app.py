"""The two program shapes of issue 49 that delivered taps out of program order, and the
tap too large for its ring (tests/test_order_property.py).

    python tests/apps/order_shapes_app.py shapes KIND    # KIND: tap, id_tap, debug
    python tests/apps/order_shapes_app.py too_big

`shapes` prints the order each shape's taps ran in (for `tap`, the taps go to the
daemon at TAPD_ENDPOINT as consumer "order", each tagged with its place in the
program, and a subscriber records their order). `too_big` taps 4 MiB into a ring of
64 KiB and prints what happened.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import tapd

NAMES = ["before", "inside", "in_cond", "first", "after"]
ORDER: list[str] = []


def tapper(kind: str, name: str) -> Any:
    """A tap of the given kind that records `name` when it runs."""
    if kind == "tap":
        tag = NAMES.index(name)
        return lambda x: tapd.tap({"tag": jnp.int32(tag), "x": x}, "order")["x"]
    if kind == "id_tap":
        return lambda x: tapd.id_tap(lambda value, transforms: ORDER.append(name), x)
    if kind == "debug":

        def tap(x: Any) -> Any:
            tapd.debug.callback(lambda value: ORDER.append(name), x, ordered=True)
            return x

        return tap
    raise SystemExit(f"unknown kind {kind!r}")


def shape_1(kind: str) -> None:
    """A tap in a loop body, then a while_loop that passes the tapped value's input
    through unchanged."""
    before, inside = tapper(kind, "before"), tapper(kind, "inside")

    def step(j: Any, carry: Any) -> Any:
        i, c = carry
        before(i + j)
        i, c, _ = lax.while_loop(
            lambda s: s[2] < 2, lambda s: (s[0], inside(s[1] + 1.0), s[2] + 1), (i, c, 0)
        )
        return i, c

    jax.jit(lambda i, c: lax.fori_loop(0, 2, step, (i, c)))(jnp.int32(1), jnp.float32(1))


def shape_2(kind: str) -> None:
    """A tap after a nested jit whose cond taps."""
    in_cond, first, after = (tapper(kind, n) for n in ("in_cond", "first", "after"))

    def branch(st: Any) -> Any:
        in_cond(st[1])
        return st

    def piece(st: Any) -> Any:
        i, c, v = st
        first(c)
        return lax.cond(i % 2 == 0, branch, branch, (i, c, v))

    def outer(x: Any, n: Any) -> Any:
        i, c, v = jax.jit(piece)((n * 7 + 1, x, jnp.arange(4.0) + x))
        after(c)
        return i, c, v

    jax.jit(outer)(jnp.float32(1), jnp.int32(0))


def shapes(kind: str) -> dict[str, Any]:
    orders = {}
    for name, shape in (("shape_1", shape_1), ("shape_2", shape_2)):
        ORDER.clear()
        shape(kind)
        tapd.barrier_wait()
        orders[name] = list(ORDER)
    return orders


def too_big() -> dict[str, Any]:
    tapd.configure(buffer_bytes=64 * 1024)
    try:
        jax.jit(lambda x: tapd.id_tap(lambda v, t: None, x))(jnp.zeros((1 << 20,), jnp.float32))
    except tapd.TapDefinitionError as exc:
        return {"refused": str(exc)}
    return {"refused": None}


if __name__ == "__main__":
    result = shapes(sys.argv[2]) if sys.argv[1] == "shapes" else too_big()
    print(json.dumps(result))
