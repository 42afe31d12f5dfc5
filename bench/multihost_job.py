"""One process of the multi-host throughput benchmark's JAX job, driven over stdin/stdout.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/multihost_job.py \
        --endpoint ipc://... --sizes 64,1048576 [--processes 2 --process-id I \
        --coordinator HOST:PORT] [--backend native]

With `--processes 1` it is a plain single-process job; otherwise it joins a
`jax.distributed` job (CPU collectives over gloo) and `pmap` spans every process's
devices. For each payload size it compiles a pmapped `fori_loop` whose every step taps
the device's float32 shard of that many bytes (consumer `bench.multihost.pP.SIZE`),
runs it once (2 steps, then `barrier_wait()`) to warm up, and prints `ready {json}`.

Then, for each line `run SIZE STEPS` on stdin: sync with the other processes
(`multihost_utils.sync_global_devices`, skipped when alone), read the clock
(`time.monotonic()`, one clock for every process on the machine), dispatch STEPS steps,
block until the output is ready, `tapd.barrier_wait()` (every tap of this process
handled by the subscriber), read the clock again, and print `{"start", "end", "taps"}`
as one JSON line. `quit` prints `{"stats": tapd.stats()}`, leaves the job
(`jax.distributed.shutdown()`) and exits. Only these lines go to stdout: what native
code prints there (gloo does) is sent to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TextIO

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import multihost_utils

import tapd

BARRIER_TIMEOUT = 300.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True, help="this host's daemon")
    parser.add_argument("--sizes", required=True, help="bytes per device-tap, comma-separated")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", help="HOST:PORT of jax.distributed's coordinator")
    parser.add_argument("--backend", help="tapd emitter backend (default: tapd's own)")
    return parser.parse_args()


def consumer_name(processes: int, size: int) -> str:
    return f"bench.multihost.p{processes}.{size}"


def tapping_loop(name: str) -> Callable[[jax.Array, int], jax.Array]:
    """pmap over every device of the job: a fori_loop of n steps, each tapping the shard."""

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x, name, step=i)
        return x

    return jax.pmap(lambda x, n: lax.fori_loop(0, n, body, x), in_axes=(0, None))


def protocol_channel() -> TextIO:
    """The real stdout, for our lines only; fd 1 becomes stderr from here on, so what
    native code prints (gloo does) cannot get into the protocol."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


def main() -> None:
    args = parse_args()
    channel = protocol_channel()

    def say(line: str) -> None:
        channel.write(line + "\n")
        channel.flush()

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator, num_processes=args.processes, process_id=args.process_id
        )
        # jax.distributed's preemption notice takes SIGTERM over; the bench stops us
        # with it only when something went wrong, so go at once.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    settings = {"endpoint": args.endpoint, "exit_timeout": 5.0}
    if args.backend:
        settings["backend"] = args.backend
    tapd.configure(**settings)
    local = jax.local_device_count()
    sizes = [int(s) for s in args.sizes.split(",")]
    loops = {size: tapping_loop(consumer_name(args.processes, size)) for size in sizes}
    shards = {size: jnp.ones((local, size // 4), jnp.float32) for size in sizes}
    for size in sizes:  # compile and warm up outside the timing
        loops[size](shards[size], 2).block_until_ready()
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)

    def sync(name: str) -> None:
        if args.processes > 1:
            multihost_utils.sync_global_devices(name)

    sync("ready")
    facts = {"backend": tapd.backend(), "devices": jax.device_count(), "local_devices": local}
    say("ready " + json.dumps(facts))
    for runs, line in enumerate(sys.stdin, start=1):
        command = line.split()
        if command == ["quit"]:
            break
        if len(command) != 3 or command[0] != "run":
            raise SystemExit(f"multihost_job: unknown command {line!r}")
        size, steps = int(command[1]), int(command[2])
        sync(f"run {runs}")
        started = time.monotonic()
        loops[size](shards[size], steps).block_until_ready()
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
        ended = time.monotonic()
        say(json.dumps({"start": started, "end": ended, "taps": local * steps}))
    say(json.dumps({"stats": tapd.stats()}))
    if args.processes > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
