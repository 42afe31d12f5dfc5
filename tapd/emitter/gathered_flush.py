"""The flush of a gathered computation (`tapd.emitter.gathered`): one host callback that
takes the device buffers and writes each logged record, in program order, as the tap's
own host callback would have (`tapd.emitter.host_writers`).

`flush_p` takes (the log's length, the log, every site's buffers) and returns the log's
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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import mlir
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import host_writers, jax_compat, lifecycle
from tapd.emitter.primitive import UNORDERED, TapSiteParams
from tapd.native import library
from tapd.native.ring import NO_STEP

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
    buffers = [buffer for site in state.buffers for buffer in site]
    return flush_p.bind(state.count, state.log, *buffers, plan=plan)  # type: ignore[no-untyped-call]


@flush_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _abstract_eval(*avals: Any, plan: FlushPlan) -> tuple[core.ShapedArray, set[Any]]:
    return _COUNT, {GATHER_ORDER}


def _lower(ctx: mlir.LoweringRuleContext, *operands: Any, plan: FlushPlan) -> list[Any]:
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    devices_at = host_writers.DeviceOrdinals(host_writers.local_ordinals(ctx), 0)
    assert devices_at.fixed is not None  # (a gathered computation runs on one device)
    sites = [_SiteWriter(site, avals, platform, devices_at) for site, avals in _each(plan)]
    host_function = _Flush(sites, devices_at.fixed)
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


def _each(plan: FlushPlan) -> list[tuple[TapSiteParams, tuple[core.ShapedArray, ...]]]:
    return list(zip(plan.sites, plan.operand_avals, strict=True))


class _SiteWriter:
    """How one site's records are written: into a ring (its ids, for one batched call of
    the library a flush), or, with no ring, by the tap's own host function, one by one.

    A record's operands are the tap's (leaves, step, coords); the ring takes the leaves
    and the coordinates, then the step apart."""

    def __init__(
        self,
        site: TapSiteParams,
        avals: Sequence[core.ShapedArray],
        platform: str | None,
        devices_at: host_writers.DeviceOrdinals,
    ) -> None:
        local = lifecycle.local_path_of(site.consumer)
        native = local if local is not None else lifecycle.get_sender().native
        leaves = site.leaf_count(len(avals))
        self.step = leaves if site.has_step else None
        self.tapped = [*range(leaves), *([leaves + site.has_step] if site.has_coords else [])]
        self.row_bytes = [_nbytes(avals[i]) for i in self.tapped]
        tapped_avals = [avals[i] for i in self.tapped]
        fields = host_writers.site_fields(site, platform)
        self.ring: int | None = None
        if native is not None:
            self.site_id, self.consumer_id, self.every, _ = host_writers.ring_site(
                native, site, fields, tapped_avals
            )
            self.ring = native.ring.handle
            return
        write = host_writers.sender_writer(native, site, fields, tapped_avals, devices_at)
        order = [*self.tapped, *([self.step] if self.step is not None else [])]
        self.write_one = lambda operands: write(*[operands[i] for i in order])


def _nbytes(aval: core.ShapedArray) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * int(np.dtype(aval.dtype).itemsize)


class _Flush:
    """The flush's host function: every logged record, in order, to its site's ring (one
    call of the library per ring: `tapd_ring_write_batch`), or its sender."""

    def __init__(self, sites: list[_SiteWriter], device: int) -> None:
        self.sites = sites
        self.device = device
        self.stride = max([len(s.tapped) for s in sites] + [1])
        self.rings = sorted({s.ring for s in sites if s.ring is not None})
        lib = library.load()
        self.write_batch = lib.tapd_ring_write_batch if lib is not None else None

    def __call__(self, count: Any, log: Any, *buffers: Any) -> tuple[()]:
        records = int(count)
        if records == 0:
            return ()
        of_site = np.asarray(log)[:records].astype(np.int64)
        rows = np.empty(records, np.int64)
        present = np.unique(of_site).tolist()
        for site in present:
            chosen = of_site == site
            rows[chosen] = np.arange(int(chosen.sum()))
        operands = self._operands(buffers)
        for ring in self.rings:
            self._write_ring(ring, of_site, rows, operands, present)
        for site in present:
            writer = self.sites[site]
            if writer.ring is None:
                for row in rows[of_site == site].tolist():
                    writer.write_one([operand[row] for operand in operands[site]])
        return ()

    def _operands(self, buffers: Sequence[Any]) -> list[list[Any]]:
        """Each site's operand buffers, as contiguous numpy arrays."""
        result, start = [], 0
        for writer in self.sites:
            count = len(writer.tapped) + (writer.step is not None)
            result.append([np.ascontiguousarray(b) for b in buffers[start : start + count]])
            start += count
        return result

    def _write_ring(
        self,
        ring: int,
        of_site: np.ndarray,
        rows: np.ndarray,
        operands: list[list[Any]],
        present: list[int],
    ) -> None:
        here = [s for s in present if self.sites[s].ring == ring]
        if not here:
            return
        chosen = np.isin(of_site, here)
        sites, rows = of_site[chosen], rows[chosen]
        count = len(sites)
        site_ids = np.empty(count, np.uint64)
        consumers = np.empty(count, np.uint32)
        everys = np.empty(count, np.uint64)
        nleaves = np.empty(count, np.uint32)
        steps = np.full(count, NO_STEP, np.int64)
        data = np.zeros((count, self.stride), np.uint64)
        sizes = np.zeros((count, self.stride), np.uint64)
        for site in here:
            writer, mine = self.sites[site], sites == site
            site_ids[mine], consumers[mine] = writer.site_id, writer.consumer_id
            everys[mine], nleaves[mine] = writer.every, len(writer.tapped)
            their_rows = rows[mine].astype(np.uint64)
            for k, (index, row_bytes) in enumerate(
                zip(writer.tapped, writer.row_bytes, strict=True)
            ):
                buffer = operands[site][index]
                data[mine, k] = np.uint64(buffer.ctypes.data) + their_rows * np.uint64(row_bytes)
                sizes[mine, k] = row_bytes
            if writer.step is not None:
                steps[mine] = operands[site][writer.step][rows[mine]].astype(np.int64)
        assert self.write_batch is not None  # (a ring exists, so the library loaded)
        self.write_batch(
            ring, count, site_ids.ctypes.data, consumers.ctypes.data, self.device,
            steps.ctypes.data, everys.ctypes.data, nleaves.ctypes.data, self.stride,
            data.ctypes.data, sizes.ctypes.data, None,
        )  # fmt: skip


jax_compat.register_lowering(flush_p, _lower)


# ---- the gathered computation, which makes its flushes' token ---------------------------

gathered_call_p = core.Primitive("tapd_gathered")
gathered_call_p.multiple_results = True


def call(jaxpr: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """`jaxpr` (a gathered computation, its flushes `GatherOrder`'s) applied to `args`,
    with the token of its flushes made inside: to JAX, an unordered tap."""
    return gathered_call_p.bind(*args, jaxpr=jaxpr)  # type: ignore[no-any-return,no-untyped-call]


@gathered_call_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _call_abstract_eval(*avals: Any, jaxpr: ClosedJaxpr) -> tuple[list[Any], set[Any]]:
    return list(jaxpr.out_avals), {*(jaxpr.effects - {GATHER_ORDER}), UNORDERED}


def _lower_call(ctx: mlir.LoweringRuleContext, *args: Any, jaxpr: ClosedJaxpr) -> list[Any]:
    tokens = mlir.TokenSet({**dict(ctx.tokens_in.items()), GATHER_ORDER: hlo.create_token()})
    inner = dataclasses.replace(ctx, tokens_in=tokens, tokens_out=None)
    outs: list[Any] = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(inner, *args)
    if inner.tokens_out is not None:  # JAX's own ordered effects' tokens, passed on
        ctx.set_tokens_out(inner.tokens_out.subset([e for e, _ in ctx.tokens_in.items()]))
    return outs


jax_compat.register_lowering(gathered_call_p, _lower_call)
