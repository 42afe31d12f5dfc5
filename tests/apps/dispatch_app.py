"""A real JAX emitter process for the per-call dispatch tests (tests/test_dispatch.py).
`python dispatch_app.py SCENARIO [ARGS]` taps into the daemon at $TAPD_ENDPOINT and prints
one JSON line of results last."""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import pjit, stages

import tapd


class PythonDispatches:
    """Counts the calls JAX dispatches through Python, those its C++ fast path did not
    take: of jitted functions (`_pjit_call_impl_python`) and of executables compiled
    ahead of time (`Compiled.call`)."""

    def __init__(self) -> None:
        self.jit = 0
        self.aot = 0
        jit_call = pjit._pjit_call_impl_python
        aot_call = stages.Compiled.call

        def counted_jit(*args: Any, **kwargs: Any) -> Any:
            self.jit += 1
            return jit_call(*args, **kwargs)

        def counted_aot(*args: Any, **kwargs: Any) -> Any:
            self.aot += 1
            return aot_call(*args, **kwargs)

        pjit._pjit_call_impl_python = counted_jit
        stages.Compiled.call = staticmethod(counted_aot)  # type: ignore[method-assign]


def _ordering(text: str) -> Any:
    return {"1": True, "0": False, "strict": "strict"}[text]


def fast_path(ordered: str, calls: str = "200") -> dict[str, Any]:
    """A jitted step with one tap, called `calls` times after two warm-up calls, then
    the same step compiled ahead of time, likewise: how many calls went through Python."""
    dispatches = PythonDispatches()
    ordering = _ordering(ordered)
    step = jax.jit(lambda x: tapd.tap(x, "fast", ordered=ordering) * 1.0001)
    x = jnp.ones(16)
    for _ in range(2):
        x = step(x)
    warm = dispatches.jit
    for _ in range(int(calls)):
        x = step(x)
    jit_python = dispatches.jit - warm
    compiled = step.lower(x).compile()
    for _ in range(2):
        x = compiled(x)
    warm = dispatches.aot
    for _ in range(int(calls)):
        x = compiled(x)
    aot_python = dispatches.aot - warm
    tapd.barrier_wait()
    return {"jit_python_calls": jit_python, "aot_python_calls": aot_python, "stats": tapd.stats()}


def _step_count(
    dispatches: PythonDispatches, step: Any, x: Any, calls: str, *, chained: bool = True
) -> int:
    """Calls `step` twice (compiling it), then `calls` times, each on the last one's
    result (`chained`) or all on `x`: how many of those went through JAX's Python
    dispatch."""
    first = x
    for _ in range(2):
        x = step(x if chained else first)
    warm = dispatches.jit
    for _ in range(int(calls)):
        x = step(x if chained else first)
    return dispatches.jit - warm


def hcb_fast_path(kind: str, ordered: str, calls: str = "200") -> dict[str, Any]:
    """A jitted step with one `id_tap` of a closure (`kind` "closure": it runs in this
    process, from the local ring) or one `id_print` of plain keywords ("print": through
    the daemon to `tapd.printing`, which runs here where no subscriber takes it), called
    `calls` times after two warm-up calls. `ordered`: "default" gives no `ordered=`
    (TAPD_ORDERED, which the test may set), else id_tap's `ordered=` keyword."""
    dispatches = PythonDispatches()
    keywords = {} if ordered == "default" else {"ordered": _ordering(ordered)}
    seen: list[float] = []

    def record(value: Any, transforms: Any) -> None:
        seen.append(float(value[0]))

    if kind == "closure":
        step = jax.jit(lambda x: tapd.id_tap(record, x, **keywords) * 1.0001)
    else:
        step = jax.jit(
            lambda x: tapd.id_print(x[0], result=x, what="fastprint", **keywords) * 1.0001
        )
    python_calls = _step_count(dispatches, step, jnp.ones(16), calls)
    tapd.barrier_wait()
    # (a closure's values grow with each call: the calls' taps ran in dispatch order)
    in_order = all(a < b for a, b in itertools.pairwise(seen))
    return {"jit_python_calls": python_calls, "seen": len(seen), "in_order": in_order}


def hcb_jit_of_pmap(calls: str) -> dict[str, Any]:
    """host_callback's `tap_jit_pmap_extra` step (an id_tap before a pmap, one inside it,
    one after it, all in one jit; XLA_FLAGS gives this process two CPU devices) called
    `calls` times after two warm-up calls: how many calls went through Python, and which
    taps ran on each device (by id), in the order they ran."""
    dispatches = PythonDispatches()
    ran: dict[int, list[str]] = {}

    def record(name: str) -> Any:
        def tap_func(value: Any, transforms: Any, *, device: Any) -> None:
            ran.setdefault(device.id, []).append(name)

        return tap_func

    def fun(xv: jax.Array) -> jax.Array:
        xv = tapd.id_tap(record("before"), xv + 1.0, tap_with_device=True)
        inside = jax.pmap(lambda x: tapd.id_tap(record("inside"), x * 2.0, tap_with_device=True))
        return tapd.id_tap(record("after"), inside(xv) + 1.0, tap_with_device=True)

    step = jax.jit(fun)
    # (not chained: jax 0.8 gives each trace of a pmap a mesh of its own, and refuses a
    # jit of it on a value sharded over another)
    x = jnp.zeros((jax.local_device_count(), 3))
    python_calls = _step_count(dispatches, step, x, calls, chained=False)
    tapd.barrier_wait()
    return {"jit_python_calls": python_calls, "ran": ran}


def hcb_mixed_order(calls: str) -> dict[str, Any]:
    """id_taps of tapd's token and strict ones (`ordered="strict"`: JAX's token) in one
    jit, around and inside a scan and a cond whose branch takes JAX's token from above,
    and a tap big enough to be guarded on the portable backend: each call's tap
    functions must run in program order, the calls in dispatch order."""
    ran: list[str] = []

    def record(name: str) -> Any:
        return lambda value, transforms: ran.append(name)

    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        tapd.id_tap(record("a"), x, ordered=True)
        x = tapd.id_tap(record("s1"), x, ordered="strict")

        def body(c: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            tapd.id_tap(record("loop"), c[0], ordered=True)
            tapd.id_tap(record("strict_loop"), c[0], ordered="strict")
            return c * 1.0, None

        x, _ = lax.scan(body, x, jnp.arange(2))
        tapd.id_tap(record("big"), jnp.ones(70_000), ordered=True)
        strict_cond = lambda: tapd.id_tap(record("strict_cond"), 1, ordered="strict")  # noqa: E731
        lax.cond(x[0] > 0, strict_cond, lambda: 1)
        return tapd.id_tap(record("b"), x, ordered=True)

    x = jnp.ones(4)
    for _ in range(int(calls)):
        x = step(x)
    tapd.barrier_wait()
    return {"ran": ran}


def hcb_under_a_mesh(calls: str) -> dict[str, Any]:
    """A jitted step with one id_tap of a closure, under `jax.set_mesh` of two devices:
    how many of `calls` calls went through Python."""
    dispatches = PythonDispatches()
    seen: list[Any] = []
    step = jax.jit(lambda x: tapd.id_tap(lambda v, t: seen.append(v), x) * 1.0001)
    with jax.set_mesh(jax.make_mesh((2,), ("x",))):
        python_calls = _step_count(dispatches, step, jnp.arange(4.0), calls)
    tapd.barrier_wait()
    return {"jit_python_calls": python_calls, "seen": len(seen)}


def program_order(calls: str) -> dict[str, Any]:
    """Taps of consumer "order" before, inside and after a scan, a cond, a while loop
    and a nested jit, none of them depending on the others' values; big enough arrays
    that XLA's CPU runtime may run independent work concurrently. Each call's taps must
    arrive in program order: values 0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10."""
    big = jnp.ones((256, 256))

    @jax.jit
    def nested(v: jax.Array, call: jax.Array) -> jax.Array:
        tapd.tap(jnp.int32(7), "order", step=call)
        return v * 2

    @jax.jit
    def step(x: jax.Array, w: jax.Array, call: jax.Array) -> jax.Array:
        tapd.tap(jnp.int32(0), "order", step=call)
        y = jnp.tanh(x @ w)

        def body(c: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            tapd.tap(jnp.int32(1), "order", step=call)
            return jnp.tanh(c @ w), None

        z, _ = lax.scan(body, y, jnp.arange(3))
        tapd.tap(jnp.int32(2), "order", step=call)
        u = lax.cond(
            x[0, 0] > 0,
            lambda v: tapd.tap(v, "cond_value") + 0 * tapd.tap(jnp.int32(3), "order", step=call),
            lambda v: v,
            z,
        )
        tapd.tap(jnp.int32(4), "order", step=call)

        def while_body(carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            tapd.tap(jnp.int32(5), "order", step=call)
            return carry[0] + 1, jnp.tanh(carry[1] @ w)

        _, v = lax.while_loop(lambda c: c[0] < 2, while_body, (0, u))
        tapd.tap(jnp.int32(6), "order", step=call)
        v = nested(v, call)
        tapd.tap(jnp.int32(8), "order", step=call)
        # a cond whose results nobody uses (JAX lowers it without any)
        lax.cond(x[0, 0] > 0, lambda: tapd.tap(jnp.int32(9), "order", step=call), lambda: 0)
        tapd.tap(jnp.int32(10), "order", step=call)
        return v

    for call in range(int(calls)):
        step(big, big * 0.001, jnp.int32(call))
    tapd.barrier_wait()
    return {"stats": tapd.stats()}


def _slow_step(consumer: str) -> Any:
    """A jitted step that takes a while on the CPU (four 192x192 products), then taps
    one value for `consumer` with step `i`."""
    w = jnp.full((192, 192), 0.001)

    @jax.jit
    def step(x: jax.Array, i: jax.Array) -> jax.Array:
        for _ in range(4):
            x = jnp.tanh(x @ w)
        tapd.tap(x[0, 0], consumer, step=i)
        return x

    return step


def _warmed_up(consumer: str) -> tuple[Any, jax.Array]:
    """`_slow_step(consumer)`, compiled, its first tap delivered; and its result."""
    step = _slow_step(consumer)
    x = step(jnp.ones((192, 192)), jnp.int32(-1))
    tapd.barrier_wait()
    return step, x


def _calls_in_flight(step: Any, x: jax.Array, calls: str) -> tuple[jax.Array, bool]:
    """`calls` calls of `step` (steps 0, 1, ...), dispatched without waiting; the last
    result, and whether it was still running when the loop ended."""
    for i in range(int(calls)):
        x = step(x, jnp.int32(i))
    return x, not x.is_ready()


def in_flight(calls: str) -> dict[str, Any]:
    """`calls` calls of a step that taps, dispatched without waiting (each takes a while
    on the CPU), then one `barrier_wait()`: every tap of every call must have been
    delivered to the subscribed consumer by then."""
    step, x = _warmed_up("flight")
    dispatches = PythonDispatches()
    x, dispatched_before_done = _calls_in_flight(step, x, calls)
    tapd.barrier_wait()
    return {
        "stats_at_barrier": tapd.stats(),
        "python_dispatches": dispatches.jit,
        "dispatched_before_done": dispatched_before_done,
    }


def effects_barrier_in_flight(calls: str, rounds: str) -> dict[str, Any]:
    """`rounds` times: `calls` calls of a step that taps, dispatched without waiting, then
    JAX's own `jax.effects_barrier()`: the calls keep no runtime token, yet the barrier
    must still wait for them, as it waits for any computation with an effect. (On the
    CPU the barrier's own tiny computation may overtake the chain: several rounds.)"""
    step, x = _warmed_up("jax_barrier")
    before = _taps_run()
    found: dict[str, list[Any]] = {"ready": [], "taps_run": [], "dispatched_before_done": []}
    for _ in range(int(rounds)):
        x, dispatched_before_done = _calls_in_flight(step, x, calls)
        jax.effects_barrier()
        found["ready"].append(x.is_ready())
        found["taps_run"].append(_taps_run() - before)
        found["dispatched_before_done"].append(dispatched_before_done)
    return found


def _taps_run() -> int:
    """Taps that have run, each counted where it ran: written, dropped or skipped
    (no subscriber takes these: their site is dormant)."""
    stats = tapd.stats()
    return int(stats["submitted"] + stats["skipped"])


def exit_in_flight(calls: str) -> dict[str, Any]:
    """`calls` calls of a step that taps, dispatched without waiting, then the process
    ends without a barrier: the exit drain must deliver every tap."""
    _, dispatched_before_done = _calls_in_flight(_slow_step("exit"), jnp.ones((192, 192)), calls)
    return {"dispatched_before_done": dispatched_before_done}


def under_a_mesh() -> dict[str, Any]:
    """Taps and a barrier inside `with jax.set_mesh(mesh)` over two devices (XLA_FLAGS
    gives this process two CPU devices): the barrier's own per-device computations run
    whatever mesh the caller set."""
    mesh = jax.make_mesh((2,), ("x",))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: tapd.tap(x, "mesh") * 2)(jnp.arange(4.0))
        tapd.barrier_wait()
    return {"out": out.tolist(), "stats": tapd.stats()}


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
