"""A JAX emitter for the record/replay tests: taps of every shape a recording must keep
(scalars with a step and static meta, a pytree with a namedtuple and bfloat16 leaves,
vmap's batch dims, pmap shards over 2 CPU devices; with the argument `image`, an image).
Prints one JSON line when done."""

from __future__ import annotations

import collections
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import jax
import jax.numpy as jnp

import tapd

Point = collections.namedtuple("Point", ["x", "y"])


def main() -> None:
    loss = jax.jit(lambda i: tapd.tap(i * 0.5, "loss", step=i, note="recorded"))
    for i in range(5):
        loss(i)

    def params(w: jax.Array) -> jax.Array:
        tree = {"w": w.astype(jnp.bfloat16), "p": Point(jnp.arange(3), w[0]), "n": None}
        tapd.tap(tree, "params", step=3)
        return w

    jax.jit(params)(jnp.arange(6.0).reshape(2, 3))
    jax.jit(jax.vmap(lambda x: tapd.tap(x * x, "vmapped")))(jnp.arange(4.0))
    devices = jax.local_device_count()
    shards = jnp.arange(devices * 2, dtype=jnp.float32).reshape(devices, 2)
    jax.pmap(lambda x: tapd.tap(x + 1, "shard", step=1))(shards)
    if "image" in sys.argv[1:]:  # (the TensorBoard sink's test)
        image = jnp.arange(4 * 5 * 3, dtype=jnp.uint8).reshape(4, 5, 3)
        jax.jit(lambda x: tapd.tap(x, "samples", step=2, image=True))(image)
    tapd.barrier_wait(timeout=60)
    print(json.dumps({"devices": devices, "stats": tapd.stats()}), flush=True)


if __name__ == "__main__":
    main()
