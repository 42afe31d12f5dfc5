"""A JAX program on a TPU for tests/tpu: `python tpu_app.py` runs every scenario in one
process (one process at a time may hold the chip) and prints one JSON object.

Each scenario records what its in-process tap functions saw (closures: the local path)
or taps named consumers that tests/apps/subscriber_app.py records. TAPD_GATHER picks the
path (auto gathers on a TPU); the test compares both against host_callback's semantics.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
from tapd.emitter import lifecycle

seen: list[Any] = []


def record(name: str) -> Any:
    def tap_function(arg: Any, transforms: Any) -> None:
        seen.append([name, jax.tree.map(lambda a: np.asarray(a).tolist(), arg)])

    return tap_function


def order() -> list[Any]:
    """Program order inside cond, fori_loop, while_loop and scan (host_callback's
    tap_cond_with_jit / tap_while_cond / tap_scan_cond shapes)."""
    tap = tapd.id_tap

    def f(x: Any) -> Any:
        x = tap(record("start"), x)

        def body(i: Any, c: Any) -> Any:
            c = tap(record("body"), c)
            return lax.cond(c > 3, lambda c: tap(record("cond"), c) + 1, lambda c: c + 2, c)

        x = lax.fori_loop(0, 5, body, x)
        x = lax.while_loop(lambda c: c < 100, lambda c: tap(record("while"), c) * 2, x)
        x, _ = lax.scan(lambda c, y: (tap(record("scan"), c + y), c), x, jnp.arange(3.0))
        return tap(record("end"), x)

    seen.clear()
    result = float(jax.jit(f)(jnp.float32(1.0)))
    tapd.barrier_wait()
    return [result, list(seen)]


def counts(steps: int) -> dict[str, Any]:
    """A long scan tapping a named consumer (a subscriber in another process) and a
    closure each step, with the step; a 1 MiB leaf every 50th step."""
    total = [0.0]

    def closure(arg: Any, transforms: Any) -> None:
        total[0] += float(arg)

    def body(c: Any, i: Any) -> Any:
        tapd.tap(jnp.full(4, i, jnp.float32), "tpu.values", step=i)
        tapd.id_tap(closure, i.astype(jnp.float32))
        lax.cond(
            i % 50 == 0,
            lambda: tapd.tap(jnp.full(2**18, i, jnp.float32), "tpu.big", step=i),
            lambda: jnp.zeros(2**18, jnp.float32),
        )
        return c + 1, None

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(steps))[0])().block_until_ready()
    tapd.barrier_wait()
    return {"closure_total": total[0]}


def failure() -> str:
    """A tap function's exception surfaces at the next barrier."""

    def fails(arg: Any, transforms: Any) -> None:
        if int(arg) == 3:
            raise ValueError("deliberate failure at 3")

    jax.jit(lambda: lax.fori_loop(0, 6, lambda i, c: tapd.id_tap(fails, i) + c, 0))()
    try:
        tapd.barrier_wait()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no exception"


def transforms() -> list[Any]:
    seen.clear()
    jax.jit(jax.vmap(lambda x: tapd.id_tap(record("vmap"), x * 2)))(jnp.arange(3.0))
    jax.jit(jax.grad(lambda x: tapd.id_tap(record("grad"), x) ** 2))(jnp.float32(3.0))
    jax.jit(jax.checkpoint(lambda x: jnp.sin(tapd.id_tap(record("remat"), x))))(jnp.float32(1))
    tapd.barrier_wait()
    return list(seen)


def dtypes() -> dict[str, Any]:
    """Taps of every width the packed buffers hold (gathered.host.pack's words), in a
    scan under jit, and the same values computed eagerly: each must arrive exactly."""
    got: list[Any] = []

    def plain(a: Any) -> Any:
        a = np.asarray(a)
        if np.iscomplexobj(a):
            a = np.stack([a.real, a.imag], -1)
        return [str(a.dtype), a.astype(np.float64).tolist()]

    def values(k: Any) -> dict[str, Any]:
        return {
            "bool": jnp.stack([k % 2 == 0, k % 3 == 0]),
            "int8": (jnp.arange(5, dtype=jnp.int8) * 61 + k.astype(jnp.int8)),
            "uint16": jnp.uint16(65533) - k.astype(jnp.uint16),
            "bf16": (jnp.arange(3.0) * 2.25 - k).astype(jnp.bfloat16),
            "f16": (jnp.arange(3.0) / 3 + k).astype(jnp.float16),
            "c64": (jnp.arange(2.0) + 1j * k).astype(jnp.complex64),
            "empty": jnp.zeros((0, 3), jnp.float32),
            "scalar": k.astype(jnp.int32),
        }

    def body(c: Any, k: Any) -> Any:
        keep = lambda arg, transforms: got.append(jax.tree.map(plain, arg))  # noqa: E731
        return tapd.id_tap(keep, values(k), result=c), None

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(3))[0])()
    tapd.barrier_wait()
    expected = [jax.tree.map(plain, values(jnp.int32(k))) for k in range(3)]
    return {"got": got, "expected": expected}


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    output = {
        "platform": jax.devices()[0].platform,
        "gather": lifecycle.settings().gather,
        "order": order(),
        "counts": counts(steps),
        "failure": failure(),
        "transforms": transforms(),
        "dtypes": dtypes(),
    }
    print(json.dumps(output))


if __name__ == "__main__":
    main()
