"""Where a gathered tap's cost per call goes, on a TPU (issue 43's "one tap per call").

    TAPD_GATHER=on python bench/tpu_call_probe.py [--calls N] [--profile]

One process, one jitted step of 16 float32, µs a call (dispatching `calls` calls, then
waiting for the last), medians of interleaved rounds:

- `untapped`: the step alone (JAX's C++ dispatch path);
- `output floor`: the step returning the tapped value as a second output, which a thread
  copies to the host (what the issue measured as the floor of a tap that is an output);
- `id_tap`: the step with an id_tap of a closure (gathered: its buffers come out as an
  output, tapd/emitter/taps_as_outputs.py, on JAX's C++ path from its second call:
  tapd/emitter/outputs_fast_path.py);
- `id_tap, JAX's Python path`: the same, kept on JAX's Python path (as before the C++
  path was given to it);
- `id_tap, copied in the dispatch`: the copy to the host started in JAX's dispatch, not
  by tapd's thread (`taps_as_outputs.Collector.copy_ahead`, off by default);
- `id_tap, outputs dropped`: the same, with tapd's collector dropping what comes out
  (the dispatch and the execution alone);
- `id_tap, fetched, not written`: what comes out copied to the host, not written;
- `jax.debug.callback`: the reference.

With `--profile`, cProfile's top functions over the id_tap calls. Runs on the CPU too
(where it says nothing about a TPU).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import queue
import statistics
import threading
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import tapd
    from tapd.emitter import taps_as_outputs

    received: list[int] = []

    def closure(value: Any, transforms: Any) -> None:
        received.append(1)

    copies: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def copier() -> None:
        while True:
            np.asarray(copies.get())

    threading.Thread(target=copier, daemon=True).start()
    untapped = jax.jit(lambda x: x * 1.0001)
    with_output = jax.jit(lambda x: (x * 1.0001, x))
    tapped = jax.jit(lambda x: tapd.id_tap(closure, x) * 1.0001)
    debug = jax.jit(lambda x: (jax.debug.callback(lambda v: None, x), x * 1.0001)[1])

    def floor(x: Any) -> Any:
        out, side = with_output(x)
        side.copy_to_host_async()
        copies.put(side)
        return out

    keep = taps_as_outputs.collector.received
    from tapd.emitter.gathered import host as gathered_host

    write = gathered_host.Flush.write_packed
    write_us: list[float] = []
    skip_writes = [False]

    def timed_write(self: Any, packed: Any) -> None:
        if skip_writes[0]:
            return
        start = time.perf_counter()
        write(self, packed)
        write_us.append((time.perf_counter() - start) * 1e6)

    gathered_host.Flush.write_packed = timed_write  # type: ignore[method-assign]

    def fetched_only(x: Any) -> Any:
        skip_writes[0] = True
        try:
            return tapped(x)
        finally:
            skip_writes[0] = False

    def dropped(x: Any) -> Any:
        taps_as_outputs.collector.received = lambda *_: None  # type: ignore[method-assign]
        try:
            return tapped(x)
        finally:
            taps_as_outputs.collector.received = keep  # type: ignore[method-assign]

    def copied_in_dispatch(x: Any) -> Any:
        taps_as_outputs.Collector.copy_ahead = True
        try:
            return tapped(x)
        finally:
            taps_as_outputs.Collector.copy_ahead = False

    # The same step kept on JAX's Python path (its C++ path refused while it is first
    # called, so JAX keeps serving it from Python): what the way out cost before
    # tapd/emitter/outputs_fast_path.py.
    tapped_python = jax.jit(lambda x: tapd.id_tap(closure, x) * 1.0001)
    allowed = taps_as_outputs.OutputsEffect.fast_path_allowed
    taps_as_outputs.OutputsEffect.fast_path_allowed = lambda self: False  # type: ignore[method-assign]
    jax.block_until_ready(tapped_python(jnp.zeros(16, jnp.float32)))
    taps_as_outputs.OutputsEffect.fast_path_allowed = allowed  # type: ignore[method-assign]

    variants = {
        "untapped": untapped,
        "id_tap, JAX's Python path": tapped_python,
        "output floor": floor,
        "id_tap": tapped,
        "id_tap, copied in the dispatch": copied_in_dispatch,
        "id_tap, outputs dropped": dropped,
        "id_tap, fetched, not written": fetched_only,
        "jax.debug.callback": debug,
    }
    x = jnp.zeros(16, jnp.float32)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, function in variants.items():
            jax.block_until_ready(function(x))
            tapd.barrier_wait(timeout=120)
            start = time.perf_counter()
            for _ in range(args.calls):
                out = function(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            tapd.barrier_wait(timeout=120)
    us = {name: statistics.median(values) for name, values in times.items()}
    writes = {"median": statistics.median(write_us), "count": len(write_us)} if write_us else {}
    print(
        json.dumps(
            {
                "device": str(jax.devices()[0]),
                "us": us,
                "received": len(received),
                "write_us": writes,
            }
        )
    )
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            out = tapped(x)
        jax.block_until_ready(out)
        profile.disable()
        tapd.barrier_wait(timeout=120)
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
