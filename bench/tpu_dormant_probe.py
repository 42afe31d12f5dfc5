"""Where a dormant gathered call's cost goes, on a TPU (issue 51: "dormant taps move
nothing").

    TAPD_GATHER=on python bench/tpu_dormant_probe.py [--calls N] [--rounds N]

One process, a jitted `fori_loop` of 8 steps over 64 KiB of float32 (the grid's
64 KiB x 8 cell), µs a call (dispatching `calls` calls, then waiting for the last),
medians of interleaved rounds:

- `untapped`: the loop alone;
- `+ rows output, dropped`: the loop returning its 8 rows as `scan` outputs, never read
  (what an output of the log's size costs the call, unfetched);
- `+ 64 B output, dropped`: a second output of 16 float32, never read;
- `dormant`: the loop tapping each row to a site nobody takes (gathered: on JAX's C++
  path, tapd/emitter/outputs_fast_path.py), called until its twin serves it
  (tapd/emitter/dormant_twin.py: compiled without the taps);
- `dormant, no hook`: the same with the output's Python hook doing nothing (the
  dispatch and the execution of the tapped executable alone: no twin ever comes);
- `two outputs`, `two outputs + 64 B output, dropped`, `dormant, two outputs`: the
  same, the step returning two arrays (as most training steps return several): what one
  more output costs a call that already returns more than one;
- `dormant, 5 calls a barrier`: as bench/tpu_live.py times it (5 calls, then
  `barrier_wait`), with `untapped` likewise, to see that measure's spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--elements", type=int, default=2**14)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    from jax import lax
    from tpu_live import settle_twins

    import tapd
    from tapd.emitter import dormant_twin, outputs_fast_path

    steps = args.steps

    def body(i: Any, x: Any) -> Any:
        return x * 0.999 + 0.001

    untapped = jax.jit(lambda x: lax.fori_loop(0, steps, body, x))
    rows = jax.jit(lambda x: lax.scan(lambda c, _: (body(0, c), c), x, length=steps))
    small = jax.jit(lambda x: (lax.fori_loop(0, steps, body, x), x[:16]))
    dormant = jax.jit(
        lambda x: lax.fori_loop(0, steps, lambda i, x: tapd.tap(body(i, x), "nobody"), x)
    )
    dormant_bare = jax.jit(
        lambda x: lax.fori_loop(0, steps, lambda i, x: tapd.tap(body(i, x), "nobody2"), x)
    )
    pair = jax.jit(lambda x: (lax.fori_loop(0, steps, body, x), x * 2.0))
    pair_small = jax.jit(lambda x: (lax.fori_loop(0, steps, body, x), x * 2.0, x[:16]))
    pair_dormant = jax.jit(
        lambda x: (
            lax.fori_loop(0, steps, lambda i, x: tapd.tap(body(i, x), "nobody3"), x),
            x * 2.0,
        )
    )
    hook = outputs_fast_path._arrived

    def no_hook(x: Any) -> Any:
        outputs_fast_path._arrived = lambda effect, packed: None  # type: ignore[assignment]
        try:
            return dormant_bare(x)
        finally:
            outputs_fast_path._arrived = hook  # type: ignore[assignment]

    variants = {
        "untapped": untapped,
        "+ rows output, dropped": rows,
        "+ 64 B output, dropped": small,
        "dormant": dormant,
        "dormant, no hook": no_hook,
        "two outputs": pair,
        "two outputs + 64 B output, dropped": pair_small,
        "dormant, two outputs": pair_dormant,
    }
    x = jnp.zeros(args.elements, jnp.float32)
    for function in variants.values():
        for _ in range(3):
            jax.block_until_ready(function(x))
    settle_twins([dormant, pair_dormant], x)
    served, twin_served = outputs_fast_path.calls_served(), dormant_twin.calls_served()
    times: dict[str, list[float]] = {name: [] for name in variants}
    barrier: dict[str, list[float]] = {"untapped": [], "dormant": []}
    for _ in range(args.rounds):
        for name, function in variants.items():
            tapd.barrier_wait(timeout=120)
            start = time.perf_counter()
            for _ in range(args.calls):
                out = function(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        for name in barrier:
            function = variants[name]
            start = time.perf_counter()
            for _ in range(5):
                out = function(x)
            jax.block_until_ready(out)
            tapd.barrier_wait(timeout=120)
            barrier[name].append((time.perf_counter() - start) / 5 * 1e6)
    print(
        json.dumps(
            {
                "device": str(jax.devices()[0]),
                "cell": f"{args.elements * 4} B x {steps}",
                "us": {name: round(statistics.median(v), 1) for name, v in times.items()},
                "us_all": {name: [round(t, 1) for t in v] for name, v in times.items()},
                "five_then_barrier_us": {
                    name: [round(t, 1) for t in v] for name, v in barrier.items()
                },
                "fast_calls": outputs_fast_path.calls_served() - served,
                "twin_calls": dormant_twin.calls_served() - twin_served,
            }
        )
    )


if __name__ == "__main__":
    main()
