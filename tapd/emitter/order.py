"""Program order for taps that keep JAX's fast dispatch path: tapd's own token.

A tap that is not strict has no JAX-level ordering (`tapd.emitter.primitive`), so XLA
would schedule it wherever its operands allow: before a loop written above it, say.
tapd makes the order a data dependence inside the XLA computation instead, in two steps.

While JAX lowers, each ordered tap's custom call takes a token and returns one; the taps
of one block (a function body, a loop's body or condition, a branch) form a chain, each
taking the token of the previous one (`before_tap`, `after_tap`).

Once the module is lowered (`order_module`, run through `jax_compat.wrap_module_lowering`), an
operation of a block whose regions tap (the `while` of a scan or loop, the `case` of a
cond) or a call of a function that taps is a *tapping operation*, and is ordered within
its block's chain with two custom calls of tapd's order handler, which does nothing:
- before it, one that takes the chain's token and an operand of the operation (the
  smallest), and returns that operand (aliased: no copy), which the operation then
  reads: the operation comes after the taps before it;
- after it, one that takes the operation's results and returns the token the block's
  next tap takes: those taps come after the operation. (A `case` with no results, a
  cond whose results nobody uses, is rebuilt to return its branch's last token.)

Where the module is partitioned (a sharded `jit` over several devices) or the platform
has no order handler (TPU), only the chains hold: the taps of each block keep their
order, and `ordered="strict"` orders the rest with JAX's runtime token.

A module may hold both kinds: taps of tapd's chain, and strict taps threading JAX's
token (a `jit` around a `pmap` whose `id_tap`s are strict, `tapd.emitter.host_callback`).
`join_chains` then joins the two in each block, which needs no handler and holds in a
partitioned module too: an operation that takes JAX's token (a strict tap, a call or a
`pmap`/`shard_map` region threading it) takes it joined (`after_all`) with the token of
the block's tapd taps before it, and the tapd tap after it takes its chain's token
joined with the JAX token that operation returned.
"""

from __future__ import annotations

import threading
from typing import Any

from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter.native_backend import ORDER_TARGET

_MARK = "tapd.ordered_tap"  # on each ordered tap's custom call
# The tapping operations an order call may precede: their operands are plain values.
_PRECEDABLE = frozenset({"stablehlo.while", "stablehlo.case", "stablehlo.if", "func.call"})


class _Lowering(threading.local):
    """The chains of the module this thread lowers (lowering is per thread)."""

    context: Any = None
    tokens: dict[Any, Any]  # block -> the token of its last ordered tap
    taps: int = 0  # ordered taps lowered since `start_module`
    strict: int = 0  # strict taps (JAX's token) lowered since `start_module`


_lowering = _Lowering()


def start_module() -> None:
    _lowering.taps = 0
    _lowering.strict = 0


def lowered_taps() -> int:
    return _lowering.taps


def strict_tap_lowered() -> None:
    """Count a strict tap (one that threads JAX's token) lowered into this module."""
    _lowering.strict += 1


def lowered_strict_taps() -> int:
    return _lowering.strict


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
    token.owner.attributes[_MARK] = ir.UnitAttr.get()
    _lowering.taps += 1


def mark_tap(operation: Any) -> None:
    """Mark `operation`, which takes its block's chain token first and returns the next,
    a tap of that chain (the question a guarded portable tap asks first)."""
    operation.attributes[_MARK] = ir.UnitAttr.get()


# ---- once the module is lowered -----------------------------------------------------


def order_module(module: Any) -> None:
    """Order each block's tapping operations within its chain (see the module doc)."""
    functions = [op for op in module.body.operations if op.operation.name == "func.func"]
    tapping = _tapping_functions(functions)
    for function in functions:
        for block in function.regions[0].blocks:
            _order_block(block, tapping)


def partitions(module: Any) -> int:
    attributes = module.operation.attributes
    if "mhlo.num_partitions" not in attributes:
        return 1
    return int(ir.IntegerAttr(attributes["mhlo.num_partitions"]).value)


def _symbol(function: Any) -> str:
    return str(ir.StringAttr(function.attributes["sym_name"]).value)


def _tapping_functions(functions: list[Any]) -> set[str]:
    """The functions that tap, directly or through what they call."""
    tapping: set[str] = set()
    changed = True
    while changed:
        changed = False
        for function in functions:
            name = _symbol(function)
            if name not in tapping and _taps_within(function.operation, tapping):
                tapping.add(name)
                changed = True
    return tapping


def _taps_within(operation: Any, tapping: set[str]) -> bool:
    for region in operation.regions:
        for block in region.blocks:
            for inner in block.operations:
                if _is_tapping(inner.operation, tapping):
                    return True
    return False


def _is_tap(operation: Any) -> bool:
    return _MARK in operation.attributes


def _is_tapping(operation: Any, tapping: set[str]) -> bool:
    if _is_tap(operation):
        return True
    if operation.name == "func.call":
        callee = ir.FlatSymbolRefAttr(operation.attributes["callee"]).value
        return callee in tapping
    return _taps_within(operation, tapping)


def _order_block(block: Any, tapping: set[str]) -> Any:
    """Order `block`'s taps and tapping operations; returns the token its last tap (or
    the order call after its last tapping operation) gave, None if it has none."""
    chain = None  # the token the block's next tap takes
    after: Any = None  # a tapping operation since that token, whose results come first
    for op in list(block.operations):
        operation = op.operation
        if not _is_tapping(operation, tapping):
            continue
        if after is not None:
            chain, after = _follow(block, after, chain), None
        if _is_tap(operation):
            if chain is not None and _takes_token_first(operation):
                operation.operands[0] = chain
            chain = _token_result(operation)
            continue
        inner = [
            _order_block(inner_block, tapping)
            for region in operation.regions
            for inner_block in region.blocks
        ]
        if chain is not None and operation.name in _PRECEDABLE:
            _precede(operation, chain)
        if not len(operation.results) and operation.name == "stablehlo.case":
            operation = _case_with_token(operation, inner)
        if len(operation.results):
            after = operation
    if after is not None:
        chain = _follow(block, after, chain)
    return chain


def join_chains(module: Any) -> None:
    """Join tapd's chain and JAX's token in every block of `module` (see the module
    docstring): after `order_module`, if it ran."""
    for op in module.body.operations:
        if op.operation.name == "func.func":
            for block in op.operation.regions[0].blocks:
                _join_block(block)


def _join_block(block: Any) -> None:
    """One block's joins (and, first, those of the blocks nested in its operations).

    `tapd_token`: the token of the block's last tapd tap that no operation taking JAX's
    token has taken since; `jax_tokens`: the JAX tokens the block's last such operation
    returned, which no tapd tap has taken since. Each join takes tokens defined earlier
    in the block, so no cycle is made."""
    tapd_token: Any = None
    jax_tokens: list[Any] = []
    operations = [op.operation for op in block.operations]
    for position, operation in enumerate(operations):
        for region in operation.regions:
            for inner in region.blocks:
                _join_block(inner)
        if _is_tap(operation):
            if jax_tokens and _takes_token_first(operation):
                operation.operands[0] = _after_all(operation, [operation.operands[0], *jax_tokens])
                jax_tokens = []
            given_token = _token_result_or_none(operation)
            if given_token is not None:
                tapd_token = given_token
            continue
        if operation.name in _TOKEN_MAKERS or _is_order_call(operation):
            continue
        # JAX's token, taken (as an operand, or from above by a cond's branches) and,
        # unless the operation ends the block, given back, or returned from the block:
        # after the tapd taps before it.
        if tapd_token is not None:
            taken = [
                index for index, value in enumerate(operation.operands) if _is_token(value.type)
            ]
            for index in taken:
                operation.operands[index] = _after_all(
                    operation, [operation.operands[index], tapd_token]
                )
            if _join_captured(operation, tapd_token) or taken:
                tapd_token = None
        if position == len(operations) - 1:
            continue  # (the block's terminator)
        given = [result for result in operation.results if _is_token(result.type)]
        if given:
            jax_tokens = given


def _join_captured(operation: Any, tapd_token: Any) -> bool:
    """Have the operations inside `operation`'s regions that take a token defined
    outside it (a `case` whose branches take JAX's token from above) take it joined
    with `tapd_token`; whether there were any."""
    joined: list[tuple[Any, Any]] = []  # (a captured token, its join)
    for inner, index, value in _captured_tokens(operation, operation):
        join = next((new for old, new in joined if old == value), None)
        if join is None:
            join = _after_all(operation, [value, tapd_token])
            joined.append((value, join))
        inner.operands[index] = join
    return bool(joined)


def _captured_tokens(operation: Any, outer: Any) -> list[tuple[Any, int, Any]]:
    """(operation, operand index, token) of each token that an operation nested in
    `operation`'s regions takes from outside `outer`."""
    found: list[tuple[Any, int, Any]] = []
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                inner = op.operation
                for index, value in enumerate(inner.operands):
                    if _is_token(value.type) and not _defined_within(value, outer):
                        found.append((inner, index, value))
                found += _captured_tokens(inner, outer)
    return found


def _defined_within(value: Any, operation: Any) -> bool:
    """Whether `value` is defined inside `operation`'s regions."""
    owner = value.owner
    parent = owner.owner if isinstance(owner, ir.Block) else owner
    while parent is not None:
        parent = parent.operation
        if parent == operation:
            return True
        parent = parent.parent
    return False


# Operations that make tokens of nothing but tokens (tapd's chains start with one).
_TOKEN_MAKERS = frozenset({"stablehlo.after_all", "stablehlo.create_token"})


def _is_order_call(operation: Any) -> bool:
    if operation.name != "stablehlo.custom_call":
        return False
    target = operation.attributes["call_target_name"]
    return bool(ir.StringAttr(target).value == ORDER_TARGET)


def _after_all(operation: Any, tokens: list[Any]) -> Any:
    """A token after all of `tokens`, made just before `operation`."""
    with ir.InsertionPoint(operation), operation.location:
        return hlo.after_all(tokens)


def _token_result_or_none(operation: Any) -> Any:
    for result in operation.results:
        if _is_token(result.type):
            return result
    return None


def _is_token(value_type: Any) -> bool:
    return bool(hlo.TokenType.isinstance(value_type))


def _case_with_token(case: Any, tokens: list[Any]) -> Any:
    """The result-less `case` (a cond whose results nobody uses) rebuilt to return a
    token, the last of its branch's taps': something the taps after it can take."""
    with ir.InsertionPoint(case), case.location:
        rebuilt = hlo.CaseOp([hlo.TokenType.get()], case.operands[0], len(case.regions))
    for old, new, token in zip(case.regions, rebuilt.regions, tokens, strict=True):
        block = old.blocks[0]
        block.append_to(new)
        terminator = list(block.operations)[-1].operation
        with ir.InsertionPoint(terminator), case.location:
            returned = token if token is not None else hlo.create_token()
            hlo.ReturnOp([*terminator.operands, returned])
        terminator.erase()
    case.erase()
    return rebuilt.operation


def _takes_token_first(operation: Any) -> bool:
    operands = operation.operands
    return len(operands) > 0 and bool(hlo.TokenType.isinstance(operands[0].type))


def _token_result(operation: Any) -> Any:
    for result in operation.results:
        if hlo.TokenType.isinstance(result.type):
            return result
    raise AssertionError(f"tapd: an ordered tap without a token result: {operation}")


def _precede(operation: Any, token: Any) -> None:
    """Make `operation` read its smallest operand through an order call that takes
    `token`."""
    candidates = [
        (_bytes(value.type), index)
        for index, value in enumerate(operation.operands)
        if _is_tensor(value.type)
    ]
    if not candidates:
        return
    _, index = min(candidates)
    value = operation.operands[index]
    with ir.InsertionPoint(operation), operation.location:
        call = mlir.custom_call(
            ORDER_TARGET,
            result_types=[value.type],
            operands=[token, value],
            backend_config={},
            api_version=4,
            operand_output_aliases={1: 0},
        )
    operation.operands[index] = call.results[0]


def _follow(block: Any, operation: Any, token: Any) -> Any:
    """An order call just after `operation`, taking its results (and `token`); returns
    the token it gives."""
    operands = [*([token] if token is not None else []), *operation.results]
    # (a tapping operation after the last tap of a block gets no such call)
    with ir.InsertionPoint.at_block_terminator(block), operation.location:
        call = mlir.custom_call(
            ORDER_TARGET,
            result_types=[hlo.TokenType.get()],
            operands=operands,
            backend_config={},
            api_version=4,
        )
    made: Any = getattr(call, "operation", call)  # (an OpView, or already an Operation)
    made.move_after(operation)
    return made.results[0]


def _is_tensor(value_type: Any) -> bool:
    # (MLIR's bindings have `RankedTensorType.isinstance` up to jaxlib 0.9, and give
    # typed values, which `isinstance` tells, after)
    check = getattr(ir.RankedTensorType, "isinstance", None)
    if check is not None:
        return bool(check(value_type))
    return isinstance(value_type, ir.RankedTensorType)


def _bytes(tensor_type: Any) -> int:
    tensor = ir.RankedTensorType(tensor_type)
    count = 1
    for size in tensor.shape:
        count *= size
    width = getattr(tensor.element_type, "width", 32)
    return count * max(1, width // 8)
