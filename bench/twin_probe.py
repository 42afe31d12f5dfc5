"""Can a dormant gathered call run an executable without its taps? (issue 51: what is
left of a dormant call is JAX's cost of a second output, bench/tpu_dormant_probe.py)

    TAPD_GATHER=on TAPD_BACKEND=portable python bench/twin_probe.py [--calls N]

A gathered computation's module is `main(flags, *args) -> (packed, *outputs)`
(tapd/emitter/gathered/module_pass.py). This probe takes that module as lowered, drops
its first result (the packed buffers), and compiles it: XLA then drops every tap's write
and the packing as dead code, and the parameters stay the tapped executable's, so JAX's
C++ path data of the tapped computation serves it with only its `xla_executable`
swapped and its first output dropped. It checks the results against the untapped
function's and times the untapped step, the tapped one on the C++ path, and the "twin"
on the C++ path, µs a call.

What it does not do, and a real twin would need: count each call's dormant taps (a
root of the output tree, as tapd/emitter/outputs_fast_path.py has), and see a wake
before a call is dispatched (no Python runs before a call on the C++ path: a site woken
in the ring's table by the daemon is seen only as the call returns).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import compiler
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func as func_dialect

import tapd
from tapd.emitter import outputs_fast_path


def without_first_result(text: str) -> str:
    """The module `text` with its main function's first result dropped."""
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        main = next(
            op for op in module.body.operations if op.attributes["sym_name"].value == "main"
        )
        returned = list(main.regions[0].blocks[0].operations)[-1]
        with ir.InsertionPoint(returned), ir.Location.unknown():
            func_dialect.ReturnOp(list(returned.operands)[1:])
        returned.operation.erase()
        signature = ir.FunctionType(main.type)
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(signature.inputs, signature.results[1:])
        )
        if "res_attrs" in main.attributes:
            main.attributes["res_attrs"] = ir.ArrayAttr.get(list(main.attributes["res_attrs"])[1:])
        return str(module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--elements", type=int, default=16, help="float32 a tap")
    args = parser.parse_args()
    steps = args.steps

    def body(i: Any, c: Any) -> Any:
        return c * 0.5 + 1.0

    untapped = jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    def tapping(site: str) -> Any:
        return jax.jit(
            lambda x: lax.fori_loop(0, steps, lambda i, c: tapd.tap(body(i, c), site), x)
        )

    tapped, twin_call = tapping("nobody"), tapping("none")
    x = jnp.arange(args.elements, dtype=jnp.float32)
    device = jax.devices()[0]
    twin = device.client.compile_and_load(
        without_first_result(twin_call.lower(x).as_text()),
        jax.devices()[:1],
        compiler.get_compile_options(num_replicas=1, num_partitions=1),
    )
    for _ in range(3):  # (the tapped step's own C++ path, made before the swap below)
        jax.block_until_ready(tapped(x))
    made = outputs_fast_path._fast_path

    def fast_path(original: Any, executable: Any, effects: Any, rest: Any, kwargs: Any) -> Any:
        data = made(original, executable, effects, rest, kwargs)
        if data is None:
            return data
        return data._replace(
            xla_executable=twin,
            out_pytree_def=data.out_pytree_def.children()[1],  # (below tapd's root)
            out_shardings=data.out_shardings[1:],
            out_avals=data.out_avals[1:],
            out_committed=data.out_committed[1:],
        )

    outputs_fast_path._fast_path = fast_path  # type: ignore[assignment]
    for _ in range(3):
        jax.block_until_ready(twin_call(x))
    want = np.asarray(untapped(x))
    same = all(np.array_equal(np.asarray(twin_call(x)), want) for _ in range(5))
    times: dict[str, list[float]] = {"untapped": [], "tapped, dormant": [], "twin": []}
    functions = {"untapped": untapped, "tapped, dormant": tapped, "twin": twin_call}
    for _ in range(args.rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                out = function(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    print(f"device {device}, JAX {jax.__version__}; the twin's results as untapped: {same}")
    lines = {
        "untapped": untapped.lower(x).compile().as_text().count("\n"),
        "tapped": tapped.lower(x).compile().as_text().count("\n"),
        "twin": twin.hlo_modules()[0].to_string().count("\n"),
    }
    print(f"lines of optimized HLO: {lines}")
    for name, values in times.items():
        print(f"  {name:16s} {statistics.median(values):8.2f} µs a call")


if __name__ == "__main__":
    main()
