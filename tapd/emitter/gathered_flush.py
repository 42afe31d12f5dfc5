"""The flush of a gathered computation (`tapd.emitter.gathered`): one host callback that
takes the device buffers and writes each logged record, in program order, as the tap's
own host callback would have (`tapd.emitter.host_writers`).

`flush_p` takes (the log's length, the log, every site's buffers) and returns the log's
new length, zero, made after the callback's transfer (an optimization barrier joins it
to the callback's token): the writes after a flush, and so the next flush, depend on
it. The callback returns nothing to the device, which goes on without waiting for the
host (on a TPU: sends only, no receive).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax._src import core, dispatch
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import host_writers, jax_compat, lifecycle
from tapd.emitter.primitive import UNORDERED, TapSiteParams


@dataclasses.dataclass(frozen=True)
class FlushPlan:
    """The buffers of one gathered computation; hashable (a primitive parameter)."""

    sites: tuple[TapSiteParams, ...]
    operand_avals: tuple[tuple[core.ShapedArray, ...], ...]  # per site: the tap's operands
    capacity: int  # records the log holds
    never_full: bool  # one run makes at most `capacity` records: flushed at its end only


flush_p = core.Primitive("tapd_gathered_flush")
dispatch.prim_requires_devices_during_lowering.add(flush_p)

_COUNT = core.ShapedArray((), np.dtype(np.int32))


def flush(state: Any, plan: FlushPlan) -> Any:
    """Flush `state` (a `gathered.Gathered`); returns the log's new length (0)."""
    buffers = [buffer for site in state.buffers for buffer in site]
    return flush_p.bind(state.count, state.log, *buffers, plan=plan)  # type: ignore[no-untyped-call]


@flush_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _abstract_eval(*avals: Any, plan: FlushPlan) -> tuple[core.ShapedArray, set[Any]]:
    return _COUNT, {UNORDERED}


def _lower(ctx: mlir.LoweringRuleContext, *operands: Any, plan: FlushPlan) -> list[Any]:
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    devices_at = host_writers.DeviceOrdinals(host_writers.local_ordinals(ctx), 0)
    writers = [_writer(site, avals, platform, devices_at) for site, avals in _each(plan)]
    host_function = _flush_host(plan, writers)
    avals = list(ctx.avals_in)
    callback_ctx = dataclasses.replace(ctx, avals_in=avals, avals_out=[])
    token = jax_compat.emit_python_callback(
        callback_ctx,
        host_function,
        hlo.create_token(),
        list(operands),
        avals,
        returns_token=False,
        sharding=jax_compat.callback_op_sharding(module.axis_context, None),
    )
    zero = mlir.ir_constant(np.int32(0))
    joined = hlo.OptimizationBarrierOp([token, zero])
    return [joined.results[1]]


def _each(plan: FlushPlan) -> list[tuple[TapSiteParams, tuple[core.ShapedArray, ...]]]:
    return list(zip(plan.sites, plan.operand_avals, strict=True))


def _writer(
    site: TapSiteParams,
    avals: Sequence[core.ShapedArray],
    platform: str | None,
    devices_at: host_writers.DeviceOrdinals,
) -> Callable[..., Any]:
    """The host function that writes one record of `site` (what its own host callback
    would be), taking the record's operands in the tap's order (leaves, step, coords)."""
    local = lifecycle.local_path_of(site.consumer)
    native = local if local is not None else lifecycle.get_sender().native
    leaves = site.leaf_count(len(avals))
    # The host function takes the leaves and the coordinates, then the step.
    order = [
        *range(leaves),
        *([leaves + site.has_step] if site.has_coords else []),
        *([leaves] if site.has_step else []),
    ]
    tapped_avals = [avals[i] for i in order if not (site.has_step and i == leaves)]
    make = host_writers.ring_writer if native is not None else host_writers.sender_writer
    write = make(native, site, host_writers.site_fields(site, platform), tapped_avals, devices_at)

    def write_record(operands: Sequence[Any]) -> None:
        write(*[operands[i] for i in order])

    return write_record


def _flush_host(plan: FlushPlan, writers: list[Callable[..., Any]]) -> Callable[..., tuple[()]]:
    """The flush's host function: every logged record, in order, to its site's writer."""
    spans = []
    start = 0
    for avals in plan.operand_avals:
        spans.append((start, start + len(avals)))
        start += len(avals)

    def flush_records(count: Any, log: Any, *buffers: Any) -> tuple[()]:
        rows = [0] * len(writers)
        for site in np.asarray(log)[: int(count)].tolist():
            row = rows[site]
            rows[site] = row + 1
            first, last = spans[site]
            writers[site]([buffer[row] for buffer in buffers[first:last]])
        return ()

    return flush_records


jax_compat.register_lowering(flush_p, _lower)
