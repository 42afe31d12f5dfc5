"""A real JAX emitter process for the tests. `python emitter_app.py SCENARIO [ARGS]`
taps into the daemon at $TAPD_ENDPOINT and prints one JSON line of results last."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import tapd
from tapd.native import library

if os.environ.get("TEST_HIDE_NATIVE_LIBRARY"):
    # Stand in for a machine where the install could not build the library and no
    # compiler is around to build it now.
    library._packaged = lambda: None
    os.environ["CXX"] = "/nonexistent/c++"

sys.path.insert(0, __file__.rsplit("/", 1)[0])


def transforms() -> dict[str, Any]:
    """jit, scan, fori_loop, vmap, cond and grad, each tapping its own consumer."""
    jax.jit(lambda x: tapd.tap(x * 2, "jit", step=7, note="hello"))(jnp.arange(3.0))

    def scan_body(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        carry = carry + x
        tapd.tap(carry, "scan")
        return carry, None

    jax.jit(lambda xs: lax.scan(scan_body, 0.0, xs))(jnp.arange(5.0))
    jax.jit(lambda: lax.fori_loop(0, 4, lambda i, c: tapd.tap(c + i, "fori", step=i), 0))()
    jax.jit(jax.vmap(lambda x: tapd.tap({"x": x, "sq": x * x}, "vmap")))(jnp.arange(3.0))

    def branchy(x: jax.Array) -> jax.Array:
        return lax.cond(
            x > 0, lambda v: tapd.tap(v, "cond_true"), lambda v: tapd.tap(-v, "cond_false"), x
        )

    jax.jit(branchy)(1.0)
    jax.jit(branchy)(-2.0)

    def loss(w: jax.Array, tapped: bool) -> jax.Array:
        y = jnp.sin(w) * 3.0
        if tapped:
            y = tapd.tap(y, "grad")
        return jnp.sum(y**2)

    w = jnp.array([0.1, 0.2, 0.3])
    grad_plain = jax.grad(lambda w: loss(w, False))(w)
    grad_tapped = jax.jit(jax.grad(lambda w: loss(w, True)))(w)

    # Nested vmap: one tap, both batch entries.
    jax.jit(jax.vmap(jax.vmap(lambda x: tapd.tap(x, "vmap2"))))(jnp.ones((2, 3)))
    # while_loop: once per executed iteration.
    jax.jit(lambda: lax.while_loop(lambda c: c < 3, lambda c: tapd.tap(c + 1, "while"), 0))()

    # remat: the tap runs in the forward pass only, not again when rematerialised.
    def remat_body(x: jax.Array) -> jax.Array:
        return tapd.tap(jnp.sin(x), "remat") * 2

    jax.jit(jax.grad(lambda x: jax.checkpoint(remat_body)(x)))(1.0)

    # scan under grad, tapping a loop-invariant-looking value (JAX #16637): not hoisted.
    def scan_grad_body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        tapd.tap(x, "scan_grad")
        return c + x * c, None

    jax.jit(jax.grad(lambda c: lax.scan(scan_grad_body, c, jnp.arange(3.0))[0]))(1.0)
    tapd.barrier_wait()
    return {"grad_plain": grad_plain.tolist(), "grad_tapped": grad_tapped.tolist()}


def steps(count: str, barrier: str = "barrier") -> dict[str, Any]:
    """`count` taps of consumer "loss" from a jitted step; time the loop and the barrier,
    and say when the loop ended (`loop_end`, wall clock)."""
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    step(0).block_until_ready()  # compile outside the timed loop
    started = time.perf_counter()
    for i in range(1, int(count)):
        step(i)
    jax.effects_barrier()
    loop = time.perf_counter() - started
    loop_end = time.time()  # (wall clock: a subscriber's handled_at is another process's)
    if barrier == "barrier":
        tapd.barrier_wait(timeout=60)
    waited = time.perf_counter() - started - loop
    return {"loop_s": loop, "loop_end": loop_end, "barrier_s": waited, "stats": tapd.stats()}


def steps_when_told(count: str, lower_first: str) -> dict[str, Any]:
    """`steps` at the test's word, so that it can settle what the daemon knows first.
    Lowers a tap of `lower_first` ("loss" itself, or another consumer: then "loss" is
    registered only once told), which creates this process's ring and names the site to
    the daemon; says {"ready": ...} and waits for a line on stdin. Then lowers (if not
    yet) and runs `count` taps of "loss", says {"ran": ...} once they are in the ring,
    and waits for another line before its barrier."""
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    first = step if lower_first == "loss" else jax.jit(lambda i: tapd.tap(i, lower_first))
    first.lower(0)
    print(json.dumps({"ready": lower_first}), flush=True)
    sys.stdin.readline()
    for i in range(int(count)):
        step(i)
    jax.effects_barrier()
    print(json.dumps({"ran": int(count)}), flush=True)
    sys.stdin.readline()
    tapd.barrier_wait(timeout=60)
    return {"stats": tapd.stats()}


def lower_when_told(count: str) -> dict[str, Any]:
    """A site "first" lowered at once (this process's ring met by the daemon); says
    {"ready": "first"}. Told, lowers a tap of "loss" (appended to the sites file, no tap
    run) and says {"lowered": "loss"}. Told again, runs `count` taps of "loss" and says
    {"ran": ...}; told a third time, its barrier."""
    jax.jit(lambda i: tapd.tap(i, "first")).lower(0)
    print(json.dumps({"ready": "first"}), flush=True)
    sys.stdin.readline()
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    step.lower(0)
    print(json.dumps({"lowered": "loss"}), flush=True)
    sys.stdin.readline()
    for i in range(int(count)):
        step(i)
    jax.effects_barrier()
    print(json.dumps({"ran": int(count)}), flush=True)
    sys.stdin.readline()
    tapd.barrier_wait(timeout=60)
    return {"stats": tapd.stats()}


def loop_pytree(count: str) -> dict[str, Any]:
    """A fori_loop of `count` steps tapping a pytree and a scalar each step, then a
    barrier: many small taps of two sites, interleaved."""

    def body(i: jax.Array, w: jax.Array) -> jax.Array:
        w = w + 1.0
        tapd.tap({"w": w, "i": i, "half": (w / 2).astype(jnp.bfloat16)}, "tree", step=i)
        tapd.tap(jnp.sum(w), "loss", step=i, unit="nats")
        return w

    jax.jit(lambda: lax.fori_loop(0, int(count), body, jnp.zeros((2, 3))))().block_until_ready()
    tapd.barrier_wait(timeout=60)
    return {"stats": tapd.stats()}


def loop(count: str, barrier: str = "barrier") -> dict[str, Any]:
    """A fori_loop of `count` steps tapping a scalar of "loss" each step, then a
    barrier: one site's records back to back in the ring, which the daemon routes in
    runs (tapd/daemon/runs.py) and sends as columnar runs. `barrier` "when_told": says
    {"ran": count} once the loop is done and waits for a line on stdin first."""

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x + i, "loss", step=i)
        return x

    jax.jit(lambda: lax.fori_loop(0, int(count), body, jnp.float32(0)))().block_until_ready()
    if barrier == "when_told":
        print(json.dumps({"ran": int(count)}), flush=True)
        sys.stdin.readline()
    tapd.barrier_wait(timeout=60)
    return {"stats": tapd.stats()}


def raising() -> dict[str, Any]:
    jax.jit(lambda x: tapd.tap(x, "bad"))(1.0)
    jax.jit(lambda x: tapd.tap(x, "good"))(2.0)
    try:
        tapd.barrier_wait(timeout=30)
    except tapd.TapFunctionException as exc:
        return {"raised": str(exc), "errors": exc.errors}
    return {"raised": None}


def host_callback_api() -> dict[str, Any]:
    import tap_functions

    f = jax.jit(lambda x: tapd.id_tap(tap_functions.record, x, result=x + 1))
    g = jax.jit(lambda x: tapd.id_tap(tap_functions.record, x, tap_with_device=True))
    h = jax.jit(lambda x: tapd.id_print(x * 10, what="scaled"))
    out = [f(jnp.arange(2)).tolist(), g(jnp.arange(3)).tolist(), h(jnp.ones(2)).tolist()]
    tapd.barrier_wait(timeout=30)
    return {"results": out, "stats": tapd.stats()}


def many_bytes(count: str, kib: str) -> dict[str, Any]:
    """`count` taps of `kib` KiB each, no barrier: the exit drain has to deliver them."""
    step = jax.jit(lambda i: tapd.tap(jnp.full((int(kib) * 256,), i, jnp.float32), "big", step=i))
    for i in range(int(count)):
        step(i)
    jax.effects_barrier()
    return {"stats": tapd.stats()}


def pmap(steps: str) -> dict[str, Any]:
    """pmap over every local device (run with 4 forced CPU devices): each device taps
    its own shard every step."""
    devices = jax.local_device_count()
    step = jax.pmap(lambda x, i: tapd.tap(x * 10 + i, "shard", step=i), in_axes=(0, None))
    shards = jnp.arange(devices * 2, dtype=jnp.float32).reshape(devices, 2)
    for i in range(int(steps)):
        step(shards, i)
    tapd.barrier_wait(timeout=60)
    return {"devices": devices, "backend": tapd.backend(), "stats": tapd.stats()}


def sharded() -> dict[str, Any]:
    """Taps of sharded values (run with 4 forced CPU devices), one consumer each."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    grid = jnp.arange(16.0).reshape(4, 4)
    mesh = jax.make_mesh((2, 2), ("a", "b"))  # Explicit axes: shardings known in jit
    # shard_map, each device's 2x2 block placed by spec=, as out_specs would place it.
    blocks = jax.shard_map(lambda v: tapd.tap(v, "shard_map", step=0, spec=P("a", "b")),
                           mesh=mesh, in_specs=P("a", "b"), out_specs=P("a", "b"))  # fmt: skip
    jax.jit(blocks)(jax.device_put(grid, NamedSharding(mesh, P("a", "b"))))
    # jit of an argument sharded over "a" (replicated over "b"): a tap per device.
    rows = jax.device_put(grid, NamedSharding(mesh, P("a")))
    jax.jit(lambda x: tapd.tap({"x": x, "y": x[:, :1]}, "jit_explicit", step=0))(rows)
    # Auto axes: the compiler decides the sharding, the tap sees the whole value once.
    auto = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
    spread = jax.device_put(jnp.arange(8.0), NamedSharding(auto, P("d")))
    jax.jit(lambda x: tapd.tap(x * 2, "jit_auto", step=0))(spread)
    # vmap inside pmap: each device taps its batch, the layout gains the batch dim.
    jax.pmap(jax.vmap(lambda x: tapd.tap(x, "pmap_vmap", step=0)))(grid.reshape(4, 2, 2))
    tapd.barrier_wait(timeout=60)
    return {"backend": tapd.backend(), "grid": grid.tolist()}


def multihost(process_id: str, coordinator: str, steps: str) -> dict[str, Any]:
    """One process of a 2-process jax.distributed job on CPU (run with 4 forced devices):
    a pmap over all 8 devices with a cross-process psum, each device tapping its
    shard and the psum into this host's daemon ($TAPD_ENDPOINT)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=2, process_id=int(process_id))
    local = jax.local_device_count()
    shards = jnp.arange(local, dtype=jnp.float32) + 10 * jax.process_index()

    repeats = int(os.environ.get("MULTIHOST_TAPS_A_STEP", "1"))  # (the gathered test's)

    def step(x: jax.Array, i: jax.Array) -> jax.Array:
        total = jax.lax.psum(x, "devices")
        for k in range(repeats):  # (tap k of a step: its shard + 100 k)
            total = tapd.tap({"shard": x + 100.0 * k, "total": total}, "multihost", step=i)
            total = total["total"]
        return total

    run = jax.pmap(step, axis_name="devices", in_axes=(0, None))
    totals = [run(shards, i).tolist() for i in range(int(steps))]
    tapd.barrier_wait(timeout=60)
    result = {"process": jax.process_index(), "devices": jax.device_count(),
              "totals": totals, "backend": tapd.backend(), "stats": tapd.stats()}  # fmt: skip
    jax.distributed.shutdown()
    return result


def paced(count: str, interval_ms: str) -> dict[str, Any]:
    """`count` taps, one every `interval_ms`, then a barrier (daemon restart tests)."""
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    for i in range(int(count)):
        step(i)
        time.sleep(float(interval_ms) / 1000)
    jax.effects_barrier()
    print("TAPPED", flush=True)
    tapd.barrier_wait(timeout=60)
    return {"stats": tapd.stats()}


def taps_then_hang(count: str) -> dict[str, Any]:
    """`count` taps, then wait to be killed (emitter death tests)."""
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    for i in range(int(count)):
        step(i)
    jax.effects_barrier()
    print("TAPPED", flush=True)
    time.sleep(600)
    return {}


def ahead_of_time(calls: str, ordered: str = "1") -> dict[str, Any]:
    """A loop that taps (`ordered` "1" or "0"), compiled ahead of time (`jit(f).lower(x)
    .compile()`), called `calls` times: JAX's C++ fast path would serve every call after
    the first (docs/UPSTREAM.md)."""

    def loop(x: jax.Array) -> jax.Array:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            tapd.tap(x, "aot", step=i, ordered=ordered == "1")
            return x + 1

        return lax.fori_loop(0, 3, body, x)

    compiled = jax.jit(loop).lower(jnp.int32(0)).compile()
    results = [int(compiled(jnp.int32(10 * call))) for call in range(int(calls))]
    tapd.barrier_wait()
    return {"results": results, "backend": tapd.backend(), "stats": tapd.stats()}


def unordered(count: str) -> dict[str, Any]:
    """`count` steps, each tapping two sites without the ordering token (TAPD_ORDERED
    decides the second, the first says ordered=False itself)."""

    @jax.jit
    def step(i: jax.Array) -> jax.Array:
        x = tapd.tap(i * 2, "unordered.a", step=i, ordered=False)
        return tapd.tap(x + 1, "unordered.b", step=i)

    outs = [int(step(jnp.int32(i))) for i in range(int(count))]
    tapd.barrier_wait()
    text = jax.jit(step.__wrapped__).lower(jnp.int32(0)).as_text()
    return {"outs": outs, "stats": tapd.stats(), "tokens_in_hlo": text.count("!stablehlo.token")}


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result), flush=True)
