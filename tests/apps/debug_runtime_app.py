"""What `tapd.debug` does besides making `jax.debug`'s calls (tests/test_debug_runtime.py):
where and when callbacks run, the barrier, failures, exit, `install_debug()`.
`python debug_runtime_app.py SCENARIO [jax|tapd]` uses the daemon at $TAPD_ENDPOINT and
prints one JSON object last."""

from __future__ import annotations

import io
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
import tapd.debug

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {}


def scenario(function: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    SCENARIOS[function.__name__] = function
    return function


@scenario
def off_the_step(impl: str) -> dict[str, Any]:
    """Callbacks that cannot finish before the step has: each waits for an event the
    main thread sets only once the computation's result is ready."""
    release = threading.Event()
    seen: list[list[Any]] = []

    def wait_then_record(i: Any) -> None:
        seen.append([int(i), release.wait(timeout=30), threading.current_thread().name])

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            tapd.debug.callback(wait_then_record, i, ordered=True)
            return x + i

        return lax.fori_loop(0, 5, body, x)

    out = run(jnp.float32(0)).block_until_ready()
    release.set()
    tapd.barrier_wait()
    return {"seen": seen, "out": float(out)}


@scenario
def blocking(impl: str) -> dict[str, Any]:
    """`blocking=True`: JAX's own call, done when the computation is."""
    seen: list[list[Any]] = []

    @jax.jit
    def run(x: jax.Array) -> jax.Array:
        tapd.debug.callback(
            lambda v: seen.append([float(v), threading.current_thread().name]), x, blocking=True
        )
        tapd.debug.print("blocking {}", x, blocking=True)
        return x + 1

    run(jnp.float32(2)).block_until_ready()
    before_barrier = list(seen)
    tapd.barrier_wait()
    return {"before_barrier": before_barrier, "jax_callback": tapd.debug.jax_callback.__module__}


@scenario
def failures(impl: str) -> dict[str, Any]:
    """A callback that raises for one step: the others still run, in order; the
    barrier raises CallbackException naming it, chained to what it raised."""
    seen: list[float] = []

    def check_step(step: Any) -> None:
        if int(step) == 2:
            raise ValueError(f"step {int(step)} is bad")
        seen.append(float(step))

    run = jax.jit(lambda s: tapd.debug.callback(check_step, s))
    for step in range(4):
        run(step)
    result: dict[str, Any] = {}
    try:
        tapd.barrier_wait()
    except tapd.CallbackException as exc:
        result = {"raised": str(exc), "cause": repr(exc.__cause__)}
    tapd.barrier_wait()  # reported once
    result["seen"] = seen
    return result


@scenario
def exit_drain(impl: str) -> dict[str, Any]:
    """Prints from a loop, then exits without waiting for them (tapd's exit drain
    does); JAX's run waits with its barrier."""
    api: Any = jax.debug if impl == "jax" else tapd.debug
    run = jax.jit(lambda: lax.fori_loop(0, 40, lambda i, c: (api.print("line {}", i), c)[1], 0))
    run()
    if impl == "jax":
        jax.effects_barrier()
    return {}


def _capture(run: Callable[[], Any]) -> tuple[Any, str]:
    real, sys.stdout = sys.stdout, io.StringIO()
    try:
        value = run()
        jax.effects_barrier()  # tapd's too, once installed
        return value, sys.stdout.getvalue()
    finally:
        sys.stdout = real


@scenario
def library(impl: str) -> dict[str, Any]:
    """A library's own jax.debug and io_callback calls (tests/apps/debug_lib.py)."""
    if impl == "tapd":
        tapd.install_debug(io_callback=True)
    import debug_lib

    value, printed = _capture(lambda: debug_lib.solve(jnp.ones(2)))
    return {
        "printed": printed,
        "threads": sorted(set(debug_lib.threads)),
        "progress": debug_lib.progress,
        "value": np.asarray(value).tolist(),
        "with_result": np.asarray(debug_lib.with_result(jnp.arange(3.0))).tolist(),
        "served_by_tapd": jax.debug.print is tapd.debug.print,
    }


@scenario
def io_callback_refusals(impl: str) -> dict[str, Any]:
    """JAX's refusals of io_callback stay after install_debug(io_callback=True)."""
    if impl == "tapd":
        tapd.install_debug(io_callback=True)
    from jax.experimental import io_callback

    def refusal(run: Callable[[], Any]) -> list[str]:
        try:
            run()
        except Exception as exc:
            return [type(exc).__name__, str(exc).split("\n---")[0]]
        return []

    note = lambda *a: None  # noqa: E731
    return {
        "vmap_ordered": refusal(
            lambda: jax.vmap(lambda x: io_callback(note, None, x, ordered=True))(jnp.ones(2))
        ),
        "vmap_unordered": refusal(
            lambda: jax.vmap(lambda x: io_callback(note, None, x))(jnp.ones(2))
        ),
        "grad": refusal(lambda: jax.grad(lambda x: (io_callback(note, None, x), x * 2)[1])(1.0)),
        "jvp": refusal(
            lambda: jax.jvp(lambda x: (io_callback(note, None, x), x)[1], (1.0,), (1.0,))
        ),
    }


@scenario
def io_callback_calls(impl: str) -> dict[str, Any]:
    """io_callback without result (4 devices): sharded jit, pmap, vmap, an ordered loop,
    outside jit; each call's values, in no set order (several devices)."""
    if impl == "tapd":
        tapd.install_debug(io_callback=True)
    from jax.experimental import io_callback
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    calls: list[str] = []
    note = lambda *a: calls.append(json.dumps([np.asarray(x).tolist() for x in a]))  # noqa: E731
    mesh = jax.make_mesh((4,), ("i",))
    xs = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("i")))
    jax.jit(lambda v: io_callback(note, None, v * 2))(xs)
    jax.pmap(lambda v: io_callback(note, None, v))(jnp.arange(4.0))
    jax.vmap(lambda v: io_callback(note, None, v))(jnp.arange(3.0))
    loop = lambda i, c: (io_callback(note, None, i, ordered=True), c)[1]  # noqa: E731
    jax.jit(lambda: lax.fori_loop(0, 3, loop, 0))()
    io_callback(note, None, 5.0)
    jax.effects_barrier()
    return {"calls": sorted(calls)}


@scenario
def ordered_on_devices(impl: str) -> dict[str, Any]:
    """`ordered=True` under pmap (4 devices): JAX refuses it, and so does tapd, with
    the same type and words."""
    api: Any = jax.debug if impl == "jax" else tapd.debug
    calls: list[list[Any]] = []
    note = lambda tag, v: calls.append([tag, float(v)])  # noqa: E731

    def body(v: jax.Array) -> jax.Array:
        for tag in ("a", "b", "c"):
            api.callback(note, tag, v, ordered=True)
            v = v + 0
        return v

    try:
        jax.pmap(body)(jnp.arange(4.0))
        tapd.barrier_wait()  # jax.effects_barrier(), then tapd's
    except ValueError as exc:
        return {"refused": str(exc).split(":")[0]}
    return {"by_device": [[tag for tag, v in calls if v == d] for d in range(4)]}


@scenario
def effects_barrier_raises(impl: str) -> dict[str, Any]:
    """After install_debug(), jax.effects_barrier() waits for tapd's callbacks and raises
    what they raised."""
    tapd.install_debug()

    def fail(x: Any) -> None:
        raise RuntimeError("from the callback")

    jax.jit(lambda x: jax.debug.callback(fail, x))(1.0)
    try:
        jax.effects_barrier()
    except tapd.CallbackException as exc:
        return {"raised": type(exc).__name__, "text": str(exc)}
    return {"raised": None}


if __name__ == "__main__":
    name, *rest = sys.argv[1:]
    # One write: print() writes its text and its newline apart, and a callback still
    # printing on tapd's receiver thread (exit_drain) may write between them.
    sys.stdout.write(json.dumps(SCENARIOS[name](*(rest or ["tapd"]))) + "\n")
    sys.stdout.flush()
