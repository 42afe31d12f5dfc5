"""The module pass of a gathered computation's way out (`tapd.emitter.taps_as_outputs`).

JAX lowers a module whose ordered effects include an `OutputsEffect` with one more token
argument and one more token result for it (the last of each, as the effect is the last
of `ordered_effects`), the one passed straight to the other: nothing in the computation
uses that effect. The gathered computation's lowering (`flush.WayOut`)
meanwhile leaves a placeholder where it reads the wake flags and notes the value of its
packed buffers (`note`). `attach` then joins them: the argument becomes the flags
(int32[sites]) and replaces the placeholder, the result becomes the packed buffers, and
neither is marked a token any more. JAX's execution hands the argument in and the
result out as it does a token's (`RuntimeTokenSet`), which tapd intercepts.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]

PLACEHOLDER_TARGET = "tapd_gathered_wake_flags"


@dataclasses.dataclass
class Joints:
    """What one module's gathered computation left for `attach`."""

    placeholder: Any  # the op standing for the wake flags
    packed: Any  # the value of the packed buffers


_noted = threading.local()


def start() -> None:
    _noted.way_out = None


def note(joints: Joints) -> None:
    _noted.way_out = joints


def taken() -> Joints | None:
    joints: Joints | None = getattr(_noted, "way_out", None)
    _noted.way_out = None
    return joints


def placeholder(flag_count: int) -> Any:
    """The op that stands for the wake flags until `attach` (a custom call no backend
    has: one left behind fails the compilation, never runs wrong)."""
    flags = ir.RankedTensorType.get([flag_count], ir.IntegerType.get_signless(32))
    return mlir.custom_call(PLACEHOLDER_TARGET, result_types=[flags], operands=[])


def attach(module: Any, way_out: Joints) -> int:
    """Join `way_out` to the module's main function (see the module docstring); returns
    the position of its result (the packed buffers) among the function's results."""
    main = _main(module)
    block = main.regions[0].blocks[0]
    arguments = _token_positions(main, "arg_attrs")
    results = _token_positions(main, "res_attrs")
    if not arguments or not results:
        raise RuntimeError("no token for the gathered computation's way out")
    argument, result = arguments[-1], results[-1]
    flags = block.arguments[argument]
    (flags_value,) = way_out.placeholder.results
    flags.set_type(flags_value.type)
    flags_value.replace_all_uses_with(flags)
    way_out.placeholder.operation.erase()
    returned = list(block.operations)[-1]
    returned.operands[result] = way_out.packed
    function = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    inputs, outputs = list(function.inputs), list(function.results)
    inputs[argument] = flags.type
    outputs[result] = way_out.packed.type
    main.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, outputs))
    _untoken(main, "arg_attrs", argument)
    _untoken(main, "res_attrs", result)
    return result


def _main(module: Any) -> Any:
    for op in module.body.operations:
        if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise RuntimeError("the module has no main function")


def _token_positions(main: Any, which: str) -> list[int]:
    if which not in main.attributes:
        return []
    return [
        i
        for i, attrs in enumerate(ir.ArrayAttr(main.attributes[which]))
        if "jax.token" in ir.DictAttr(attrs)
    ]


def _untoken(main: Any, which: str, position: int) -> None:
    """Drop the `jax.token` mark of one argument or result."""
    every = [ir.DictAttr(attrs) for attrs in ir.ArrayAttr(main.attributes[which])]
    marks = every[position]
    named = [marks[i] for i in range(len(marks))]
    kept = {mark.name: mark.attr for mark in named if mark.name != "jax.token"}
    every[position] = ir.DictAttr.get(kept)
    main.attributes[which] = ir.ArrayAttr.get(every)
