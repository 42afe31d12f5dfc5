"""The flush of a gathered computation (`tapd.emitter.gathered`): one host callback that
takes the device buffers and writes each logged record, in program order, as the tap's
own host callback would have (`tapd.emitter.gathered_host`).

`flush_p` takes the buffers packed into one byte array (`pack`: the log's length, the
log, each site's count of dormant taps, every site's buffers) and returns the log's
new length, zero, made after the callback's transfer (an optimization barrier joins it
to the callback's token). The callback returns nothing to the device, which goes on
without waiting for the host (on a TPU: sends only, no receive).

Flushes run in the order they were traced: each carries `GatherOrder`, an ordered
effect, whose token JAX threads from flush to flush through the loops and branches
around them. (The zero alone does not order them: XLA removes optimization barriers
and folds the log's length wherever it is known when the computation compiles, so
that two flushes, one in a branch a constant selects, ran in either order.) The token
is made inside the computation (`gathered_call_p`, which holds the whole gathered
jaxpr), not taken from JAX's runtime: the computation keeps JAX's fast dispatch path,
as a computation of unordered taps does.

The end of a gathered computation is no flush where it can be an output
(tapd.emitter.gathered_outputs): `gathered_call_p` then has a `WayOut`, its jaxpr takes
the sites' wake flags first and returns the packed buffers last (`pack`), and the same
host function (`Flush`) writes them when they come out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import gathered_host, gathered_module, host_writers, jax_compat
from tapd.emitter.gathered_outputs import OutputsEffect
from tapd.emitter.primitive import UNORDERED, TapSiteParams

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


class GatherOrder(effects.Effect):
    """The order of one gathered computation's flushes (see the module docstring)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    __str__ = lambda _: "tapd.gathered_flush"  # noqa: E731


GATHER_ORDER = GatherOrder()
effects.ordered_effects.add_type(GatherOrder)
effects.lowerable_effects.add_type(GatherOrder)
effects.control_flow_allowed_effects.add_type(GatherOrder)

flush_p = core.Primitive("tapd_gathered_flush")
dispatch.prim_requires_devices_during_lowering.add(flush_p)

_COUNT = core.ShapedArray((), np.dtype(np.int32))


def flush(state: Any, plan: FlushPlan) -> Any:
    """Flush `state` (a `gathered.Gathered`); returns the log's new length (0)."""
    return flush_p.bind(pack(state), plan=plan)  # type: ignore[no-untyped-call]


def pack(state: Any) -> Any:
    """`state` (a `gathered.Gathered`) as the bytes the host reads (gathered_host)."""
    buffers = [buffer for site in state.buffers for buffer in site]
    return gathered_host.pack(state.count, state.log, state.skipped, buffers)


@flush_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _abstract_eval(*avals: Any, plan: FlushPlan) -> tuple[core.ShapedArray, set[Any]]:
    return _COUNT, {GATHER_ORDER}


def _lower(ctx: mlir.LoweringRuleContext, *operands: Any, plan: FlushPlan) -> list[Any]:
    module = ctx.module_context
    host_function = _host_function(ctx, plan)
    avals = list(ctx.avals_in)
    callback_ctx = dataclasses.replace(ctx, avals_in=avals, avals_out=[])
    token = jax_compat.emit_python_callback(
        callback_ctx,
        host_function,
        ctx.tokens_in.get(GATHER_ORDER),
        list(operands),
        avals,
        returns_token=False,
        sharding=jax_compat.callback_op_sharding(module.axis_context, None),
    )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({GATHER_ORDER: token})))
    zero = mlir.ir_constant(np.int32(0))
    joined = hlo.OptimizationBarrierOp([token, zero])
    return [joined.results[1]]


def _host_function(ctx: mlir.LoweringRuleContext, plan: FlushPlan) -> gathered_host.Flush:
    """What writes the computation's packed buffers (on the host)."""
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    devices_at = host_writers.DeviceOrdinals(host_writers.local_ordinals(ctx), 0)
    assert devices_at.fixed is not None  # (a gathered computation runs on one device)
    sites = [
        gathered_host.SiteWriter(site, avals, platform, devices_at)
        for site, avals in zip(plan.sites, plan.operand_avals, strict=True)
    ]
    return gathered_host.Flush(sites, devices_at.fixed, plan.capacity, plan.operand_avals)


jax_compat.register_lowering(flush_p, _lower)


# ---- the gathered computation, which makes its flushes' token ---------------------------

gathered_call_p = core.Primitive("tapd_gathered")
gathered_call_p.multiple_results = True


@dataclasses.dataclass(frozen=True, eq=False)
class WayOut:
    """A gathered computation that ends with an output: its effect (whose token slot
    carries the flags in and the packed buffers out) and its buffers."""

    effect: OutputsEffect
    plan: FlushPlan


def call(jaxpr: ClosedJaxpr, args: Sequence[Any], way_out: WayOut | None = None) -> list[Any]:
    """`jaxpr` (a gathered computation, its flushes `GatherOrder`'s) applied to `args`,
    with the token of its flushes made inside: to JAX, an unordered tap. With a
    `way_out`, `jaxpr` takes the wake flags first and returns the packed buffers last."""
    return gathered_call_p.bind(*args, jaxpr=jaxpr, way_out=way_out)  # type: ignore[no-any-return,no-untyped-call]


@gathered_call_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _call_abstract_eval(
    *avals: Any, jaxpr: ClosedJaxpr, way_out: WayOut | None
) -> tuple[list[Any], set[Any]]:
    outs = list(jaxpr.out_avals)
    effects = {*(jaxpr.effects - {GATHER_ORDER}), UNORDERED}
    return outs[:-1] if way_out is not None else outs, effects


def _lower_call(
    ctx: mlir.LoweringRuleContext, *args: Any, jaxpr: ClosedJaxpr, way_out: WayOut | None
) -> list[Any]:
    tokens = mlir.TokenSet({**dict(ctx.tokens_in.items()), GATHER_ORDER: hlo.create_token()})
    inner = dataclasses.replace(ctx, tokens_in=tokens, tokens_out=None)
    operands = list(args)
    if way_out is not None:
        way_out.effect.receiver = _host_function(ctx, way_out.plan)
        placeholder = gathered_module.placeholder(way_out.effect.flag_count)
        operands = [placeholder.results[0], *operands]
        inner = dataclasses.replace(
            inner, avals_in=list(jaxpr.in_avals), avals_out=list(jaxpr.out_avals)
        )
    outs: list[Any] = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(
        inner, *operands
    )
    if inner.tokens_out is not None:  # JAX's own ordered effects' tokens, passed on
        ctx.set_tokens_out(inner.tokens_out.subset([e for e, _ in ctx.tokens_in.items()]))
    if way_out is not None:
        *outs, packed = outs
        gathered_module.note(gathered_module.Joints(placeholder, packed))
    return outs


jax_compat.register_lowering(gathered_call_p, _lower_call)
