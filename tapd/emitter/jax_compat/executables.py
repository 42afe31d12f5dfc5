"""Executables tapd makes and drops beside JAX's own: a lowered module without one of its
results, compiled for one device (a dormant computation's twin,
tapd/emitter/dormant_twin.py), and JAX's C++ dispatch caches cleared. Importing this
module does not import JAX.
"""

from __future__ import annotations

from typing import Any


def compile_for_device(module: bytes, device: Any) -> Any:
    """`module` (MLIR bytecode or text, lowered for one device as JAX lowers a `jit`)
    compiled and loaded on `device`, with the compile options JAX gives one device."""
    import numpy as np
    from jax._src import compiler

    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=1,
        device_assignment=np.array([[device]], dtype=object),
    )
    return device.client.compile_and_load(module, [device], options)


def without_result(module_bytes: bytes, result: int) -> bytes:
    """The module (bytecode) with its main function's `result` dropped: what a dormant
    call computes (tapd/emitter/dormant_twin.py: that result is its taps' way out). XLA
    then drops every tap's work as dead code; the parameters stay as they were, and an
    argument donated to a later result names that result's new place
    (`tf.aliasing_output`)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
    from jax._src.lib.mlir.dialects import func as func_dialect

    with mlir.make_ir_context():
        module = ir.Module.parse(module_bytes)
        main = next(
            op
            for op in module.body.operations
            if "sym_name" in op.attributes
            and ir.StringAttr(op.attributes["sym_name"]).value == "main"
        )
        returned = list(main.regions[0].blocks[0].operations)[-1]
        kept = [value for i, value in enumerate(returned.operands) if i != result]
        with ir.InsertionPoint(returned), ir.Location.unknown():
            func_dialect.ReturnOp(kept)
        returned.operation.erase()
        function = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        outputs = [t for i, t in enumerate(function.results) if i != result]
        main.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get(list(function.inputs), outputs)
        )
        if "res_attrs" in main.attributes:
            marks = ir.ArrayAttr(main.attributes["res_attrs"])
            main.attributes["res_attrs"] = ir.ArrayAttr.get(
                [attrs for i, attrs in enumerate(marks) if i != result]
            )
        if "arg_attrs" in main.attributes:
            marks = ir.ArrayAttr(main.attributes["arg_attrs"])
            main.attributes["arg_attrs"] = ir.ArrayAttr.get(
                [_aliasing_shifted(ir, ir.DictAttr(attrs), result) for attrs in marks]
            )
        return mlir.module_to_bytecode(module)


def _aliasing_shifted(ir: Any, marks: Any, dropped: int) -> Any:
    """An argument's attributes with its `tf.aliasing_output` (a donated argument's
    result) moved down past the `dropped` result."""
    if "tf.aliasing_output" not in marks:
        return marks
    output = ir.IntegerAttr(marks["tf.aliasing_output"]).value
    if output < dropped:
        return marks
    if output == dropped:
        raise RuntimeError("a donated argument aliases the way out")
    kept = {marks[i].name: marks[i].attr for i in range(len(marks))}
    kept["tf.aliasing_output"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), output - 1)
    return ir.DictAttr.get(kept)


_CPP_CACHES = ("_cpp_pjit_cache_fun_only", "_cpp_pjit_cache_explicit_attributes")


def drop_cpp_dispatch_caches() -> None:
    """Every jitted function's next call goes through Python again (JAX's C++ caches
    cleared, as `jax.clear_caches` clears them; nothing is compiled again). Safe from
    any thread: a call whose cache entry is being filled meanwhile fills one no longer
    in the cache (jaxlib's pjit.cc holds entries by shared pointer)."""
    from jax._src import pjit

    for name in _CPP_CACHES:
        cache = getattr(pjit, name, None)
        if cache is not None:
            cache.clear()


def can_drop_cpp_dispatch_caches() -> bool:
    """Whether this JAX has the C++ caches `drop_cpp_dispatch_caches` clears (what
    stops a dormant computation's twin: without them it has none)."""
    from jax._src import pjit

    return any(hasattr(getattr(pjit, name, None), "clear") for name in _CPP_CACHES)
