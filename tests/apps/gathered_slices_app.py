"""Computations over several devices, each kind, for tests/test_gathered_slices.py.

    python tests/apps/gathered_slices_app.py KIND STEPS

KIND: shard_map, pmap, jit_of_pmap, shard_map_in_loop (the same taps in several
shard_maps, one called at each step of the loop), sharded_jit, explicit (a jit over a
mesh of Explicit axes, whose taps of a sharded value tap each shard where it lives),
explicit_2d (the same over a 2-D mesh, the value split along one of its axes),
transforms (vmap, grad and checkpoint of tapping steps in a shard_map), failing (a tap
function that raises at step 7, what the barrier says), drop (4 KiB taps into a small
ring whose tap function is slow: run TAPD_BUFFER_BYTES and TAPD_EMITTER_POLICY), while
(the loop a `while_loop`), barriers (slow taps, then `tapd.barrier_wait()` or
`jax.effects_barrier()`: how many had run), exit (slow taps left to the exit drain, each
a line in SLICES_EXIT_FILE), export (what jax.export says of a shard_map, a shard_map in
a loop and an Explicit mesh's taps). Each
runs a `fori_loop` of STEPS steps whose body taps (an `id_tap` of a closure, and a
`cond` that taps every third step), then a tap after a `psum` (where there is an axis),
twice.
Prints the taps each device ran, in order, the result, and how many host callbacks
tapd's taps ran (`tapd.stats()["host_callbacks"]`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import tapd

RAN: list[tuple[str, str, Any]] = []


def note(tag: str) -> Any:
    def record(arg: Any, transforms: Any, *, device: Any) -> None:
        RAN.append((str(device), tag, np.asarray(arg).tolist()))

    return record


def T(tag: str, x: Any) -> Any:
    return tapd.id_tap(note(tag), x, tap_with_device=True)


def step(j: Any, c: Any) -> Any:
    c = lax.cond(j % 3 == 0, lambda c: T("cond", c + 1000), lambda c: c, c)
    return T("step", c + j) + 1


def loop(x: Any, steps: int) -> Any:
    return lax.fori_loop(0, steps, step, T("first", x * 100))


def exported(function: Any, x: Any) -> str:
    """What jax.export makes of `function`: its refusal, or "exported"."""
    try:
        jax.export.export(jax.jit(function))(x)
    except Exception as exc:  # what the refusal says, whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "exported"


def transformed(steps: int) -> Any:
    """A loop whose step taps under vmap, grad and checkpoint (each device its own)."""

    def tapped_square(c: Any) -> Any:
        return T("inner", c) ** 2

    def run(x: Any) -> Any:
        def one(j: Any, c: Any) -> Any:
            batch = jax.vmap(lambda v: T("vmap", v + j))(jnp.stack([c, c + 1.0]))
            slope = jax.grad(lambda v: jnp.sum(jax.checkpoint(tapped_square)(v)))(c)
            return c + batch[0] * 0.001 + slope * 0.001

        return lax.fori_loop(0, steps, one, x)

    return run


def failing(steps: int) -> Any:
    def flaky(arg: Any, transforms: Any) -> None:
        if int(np.asarray(arg)[0]) == 7:
            raise RuntimeError("tap function failed at 7")
        RAN.append(("?", "flaky", np.asarray(arg).tolist()))

    def run(x: Any) -> Any:
        def one(j: Any, c: Any) -> Any:
            tapd.id_tap(flaky, jnp.full((1,), j))
            return c + 1.0

        return lax.fori_loop(0, steps, one, x)

    return run


def while_body(steps: int) -> Any:
    """The loop as a `while_loop` whose condition reads the carry."""

    def run(x: Any) -> Any:
        def going_on(jc: Any) -> Any:
            return jc[0] < steps

        def one(jc: Any) -> Any:
            j, c = jc
            return j + 1, step(j, c)

        y = lax.while_loop(going_on, one, (0, T("first", x * 100)))[1]
        T("after", lax.psum(y, "d"))
        return y

    return run


def slow_taps(steps: int, function: Any = None) -> Any:
    """A loop tapping 4 KiB a step to a function that takes a millisecond."""

    def slow(arg: Any, transforms: Any, *, device: Any) -> None:
        time.sleep(0.001)
        RAN.append((str(device), "slow", int(np.asarray(arg)[0])))

    def run(x: Any) -> Any:
        def one(j: Any, c: Any) -> Any:
            value = jnp.full((1024,), j, jnp.float32)
            tapd.id_tap(function or slow, value, tap_with_device=True)
            return c + 1.0

        return lax.fori_loop(0, steps, one, x)

    return run


def shard_map_in_loop(steps: int, mesh: Mesh) -> Any:
    """The same taps, each part a `shard_map` of its own: a step's called in the loop."""

    def on_each(function: Any, *in_specs: Any) -> Any:
        return jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=P("d"))

    def run(x: Any) -> Any:
        first = on_each(lambda x: T("first", x * 100), P("d"))(x)
        y = lax.fori_loop(0, steps, on_each(step, P(), P("d")), first)
        on_each(lambda y: T("after", lax.psum(y, "d")), P("d"))(y)
        return y

    return run


def body(steps: int, axis: str | None) -> Any:
    def run(x: Any) -> Any:
        y = loop(x, steps)
        total = lax.psum(y, axis) if axis else y
        T("after", total)
        return y

    return run


def main() -> dict[str, Any]:
    kind, steps = sys.argv[1], int(sys.argv[2])
    n = jax.device_count()
    x = jnp.arange(float(n))
    mesh = Mesh(np.array(jax.devices()), ("d",))
    if kind == "shard_map":
        f = jax.jit(jax.shard_map(body(steps, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    elif kind == "pmap":
        f, x = jax.pmap(body(steps, "p"), axis_name="p"), x[:, None]
    elif kind == "jit_of_pmap":
        f, x = jax.jit(jax.pmap(body(steps, "p"), axis_name="p")), x[:, None]
    elif kind == "transforms":  # vmap, grad and checkpoint of a tapping step, per device
        f = jax.jit(jax.shard_map(transformed(steps), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    elif kind == "failing":  # a tap function that raises, at step 7 of each device's loop
        f = jax.jit(jax.shard_map(failing(steps), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        outs = [np.asarray(f(x)).tolist() for _ in range(2)]
        try:
            tapd.barrier_wait()
            raised = None
        except Exception as exc:  # what the barrier raises: the tap function's error
            raised = f"{type(exc).__name__}: {exc}"
        return {**report(outs), "raised": raised}
    elif kind == "drop":  # 4 KiB taps a step into a small ring, a slow tap function
        f = jax.jit(jax.shard_map(slow_taps(steps), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
        outs = [np.asarray(f(x)).tolist()]
        return {**report(outs), "stats": tapd.stats()}
    elif kind == "while":  # a while_loop in the body (its trip count unknown)
        f = jax.jit(jax.shard_map(while_body(steps), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    elif kind == "barriers":  # each barrier returns once every earlier tap has run
        slow = jax.jit(
            jax.shard_map(slow_taps(steps), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        )
        tapd.install_debug()  # (jax.effects_barrier then waits for tapd's taps too)
        seen = []
        for barrier in (tapd.barrier_wait, jax.effects_barrier):
            RAN.clear()
            slow(x)
            slow(x)
            barrier()
            seen.append(len(RAN))
        return {"seen": seen, "expected": 2 * n * steps}
    elif kind == "exit":  # slow taps that only the exit drain runs: each writes a line
        path = os.environ["SLICES_EXIT_FILE"]

        def write(arg: Any, transforms: Any, *, device: Any) -> None:
            time.sleep(0.001)
            with open(path, "a") as out:
                out.write(f"{device} {int(np.asarray(arg)[0])}\n")

        f = jax.jit(
            jax.shard_map(slow_taps(steps, write), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        )
        jax.block_until_ready(f(x))
        return {"left": "to the exit drain"}
    elif kind == "export":  # what jax.export makes of each kind over the devices
        explicit = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
        forms = {
            "shard_map": jax.shard_map(
                body(steps, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")
            ),
            "shard_map_in_loop": shard_map_in_loop(steps, mesh),
        }
        said = {}
        for name, function in forms.items():
            said[name] = exported(function, x)
        with jax.set_mesh(explicit):
            on_explicit = jax.device_put(x, NamedSharding(explicit, P("d")))
            said["explicit"] = exported(body(steps, None), on_explicit)
        return {"exported": said, "host_callbacks": tapd.stats()["host_callbacks"]}
    elif kind == "shard_map_in_loop":
        f = jax.jit(shard_map_in_loop(steps, mesh))
    elif kind == "sharded_jit":
        f, x = jax.jit(body(steps, None)), jax.device_put(x, NamedSharding(mesh, P("d")))
    elif kind == "device_index":  # id_tap's device_index in a sharded jit: that device

        def on_second(v: Any) -> Any:
            for j in range(steps):
                v = tapd.id_tap(note("on1"), v + j, tap_with_device=True, device_index=1)
            return v

        f, x = jax.jit(on_second), jax.device_put(x, NamedSharding(mesh, P("d")))
    elif kind == "explicit_2d":  # a 2-D Explicit mesh, the value split along one axis
        grid = jax.make_mesh(
            (n // 2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
        )
        x = jax.device_put(jnp.arange(2.0 * n).reshape(n, 2), NamedSharding(grid, P("x", None)))
        with jax.set_mesh(grid):
            f = jax.jit(body(steps, None))
            outs = [np.asarray(f(x)).tolist() for _ in range(2)]
        return report(outs)
    elif kind == "explicit":
        explicit = jax.make_mesh((n,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
        x = jax.device_put(x, NamedSharding(explicit, P("d")))
        with jax.set_mesh(explicit):
            f = jax.jit(body(steps, None))
            outs = [np.asarray(f(x)).tolist() for _ in range(2)]
        return report(outs)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    outs = [np.asarray(f(x)).tolist() for _ in range(2)]
    return report(outs)


def report(outs: list[Any]) -> dict[str, Any]:
    tapd.barrier_wait()
    per_device: dict[str, list[Any]] = {}
    for device, tag, value in RAN:
        per_device.setdefault(device, []).append([tag, value])
    return {
        "out": outs,
        "per_device": per_device,
        "taps": len(RAN),
        "host_callbacks": tapd.stats()["host_callbacks"],
    }


if __name__ == "__main__":
    print(json.dumps(main(), sort_keys=True))
