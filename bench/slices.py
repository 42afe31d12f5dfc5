"""Taps over several devices, per-tap against gathered (issue 50), on the CPU with forced
devices: what a call of a tapping loop costs, and how many host callbacks it runs.

    python bench/slices.py [--devices 8] [--out PATH]

Each kind of computation over all the devices (a `jit` the compiler partitions over a
mesh, a `shard_map`, a `pmap`, a `shard_map` called at each step of a loop, a `jit` over
a mesh of Explicit axes) runs a `fori_loop` of 400 steps that taps 64 B a step (an
`id_tap` of a no-op closure: this process's own ring; or a dormant `tapd.tap`, whose
consumer the daemon started here says no subscriber takes), and the same loop
untapped. One child process per `TAPD_GATHER` setting (`off`: one host callback a tap;
`on`: gathered on each device), `TAPD_BACKEND=portable` (a TPU's path), each variant
timed in interleaved rounds, medians. On the CPU a host callback costs a few µs, not a
TPU's ~1 ms: the callback counts are the figure that carries over, the times are this
box's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 400
SMALL = 16


def child() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import tapd

    devices = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def step(tapped: str) -> Any:
        def body(i: Any, x: Any) -> Any:
            if tapped == "tap":
                x = tapd.id_tap(lambda v, t: None, x)
            elif tapped == "dormant":  # (no subscriber takes "nobody": the daemon says so)
                x = tapd.tap(x, "nobody")
            return x * 0.999 + 0.001

        return body

    def loop(tapped: str) -> Any:
        return lambda x: lax.fori_loop(0, STEPS, step(tapped), x)

    def per_device(tapped: str) -> Any:
        inner = loop(tapped)
        return lambda x: inner(x.reshape(SMALL)).reshape(x.shape)

    def in_loop(tapped: str) -> Any:  # a shard_map at each step of the loop
        body = jax.shard_map(
            lambda i, x: step(tapped)(i, x), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
        )
        return jax.jit(lambda x: lax.fori_loop(0, STEPS, body, x))

    explicit = jax.make_mesh((devices,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def under_explicit(tapped: str) -> Any:  # each tap of a sharded value: its shards'
        with jax.set_mesh(explicit):
            function = jax.jit(loop(tapped))

        def call(x: Any) -> Any:
            with jax.set_mesh(explicit):
                return function(x)

        return call

    variants: dict[str, tuple[Any, Any]] = {}
    spread = jnp.zeros((devices, SMALL), jnp.float32)
    sharded = jax.device_put(jnp.zeros(devices * SMALL), NamedSharding(mesh, P("d")))
    on_explicit = jax.device_put(jnp.zeros(devices * SMALL), NamedSharding(explicit, P("d")))
    for name in ("none", "tap", "dormant"):
        variants[f"sharded jit {name}"] = (jax.jit(loop(name)), sharded)
        smap = jax.shard_map(per_device(name), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        variants[f"shard_map {name}"] = (jax.jit(smap), spread.reshape(-1))
        variants[f"pmap {name}"] = (jax.pmap(per_device(name)), spread)
        variants[f"shard_map in a loop {name}"] = (in_loop(name), spread.reshape(-1))
        variants[f"Explicit mesh {name}"] = (under_explicit(name), on_explicit)

    callbacks: dict[str, int] = {}
    for name, (function, x) in variants.items():
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=300)
        before = tapd.stats().get("host_callbacks", 0)
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=300)
        callbacks[name] = tapd.stats().get("host_callbacks", 0) - before
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name, (function, x) in variants.items():
            start = time.perf_counter()
            for _ in range(3):
                out = function(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / (3 * STEPS) * 1e6)
            tapd.barrier_wait(timeout=300)
    return {
        "us": {name: statistics.median(values) for name, values in times.items()},
        "callbacks": callbacks,
        "devices": devices,
        "jax": jax.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the report here (Markdown)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return
    from processes import Processes

    results = {}
    with tempfile.TemporaryDirectory(prefix="sl-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon()  # (it marks "nobody" dormant: no subscriber takes it)
            for gather in ("off", "on"):
                env = {
                    **os.environ,
                    "JAX_PLATFORMS": "cpu",
                    "TAPD_AUTOSTART": "0",
                    "TAPD_ENDPOINT": processes.endpoint,
                    "TAPD_BACKEND": "portable",
                    "TAPD_GATHER": gather,
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
                }
                done = subprocess.run([sys.executable, __file__, "--child"], env=env,
                                      capture_output=True, text=True, check=True)  # fmt: skip
                results[gather] = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            processes.stop_all()
    lines = [
        "# Taps over several devices (bench/slices.py)",
        "",
        f"{args.devices} forced CPU devices, JAX {results['on']['jax']}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs; a {STEPS}-step loop tapping 64 B "
        "a step (id_tap of a no-op closure; dormant: `tapd.tap` of a consumer no subscriber "
        "takes), portable backend. µs a step (medians of 5 rounds of 3 calls), and in "
        "brackets the host callbacks one call runs.",
        "",
        "| computation | tap | untapped | tapped, gather off | tapped, gather on "
        "| added: on ÷ off |",
        "|---|---|---|---|---|---|",
    ]
    kinds = ("sharded jit", "shard_map", "pmap", "shard_map in a loop", "Explicit mesh")
    off, on = results["off"], results["on"]
    for kind in kinds:
        for tapped in ("tap", "dormant"):
            added_off = off["us"][f"{kind} {tapped}"] - off["us"][f"{kind} none"]
            added_on = on["us"][f"{kind} {tapped}"] - on["us"][f"{kind} none"]
            lines.append(
                f"| {kind} | {tapped} | {on['us'][f'{kind} none']:.2f} | "
                f"{off['us'][f'{kind} {tapped}']:.2f} ({off['callbacks'][f'{kind} {tapped}']}) | "
                f"{on['us'][f'{kind} {tapped}']:.2f} ({on['callbacks'][f'{kind} {tapped}']}) | "
                f"{added_on / added_off:.3f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
