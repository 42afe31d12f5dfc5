"""The fallback order of a tap that found no program-order token: its block's chain.

A computation's ordered taps thread `PROGRAM_ORDER`'s token, which JAX passes through
every loop, branch and call (tapd.emitter.program_order). A tap lowered where no lowering
rule passed that token in (a primitive of JAX's that does not thread ordered effects
into its regions) still keeps its order among the taps of its own block (a function
body, a loop's body or condition, a branch): each takes the token the block's previous
tap returned (`before_tap`, `after_tap`).
"""

from __future__ import annotations

import threading
from typing import Any

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]


class _Lowering(threading.local):
    """The chains of the module this thread lowers (lowering is per thread)."""

    context: Any = None
    tokens: dict[Any, Any]  # block -> the token of its last ordered tap


_lowering = _Lowering()


def before_tap(ctx: mlir.LoweringRuleContext) -> Any:
    """The token a tap lowered at the current insertion point takes."""
    # (per MLIR module: JAX lowers a nested pmap or shard_map with a module context of
    # its own, into the same module)
    if _lowering.context is not ctx.module_context.module:
        _lowering.context = ctx.module_context.module
        _lowering.tokens = {}
    block = ir.InsertionPoint.current.block
    token = _lowering.tokens.get(block)
    if token is None:
        token = hlo.create_token()
    return token


def after_tap(ctx: mlir.LoweringRuleContext, token: Any) -> None:
    """Record the ordered tap just emitted, whose custom call returned `token`."""
    del ctx
    _lowering.tokens[ir.InsertionPoint.current.block] = token
