"""The gathered path: a computation's taps kept on the device and moved out together.

On a TPU every host callback is a transfer to the host (0.4 to 1 ms, whatever its size
up to a MiB; docs/TAPPING.md), so a tap that is its own host callback costs as much as
the `jax.debug.callback` it replaces. A gathered computation moves its taps in few
transfers instead. Before JAX lowers it (`rewrite`, called by `tapd.emitter.lowering`
on the whole computation), each tap becomes a write into device buffers that the
computation carries (`Gathered`): the tapped operands into its site's rows, its site's
index into the log. Loops (`scan`, `while`) and branches (`cond`) carry the buffers
too, so the log is in program order however the taps nest. A flush
(`tapd.emitter.gathered_flush`) is one host callback that takes the buffers, and writes
each logged record, in order, as the tap's own host callback would have (the same ring
record, so subscribers cannot tell the paths apart). It runs when the log is full (at
most `gather_taps` records, or `gather_bytes` of buffers: a long loop's taps arrive
while it runs) and once at the end of the computation.

Flushes are ordered by data: each returns the log's new length (zero), which the next
writes, and so the next flush, take. The buffers are never cleared: a flush reads only
the rows its log names.

Only a computation on one device whose every tap would be a host callback is gathered
(`gatherable`), and only whole: a tap in a region the rewrite does not enter (a
`shard_map` or `pmap` body, a loop's condition) leaves the computation to the per-tap
path, so that its taps keep one order.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax._src import core, source_info_util
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from tapd.emitter import lifecycle
from tapd.emitter.gathered_flush import FlushPlan, flush
from tapd.emitter.primitive import TapSiteParams, tap_p

logger = logging.getLogger("tapd.emitter")


def maybe_gathered(
    closed: core.ClosedJaxpr, platforms: Sequence[str], axis_context: Any, for_export: bool
) -> core.ClosedJaxpr | None:
    """`closed` gathered, where the settings ask and the computation can be (see the
    module docstring); None where it keeps the per-tap path."""
    settings = lifecycle.settings()
    if settings.gather == "off" or for_export or len(platforms) != 1:
        return None
    platform = str(platforms[0]).lower()
    if settings.gather == "auto" and platform != "tpu":
        return None
    if getattr(axis_context, "num_devices", None) != 1 or not taps_within(closed.jaxpr):
        return None
    found: dict[TapSiteParams, list[Any]] = {}
    try:
        site_operands(closed.jaxpr, found)
    except NotGatherable:
        return None
    if not all(_host_callback_here(site, platform) for site in found):
        return None
    try:
        return rewrite(
            closed,
            lambda sites, avals, records: plan_buffers(
                sites,
                avals,
                records,
                taps=settings.gather_taps,
                max_bytes=settings.gather_bytes,
            ),
        )
    except NotGatherable as exc:
        logger.debug("taps not gathered: %s", exc)
        return None


def _host_callback_here(site: TapSiteParams, platform: str) -> bool:
    """Whether the tap would be a host callback here (not tapd's native handler), and
    may leave JAX's token alone (not strict)."""
    if site.strict:
        return False
    local = lifecycle.local_path_of(site.consumer)
    native = local if local is not None else lifecycle.get_sender().native
    handled = platform in lifecycle.handler_platforms(local=local is not None)
    return native is None or not handled


class NotGatherable(Exception):
    """Raised while rewriting: the computation keeps the per-tap path."""


class Gathered(NamedTuple):
    """The device buffers a gathered computation carries (a pytree of traced values)."""

    count: Any  # int32[]: records in the log
    log: Any  # int32[capacity]: each record's site index
    rows: Any  # int32[sites]: each site's records since the last flush
    buffers: tuple[tuple[Any, ...], ...]  # per site, per operand: [capacity, *shape]


# The primitives whose one jaxpr runs where they stand: the rewrite inlines it.
_INLINED = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
}


def taps_within(jaxpr: core.Jaxpr) -> bool:
    return any(eqn.primitive is tap_p for eqn in jaxpr.eqns) or any(
        taps_within(sub) for sub in core.subjaxprs(jaxpr)
    )


def site_operands(jaxpr: core.Jaxpr, found: dict[TapSiteParams, list[Any]]) -> None:
    """Each tap site of `jaxpr` (nested ones too), with its operands' avals, in order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_p:
            avals: list[Any] = [var.aval for var in eqn.invars]
            known = found.setdefault(eqn.params["site"], avals)
            if [(a.shape, a.dtype) for a in known] != [(a.shape, a.dtype) for a in avals]:
                raise NotGatherable("one site, two shapes")
    for sub in core.subjaxprs(jaxpr):
        site_operands(sub, found)


def most_records(jaxpr: core.Jaxpr) -> float:
    """The most taps one run of `jaxpr` can make (inf where a `while` loop taps)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.primitive is tap_p:
            total += 1
        elif not taps_within_eqn(eqn):
            continue
        elif name == "scan":
            total += eqn.params["length"] * most_records(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(most_records(branch.jaxpr) for branch in eqn.params["branches"])
        elif name == "while":
            return math.inf
        else:
            total += sum(most_records(sub) for sub in core.jaxprs_in_params(eqn.params))
    return total


def taps_within_eqn(eqn: core.JaxprEqn) -> bool:
    return any(taps_within(sub) for sub in core.jaxprs_in_params(eqn.params))


def rewrite(
    closed: core.ClosedJaxpr, make_plan: Callable[[list[TapSiteParams], list[list[Any]], int], Any]
) -> core.ClosedJaxpr:
    """`closed` with its taps gathered (see the module docstring); raises NotGatherable.

    `make_plan(sites, operand avals, records)` sizes the buffers: a `FlushPlan`."""
    found: dict[TapSiteParams, list[Any]] = {}
    site_operands(closed.jaxpr, found)
    sites = list(found)
    plan: FlushPlan = make_plan(sites, [found[s] for s in sites], _capacity_hint(closed))
    index = {site: i for i, site in enumerate(sites)}
    in_avals = [var.aval for var in closed.jaxpr.invars]

    def gathered(*args: Any) -> list[Any]:
        state = _empty(plan)
        outs, state = _run(closed.jaxpr, closed.consts, list(args), state, plan, index)
        _final_flush(state, plan, certain=_certain(closed.jaxpr))
        return outs

    debug_info = closed.jaxpr.debug_info
    traced = pe.trace_to_jaxpr_dynamic(lu.wrap_init(gathered, debug_info=debug_info), in_avals)
    jaxpr, consts = traced[0], traced[2]
    return core.ClosedJaxpr(jaxpr, consts)


def _capacity_hint(closed: core.ClosedJaxpr) -> int:
    records = most_records(closed.jaxpr)
    return 0 if math.isinf(records) else int(records)


def _certain(jaxpr: core.Jaxpr) -> bool:
    """Whether a run certainly taps (a tap outside any branch or loop): the final flush
    then needs no test of the log's length."""
    return any(eqn.primitive is tap_p for eqn in jaxpr.eqns)


def _empty(plan: FlushPlan) -> Gathered:
    """Fresh buffers: zeros (a flush reads only the rows its log names)."""
    return Gathered(
        count=np.int32(0),
        log=lax.full((plan.capacity,), 0, np.int32),
        rows=lax.full((len(plan.sites),), 0, np.int32),
        buffers=tuple(
            tuple(lax.full((plan.capacity, *a.shape), 0, a.dtype) for a in avals)
            for avals in plan.operand_avals
        ),
    )


def _record(state: Gathered, site: int, operands: Sequence[Any], plan: FlushPlan) -> Gathered:
    """A tap: its operands into its site's next rows, its site into the log; then, if
    the log is full, a flush."""
    row = state.rows[site]
    written = tuple(
        lax.dynamic_update_index_in_dim(buffer, operand, row, 0)
        for buffer, operand in zip(state.buffers[site], operands, strict=True)
    )
    state = Gathered(
        count=state.count + 1,
        log=lax.dynamic_update_index_in_dim(state.log, np.int32(site), state.count, 0),
        rows=state.rows.at[site].add(1),
        buffers=(*state.buffers[:site], written, *state.buffers[site + 1 :]),
    )
    if plan.never_full:
        return state
    flushed: Gathered = lax.cond(state.count >= plan.capacity, _flushed(plan), lambda s: s, state)
    return flushed


def _flushed(plan: FlushPlan) -> Callable[[Gathered], Gathered]:
    def flushed(state: Gathered) -> Gathered:
        count = flush(state, plan)
        return state._replace(count=count, rows=lax.full(state.rows.shape, count, np.int32))

    return flushed


def _final_flush(state: Gathered, plan: FlushPlan, *, certain: bool) -> None:
    if certain:
        flush(state, plan)
    else:
        lax.cond(state.count > 0, _flushed(plan), lambda s: s, state)


def _run(
    jaxpr: core.Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    state: Gathered,
    plan: FlushPlan,
    index: dict[TapSiteParams, int],
) -> tuple[list[Any], Gathered]:
    """Evaluate `jaxpr` (tracing), threading `state` through its taps."""
    env: dict[Any, Any] = {}

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, core.Literal) else env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        env[var] = value
    for var, value in zip(jaxpr.invars, args, strict=True):
        env[var] = value
    for eqn in jaxpr.eqns:
        invals = [read(atom) for atom in eqn.invars]
        with source_info_util.user_context(eqn.source_info.traceback):
            if eqn.primitive is tap_p:
                site: TapSiteParams = eqn.params["site"]
                state = _record(state, index[site], invals, plan)
                outs = invals[: site.leaf_count(len(invals))]
            elif not taps_within_eqn(eqn):
                outs = _bind(eqn, invals)
            else:
                outs, state = _run_tapping(eqn, invals, state, plan, index)
        for var, value in zip(eqn.outvars, outs, strict=True):
            env[var] = value
    return [read(atom) for atom in jaxpr.outvars], state


def _bind(eqn: core.JaxprEqn, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)  # type: ignore[no-untyped-call]
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # (JAX before 0.9: subfuns, params)
        subfuns, params = params
    with eqn.ctx.manager:
        result = eqn.primitive.bind(*subfuns, *invals, **params)  # type: ignore[no-untyped-call]
    return list(result) if eqn.primitive.multiple_results else [result]


def _run_tapping(
    eqn: core.JaxprEqn,
    invals: list[Any],
    state: Gathered,
    plan: FlushPlan,
    index: dict[TapSiteParams, int],
) -> tuple[list[Any], Gathered]:
    """An equation whose jaxprs tap: inlined, or rebuilt to carry the buffers."""
    name, params = eqn.primitive.name, eqn.params
    if name in _INLINED and _INLINED[name] in params:
        inner = params[_INLINED[name]]
        jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
        return _run(jaxpr, consts, invals, state, plan, index)
    if name == "cond":
        branch_index, *operands = invals

        def branch(closed: core.ClosedJaxpr) -> Callable[..., Any]:
            return lambda ops, st: _run(closed.jaxpr, closed.consts, ops, st, plan, index)

        outs, state = lax.switch(
            branch_index, [branch(b) for b in params["branches"]], operands, state
        )
        return list(outs), state
    if name == "scan":
        return _run_scan(params, invals, state, plan, index)
    if name == "while":
        return _run_while(params, invals, state, plan, index)
    raise NotGatherable(f"taps inside {name}")


def _run_scan(
    params: dict[str, Any],
    invals: list[Any],
    state: Gathered,
    plan: FlushPlan,
    index: dict[TapSiteParams, int],
) -> tuple[list[Any], Gathered]:
    body: core.ClosedJaxpr = params["jaxpr"]
    consts_count, carry_count = params["num_consts"], params["num_carry"]
    consts = invals[:consts_count]
    carry = invals[consts_count : consts_count + carry_count]
    xs = invals[consts_count + carry_count :]

    def step(both: tuple[list[Any], Gathered], x: list[Any]) -> tuple[Any, list[Any]]:
        values, st = both
        outs, st = _run(body.jaxpr, body.consts, [*consts, *values, *x], st, plan, index)
        return (outs[:carry_count], st), outs[carry_count:]

    (carry, state), ys = lax.scan(
        step,
        (carry, state),
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
    )
    return [*carry, *ys], state


def _run_while(
    params: dict[str, Any],
    invals: list[Any],
    state: Gathered,
    plan: FlushPlan,
    index: dict[TapSiteParams, int],
) -> tuple[list[Any], Gathered]:
    cond: core.ClosedJaxpr = params["cond_jaxpr"]
    body: core.ClosedJaxpr = params["body_jaxpr"]
    if taps_within(cond.jaxpr):
        raise NotGatherable("taps in a loop's condition")
    cond_count, body_count = params["cond_nconsts"], params["body_nconsts"]
    cond_consts = invals[:cond_count]
    body_consts = invals[cond_count : cond_count + body_count]
    carry = invals[cond_count + body_count :]

    def going_on(both: tuple[list[Any], Gathered]) -> Any:
        return core.eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *both[0])[0]

    def step(both: tuple[list[Any], Gathered]) -> tuple[list[Any], Gathered]:
        return _run(body.jaxpr, body.consts, [*body_consts, *both[0]], both[1], plan, index)

    carry, state = lax.while_loop(going_on, step, (list(carry), state))
    return list(carry), state


def plan_buffers(
    sites: list[TapSiteParams],
    operand_avals: list[list[Any]],
    records: int,
    *,
    taps: int,
    max_bytes: int,
) -> FlushPlan:
    """Buffers for `taps` records at most (fewer where one run makes fewer, `records`,
    0 if unbounded), and at most `max_bytes` of them (at least one record)."""
    row_bytes = sum(
        int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        for avals in operand_avals
        for a in avals
    )
    capacity = max(1, min(taps, max_bytes // max(row_bytes, 1)))
    never_full = 0 < records <= capacity
    if never_full:
        capacity = records
    return FlushPlan(
        sites=tuple(sites),
        operand_avals=tuple(
            tuple(core.ShapedArray(a.shape, a.dtype) for a in avals)  # (ShapedArrays)
            for avals in operand_avals
        ),
        capacity=capacity,
        never_full=never_full,
    )
