"""The flush of a gathered computation (`tapd.emitter.gathered`): one host callback that
takes the device buffers and writes each logged record, in program order, as the tap's
own host callback would have (`tapd.emitter.gathered.host`).

`flush_p` takes the buffers packed into one byte array (`pack`: the log's length, the
log, each site's count of dormant taps, every site's buffers) and returns the log's
new length, zero, made after the callback's transfer (an optimization barrier joins it
to the callback's token). On one device the flush that ends a live loop's chunk
answers (`FlushPlan.answers`): it also returns the sites' wake flags and the next
chunk's steps (tapd.emitter.gathered.live), and the device waits for that answer (the
host copies the bytes and answers; the outputs' thread writes them). Any other flush (a
full log's; every flush over several devices) returns nothing, and the device goes on
without waiting for the host (on a TPU: sends only). `poll_p` is the answer alone, where
a live chunk kept no tap.

Flushes run in the order they were traced: each carries `PROGRAM_ORDER`, tapd's
ordered effect (tapd.emitter.program_order), whose token JAX threads from flush to
flush through the loops and branches around them. (The zero alone does not order them:
XLA removes optimization barriers and folds the log's length wherever it is known when
the computation compiles, so that two flushes, one in a branch a constant selects, ran
in either order.) The token is made inside the computation (`program_order.call`, which
holds the whole gathered jaxpr), not taken from JAX's runtime: the computation keeps
JAX's fast dispatch path, as a computation of unordered taps does.

The end of a gathered computation is no flush where it can be an output
(tapd.emitter.taps_as_outputs): its `program_order.call` then has a `WayOut`, its
jaxpr takes the sites' wake flags first and returns the packed buffers last (`pack`),
and the same host function (`Flush`) writes them when they come out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
from jax import lax
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import host_writers, jax_compat, program_order
from tapd.emitter.gathered import host, module_pass
from tapd.emitter.primitive import PROGRAM_ORDER, TapSiteParams
from tapd.emitter.taps_as_outputs import OutputsEffect

# A jaxpr with its constants: core.ClosedJaxpr before JAX 0.12, core.Jaxpr since (which
# holds them); written as Any so that one annotation type-checks against both.
ClosedJaxpr: TypeAlias = Any


@dataclasses.dataclass(frozen=True)
class FlushPlan:
    """The buffers of one gathered computation; hashable (a primitive parameter)."""

    sites: tuple[TapSiteParams, ...]
    operand_avals: tuple[tuple[core.ShapedArray, ...], ...]  # per site: the tap's operands
    capacity: int  # records the log holds
    never_full: bool  # one run makes at most `capacity` records: flushed at its end only
    # Its records counted one in K for a site the device samples by its own `every=K`
    # (choose.most_kept): each call must bring the sites' flags, which sample.
    sampled_bound: bool = False
    # Each flush answers with the sites' wake flags and a live chunk's steps (on one
    # device: tapd.emitter.gathered.live), as does a poll; the host's pace of them.
    answers: bool = False
    pace: Any = dataclasses.field(default=None, compare=False, hash=False)

    def answer_aval(self) -> core.ShapedArray:
        """The host's answer: each site's wake flag, then the next chunk's steps."""
        return core.ShapedArray((len(self.sites) + 1,), np.dtype(np.int32))

    def flags_aval(self) -> core.ShapedArray:
        """A call's flags: the answer's, then each site's phase (gathered.sampling)."""
        return core.ShapedArray((2 * len(self.sites) + 1,), np.dtype(np.int32))


flush_p = core.Primitive("tapd_gathered_flush")
flush_p.multiple_results = True
dispatch.prim_requires_devices_during_lowering.add(flush_p)
# A live chunk's end that logged nothing: the host's answer alone (no buffers move).
poll_p = core.Primitive("tapd_gathered_poll")
dispatch.prim_requires_devices_during_lowering.add(poll_p)

_COUNT = core.ShapedArray((), np.dtype(np.int32))


def flush(state: Any, plan: FlushPlan, steps: Any, polls: Any, *, answer: bool) -> tuple[Any, Any]:
    """Flush `state` (a `gathered.Gathered`); returns the log's new length (0) and,
    where the plan's flushes answer and `answer` asks, the host's answer
    (`FlushPlan.answer_aval`) to a chunk of `steps` (the call's answer number `polls`);
    else None (the flush only sends)."""
    if plan.answers and not answer:
        plan = dataclasses.replace(plan, answers=False)
    operands = [pack(state), *([_ask(steps, polls)] if plan.answers else [])]
    results = flush_p.bind(*operands, plan=plan)  # type: ignore[no-untyped-call]
    return results[0], results[1] if plan.answers else None


def poll(plan: FlushPlan, steps: Any, polls: Any) -> Any:
    """The host's answer to a live chunk of `steps` that logged nothing."""
    return poll_p.bind(_ask(steps, polls), plan=plan)  # type: ignore[no-untyped-call]


def _ask(steps: Any, polls: Any) -> Any:
    parts = [lax.broadcast(lax.convert_element_type(v, np.int32), (1,)) for v in (steps, polls)]
    return lax.concatenate(parts, 0)


def pack(state: Any) -> Any:
    """`state` (a `gathered.Gathered`) as the bytes the host reads (gathered.host)."""
    buffers = [buffer for site in state.buffers for buffer in site]
    return host.pack(state.count, state.log, state.order, state.skipped, buffers)


@flush_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _abstract_eval(*avals: Any, plan: FlushPlan) -> tuple[list[core.ShapedArray], set[Any]]:
    return [_COUNT, *([plan.answer_aval()] if plan.answers else [])], {PROGRAM_ORDER}


@poll_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _poll_abstract_eval(ask: Any, plan: FlushPlan) -> tuple[core.ShapedArray, set[Any]]:
    return plan.answer_aval(), {PROGRAM_ORDER}


def _lower(ctx: mlir.LoweringRuleContext, *operands: Any, plan: FlushPlan) -> list[Any]:
    module = ctx.module_context
    # Inside a shard_map or pmap body each device flushes its own log: the callback
    # then also takes the device's index (gathered.slices).
    device_operand = host_writers.partition_index(ctx)
    host_function: Any
    if device_operand is None:
        host_function = _host_function(ctx, plan)
        values: list[Any] = []
        index_avals: list[Any] = []
    else:
        host_function = _per_device_function(ctx, plan)
        values, index_avals = device_operand
    avals = [*ctx.avals_in, *index_avals]
    if plan.answers:  # (one device: no index)
        answer, token = _answering(ctx, plan, host_function.answered, list(operands))
        zero = _after(token, np.int32(0))
        return [zero, answer]
    callback_ctx = dataclasses.replace(ctx, avals_in=avals, avals_out=[])
    token = jax_compat.emit_python_callback(
        callback_ctx,
        host_function,
        ctx.tokens_in.get(PROGRAM_ORDER),
        [*operands, *values],
        avals,
        returns_token=False,
        sharding=jax_compat.callback_op_sharding(module.axis_context, None),
    )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({PROGRAM_ORDER: token})))
    return [_after(token, np.int32(0))]


def _after(token: Any, value: Any) -> Any:
    """`value`, made after the callback whose token is `token` (joined by an
    optimization barrier): the log is written again only once its flush has read it."""
    joined = hlo.OptimizationBarrierOp([token, mlir.ir_constant(value)])
    return joined.results[1]


def _answering(
    ctx: mlir.LoweringRuleContext, plan: FlushPlan, host_function: Any, operands: list[Any]
) -> tuple[Any, Any]:
    """A host callback (in program order) whose result is the host's answer; returns
    (the answer, the new token)."""
    answer_aval = plan.answer_aval()
    callback_ctx = dataclasses.replace(ctx, avals_out=[answer_aval])
    answer, token = jax_compat.emit_python_callback_with_result(
        callback_ctx,
        host_function,
        ctx.tokens_in.get(PROGRAM_ORDER),
        operands,
        list(ctx.avals_in),
        answer_aval,
        sharding=jax_compat.callback_op_sharding(ctx.module_context.axis_context, None),
    )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({PROGRAM_ORDER: token})))
    return answer, token


def _lower_poll(ctx: mlir.LoweringRuleContext, ask: Any, plan: FlushPlan) -> list[Any]:
    answer, _ = _answering(ctx, plan, _host_function(ctx, plan).poll, [ask])
    return [answer]


def _host_function(ctx: mlir.LoweringRuleContext, plan: FlushPlan, index: int = 0) -> host.Flush:
    """What writes the computation's packed buffers (on the host), for the device at
    `index` of its device assignment."""
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    devices_at = host_writers.DeviceOrdinals(host_writers.local_ordinals(ctx), index)
    assert devices_at.fixed is not None
    sites = [
        host.SiteWriter(site, avals, platform, devices_at)
        for site, avals in zip(plan.sites, plan.operand_avals, strict=True)
    ]
    return host.Flush(sites, devices_at.fixed, plan.capacity, plan.operand_avals, plan.pace)


def _per_device_function(ctx: mlir.LoweringRuleContext, plan: FlushPlan) -> host.PerDevice:
    """The host function of a flush every device of a shard_map or pmap body runs, each
    on its own log: the writer of the device its last operand names. Those of this
    process's devices are made now, registering the sites as the computation lowers
    (as a per-tap lowering does: a site registered late may find no slot left in the
    ring's site table)."""
    local = [i for i, ordinal in enumerate(host_writers.local_ordinals(ctx)) if ordinal >= 0]
    devices = host_writers.device_assignment(ctx)
    return host.PerDevice(lambda index: _host_function(ctx, plan, index), local, devices)


jax_compat.register_lowering(flush_p, _lower)
jax_compat.register_lowering(poll_p, _lower_poll)


# ---- the gathered computation, which makes its flushes' token ---------------------------


@dataclasses.dataclass(eq=False)
class WayOut:
    """A gathered computation that ends with an output: its effect (whose token slot
    carries the flags in and the packed buffers out) and its buffers. The `Exit` of its
    `program_order.call`: the wake flags in first, the packed buffers out last."""

    effect: OutputsEffect
    plan: FlushPlan
    # Over several devices: the plan is each device's (a shard_map body's), and each
    # device's packed buffers leave as its shard of the output (gathered.slices).
    per_device: bool = False
    _placeholder: Any = dataclasses.field(default=None, init=False)  # (as it lowers)

    def operands(self, ctx: mlir.LoweringRuleContext) -> list[Any]:
        if self.per_device:
            self.effect.receiver = _per_device_function(ctx, self.plan)
        else:
            self.effect.receiver = _host_function(ctx, self.plan)
        (flag_count,) = self.plan.flags_aval().shape
        self._placeholder = module_pass.placeholder(flag_count)
        return [self._placeholder.results[0]]

    def done(self, result: Any) -> None:
        module_pass.note(module_pass.Joints(self._placeholder, result))


def call(jaxpr: ClosedJaxpr, args: Sequence[Any], way_out: WayOut | None = None) -> list[Any]:
    """`jaxpr` (a gathered computation, its flushes ordered by `PROGRAM_ORDER`) applied
    to `args`, with the token of its flushes made inside: to JAX, an unordered tap. With
    a `way_out`, `jaxpr` takes the wake flags first and returns the packed buffers last."""
    return program_order.call(jaxpr, args, way_out)
