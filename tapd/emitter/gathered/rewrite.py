"""The rewrite of the gathered path (`tapd.emitter.gathered`): a jaxpr evaluated, while
JAX traces, with each tap turned into writes into device buffers that the computation
carries through its loops and branches (`Gathered`), and flushes where they fill.

Where a flush may be needed is decided ahead, not at each tap (a `cond` per tap costs
a TPU several µs a step): a region whose taps are bounded (`most_records`) first makes
room for all of them (one test of the log's length), then taps unchecked. A loop whose
every run could overflow the log runs in chunks: an inner loop of as many iterations as
the log holds, unchecked, then a flush (a `while`'s before its next chunk, so that its
end flushes nothing); so a `scan` of 10 000 steps with one tap a step and a log of 256
makes 40 flushes and no test at any step. On one device, a loop at the
top that runs long (`Rewriter._live`) runs in chunks the host paces instead, each ended
where the log has no room for another step's kept taps (tapd.emitter.gathered.live).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from jax import lax
from jax._src import core, source_info_util

from tapd.emitter.gathered import live
from tapd.emitter.gathered.flush import ClosedJaxpr, FlushPlan, flush, pack, poll
from tapd.emitter.primitive import TapSiteParams, tap_p


class NotGatherable(Exception):
    """Raised while rewriting: the computation keeps the per-tap path."""


class Gathered(NamedTuple):
    """The device buffers a gathered computation carries (a pytree of traced values)."""

    count: Any  # int32[]: records in the log
    log: Any  # int32[capacity]: each record's site index
    order: Any  # int32[capacity]: each record's place among its site's taps since the last flush
    rows: Any  # int32[sites]: each site's records since the last flush
    buffers: tuple[tuple[Any, ...], ...]  # per site, per operand: [capacity, *stored_shape]
    # int32[sites]: which of a site's taps are kept: 0 none (dormant), 1 all, W > 1 those
    # whose (phase + seen) is a multiple of W (sampled on the device: gathered.sampling)
    awake: Any
    skipped: Any  # int32[sites]: each site's taps not kept since the last flush
    seen: Any  # int32[sites]: each site's taps this call, kept or not
    phase: Any  # int32[sites]: each sampled site's first seq this call, modulo its W
    interval: Any  # int32[]: the steps a live loop's chunk runs (tapd.emitter.gathered.live)
    polls: Any  # int32[]: the host's answers so far this call


def stored_shape(aval: Any) -> tuple[int, ...]:
    """The shape a tap's operand is stored in, one record a row of its buffer: its own,
    or, for a vector of whole (sublanes, 128) tiles, [elements / 128, 128] (the same
    bytes, row-major). A TPU tiles an array's last two dimensions: a buffer of vectors,
    [capacity, n], has tiles across records, so that writing one record writes into
    each of n / 128 tiles, and inside a loop with a `cond` (a flush) the buffer leaves
    on-chip memory: ~30 µs a 1 MiB write on the TPU v5e. Stored [capacity, n / 128,
    128], a record is whole tiles of its own: ~0.4 µs, and ~2-5 µs with the `cond`
    (tpu_step_probe's `@tiles`, retired; bench/RESULTS-tpu.md, session 19)."""
    shape = tuple(aval.shape)
    if len(shape) > 1:  # (the record's own last two dimensions are tiled)
        return shape
    elements = math.prod(shape)
    sublanes = max(8, 32 // np.dtype(aval.dtype).itemsize)
    if elements and elements % (128 * sublanes) == 0:
        return (elements // 128, 128)
    return shape


def _as_stored(operand: Any, buffer: Any) -> Any:
    shape = buffer.shape[1:]
    return operand if np.shape(operand) == shape else lax.reshape(operand, shape)


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


# ---- what a jaxpr taps ------------------------------------------------------------------


def taps_within(jaxpr: core.Jaxpr) -> bool:
    return any(eqn.primitive is tap_p for eqn in jaxpr.eqns) or any(
        taps_within(sub) for sub in core.subjaxprs(jaxpr)
    )


def taps_within_eqn(eqn: core.JaxprEqn) -> bool:
    return any(taps_within(sub) for sub in core.jaxprs_in_params(eqn.params))


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
            length = eqn.params["length"]
            if length:  # (a scan of length 0 makes none, even of a body that could loop)
                total += length * most_records(eqn.params["jaxpr"].jaxpr)
        elif name == "cond":
            total += max(most_records(branch.jaxpr) for branch in eqn.params["branches"])
        elif name == "while":
            return math.inf
        else:
            total += sum(most_records(sub) for sub in core.jaxprs_in_params(eqn.params))
    return total


def exact_taps(jaxpr: core.Jaxpr) -> collections.Counter[TapSiteParams] | None:
    """The taps each site makes in every run of `jaxpr`, where that is known before it
    runs (None where a `while` loop taps, or a `cond`'s branches tap differently)."""
    total: collections.Counter[TapSiteParams] = collections.Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if eqn.primitive is tap_p:
            total[eqn.params["site"]] += 1
        elif not taps_within_eqn(eqn):
            continue
        elif name == "scan":
            body = exact_taps(eqn.params["jaxpr"].jaxpr)
            if body is None:
                return None
            for site, count in body.items():
                total[site] += count * eqn.params["length"]
        elif name == "cond":
            branches = [exact_taps(branch.jaxpr) for branch in eqn.params["branches"]]
            if any(b is None or b != branches[0] for b in branches):
                return None
            total.update(branches[0])
        elif name == "while":
            return None
        else:
            for sub in core.jaxprs_in_params(eqn.params):
                inner = exact_taps(sub)
                if inner is None:
                    return None
                total.update(inner)
    return total


def certainly_taps(jaxpr: core.Jaxpr) -> bool:
    """Whether every run of `jaxpr` taps (a tap outside any branch or loop)."""
    return any(eqn.primitive is tap_p for eqn in jaxpr.eqns)


def _kept(keep: Any, phase: Any, seen: Any) -> Any:
    """1 if a tap is kept, else 0 (int32): its site's `keep` flag (`Gathered.awake`) is
    1, or is W > 1 and the tap's seq, `phase` + `seen` modulo W, a multiple of W."""
    every = lax.max(keep, np.int32(1))
    sampled_in = lax.rem(lax.rem(seen, every) + phase, every) == 0
    return lax.convert_element_type(lax.bitwise_and(keep > 0, sampled_in), np.int32)


# ---- the rewrite -------------------------------------------------------------------------


class Rewriter:
    """Evaluates jaxprs under a trace, threading the buffers of `plan` through their taps.

    `checked`: whether a tap must test for a full log itself (its region made no room)."""

    def __init__(
        self,
        plan: FlushPlan,
        varying: tuple[str, ...] = (),
        *,
        platform: str = "cpu",
        latency: float = 0.0,
    ) -> None:
        self.plan = plan
        self.index = {site: i for i, site in enumerate(plan.sites)}
        # In a shard_map body whose manual axes JAX checks: the axes each device's
        # buffers vary along (what the values written into them do).
        self.varying = varying
        # Live loops (tapd.emitter.gathered.live): where flushes answer, a loop at the
        # top (not inside another loop) that runs long enough.
        self.platform = platform
        self.latency = latency if plan.answers else 0.0
        self.loops = 0  # loops around what is being traced
        self.answers_traced = False  # a flush or poll that answers was traced

    def empty(self, flags: Any = None) -> Gathered:
        """Fresh buffers: zeros (a flush reads only the rows its log names). `flags`:
        the call's (`FlushPlan.flags_aval`: the sites' wake flags, a live chunk's first
        steps, the sampled sites' phases); without them every tap is kept."""
        plan = self.plan
        sites = len(plan.sites)
        zeros = lax.full((sites,), 0, np.int32)
        return Gathered(
            count=np.int32(0),
            log=lax.full((plan.capacity,), 0, np.int32),
            order=lax.full((plan.capacity,), 0, np.int32),
            rows=zeros,
            buffers=tuple(
                tuple(
                    self._own(lax.full((plan.capacity, *stored_shape(a)), 0, a.dtype))
                    for a in avals
                )
                for avals in plan.operand_avals
            ),
            awake=lax.full((sites,), 1, np.int32) if flags is None else flags[:sites],
            skipped=zeros,
            seen=zeros,
            phase=zeros if flags is None else flags[sites + 1 :],
            interval=np.int32(1) if flags is None else flags[sites],
            polls=np.int32(0),
        )

    def _own(self, buffer: Any) -> Any:
        """`buffer`, each device's own (varying along `varying`)."""
        if not self.varying:
            return buffer
        pcast = getattr(lax, "pcast", None)
        if pcast is not None:
            return pcast(buffer, self.varying, to="varying")
        return lax.pvary(buffer, self.varying)  # type: ignore[attr-defined]

    # ---- flushes ------------------------------------------------------------------------

    def flushed(self, state: Gathered, steps: Any = 0, *, answer: bool = False) -> Gathered:
        """`state` flushed: its log empty, made after the flush's transfer. With
        `answer` (a live chunk's end, where the plan's flushes answer), with the host's
        answer to a chunk of `steps`. Any other flush (a full log's) only sends: the
        device does not wait for the host (on a TPU the wait would stall the loop for
        the copy of the whole log)."""
        count, answer = flush(state, self.plan, steps, state.polls, answer=answer)
        zeros = lax.full(state.rows.shape, count, np.int32)
        state = state._replace(count=count, rows=zeros, skipped=zeros)
        return state if answer is None else self._with_answer(state, answer)

    def answered(self, state: Gathered, steps: Any) -> Gathered:
        """`state` after the host answers a live chunk's end: flushed where it logged,
        else polled (its buffers, the dormant sites' taps, move nothing)."""

        def polled(st: Gathered) -> Gathered:
            return self._with_answer(st, poll(self.plan, steps, st.polls))

        result: Gathered = lax.cond(
            state.count > 0, lambda st: self.flushed(st, steps, answer=True), polled, state
        )
        return result

    def _with_answer(self, state: Gathered, answer: Any) -> Gathered:
        """The host's answer: the sites' wake flags now, and the next chunk's steps."""
        self.answers_traced = True
        sites = len(self.plan.sites)
        return state._replace(awake=answer[:sites], interval=answer[sites], polls=state.polls + 1)

    def flush_if(self, condition: Any, state: Gathered) -> Gathered:
        result: Gathered = lax.cond(condition, self.flushed, lambda s: s, state)
        return result

    def make_room(self, state: Gathered, records: float) -> Gathered:
        """`state` with room for `records` more (at most the log's capacity)."""
        return self.flush_if(state.count + int(records) > self.plan.capacity, state)

    def final(self, state: Gathered, *, certain: bool) -> None:
        """The flush at the computation's end (none if nothing was logged)."""
        if certain:
            self.flushed(state)
        else:
            self.flush_if(state.count > 0, state)

    def chunk_end(self, state: Gathered, certain: bool) -> Gathered:
        """The flush after a loop's chunk: unconditional where the chunk certainly logs
        (no test), else where it logged. (A loop chunked by its log, not live: its
        flushes send only, and the flags it took with the call hold to its end.)"""
        if certain:
            return self.flushed(state)
        return self.flush_if(state.count > 0, state)

    def _bounded(self, records: float) -> bool:
        return records <= self.plan.capacity

    # ---- evaluation ---------------------------------------------------------------------

    def run(
        self,
        jaxpr: core.Jaxpr,
        consts: Sequence[Any],
        args: Sequence[Any],
        state: Gathered,
        checked: bool,
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
                    state = self.record(state, self.index[site], invals, checked)
                    outs = invals[: site.leaf_count(len(invals))]
                elif not taps_within_eqn(eqn):
                    outs = _bind(eqn, invals)
                else:
                    outs, state = self._run_tapping(eqn, invals, state, checked)
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value
        return [read(atom) for atom in jaxpr.outvars], state

    def record(
        self, state: Gathered, site: int, operands: Sequence[Any], checked: bool
    ) -> Gathered:
        """A tap: its operands into its site's next rows, its site into the log. If
        `checked`, it first makes room for itself (a full log is flushed by the tap that
        finds it full, not by the one that fills it: a region that made room for its
        taps may leave the log full)."""
        if checked:
            state = self.make_room(state, 1)
        row = state.rows[site]
        written = tuple(
            lax.dynamic_update_index_in_dim(buffer, _as_stored(operand, buffer), row, 0)
            for buffer, operand in zip(state.buffers[site], operands, strict=True)
        )
        # A tap not kept (its site dormant, or sampled out) is written all the same (no
        # branch: on a TPU a 1 MiB write inside a taken `cond` costs ~7 µs, ~0.3 outside
        # it, tpu_big_probe, retired), but the next tap writes over it; it is counted,
        # and its place among the site's taps gives the next kept one its seq.
        kept = _kept(state.awake[site], state.phase[site], state.seen[site])
        place = state.rows[site] + state.skipped[site]
        return state._replace(
            count=state.count + kept,
            log=lax.dynamic_update_index_in_dim(state.log, np.int32(site), state.count, 0),
            order=lax.dynamic_update_index_in_dim(state.order, place, state.count, 0),
            rows=state.rows.at[site].add(kept),
            buffers=(*state.buffers[:site], written, *state.buffers[site + 1 :]),
            skipped=state.skipped.at[site].add(1 - kept),
            seen=state.seen.at[site].add(1),
        )

    def _run_tapping(
        self, eqn: core.JaxprEqn, invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        """An equation whose jaxprs tap: inlined, or rebuilt to carry the buffers."""
        name, params = eqn.primitive.name, eqn.params
        if name in _INLINED and _INLINED[name] in params:
            inner = params[_INLINED[name]]
            jaxpr, consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, ())
            return self.run(jaxpr, consts, invals, state, checked)
        if name == "cond":
            return self._run_cond(params, invals, state, checked)
        if name == "shard_map":
            return self.run_shard_map(eqn, invals, state, checked)
        if name not in ("scan", "while"):
            raise NotGatherable(f"taps inside {name}")
        self.loops += 1
        try:
            if name == "scan":
                return self._run_scan(params, invals, state, checked)
            return self._run_while(params, invals, state, checked)
        finally:
            self.loops -= 1

    def run_shard_map(
        self, eqn: core.JaxprEqn, invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        """A `shard_map` whose body taps: not entered here (each device's buffers are
        its own: tapd.emitter.gathered.threaded enters it)."""
        raise NotGatherable("taps inside shard_map")

    def packed(self, state: Gathered) -> Any:
        """`state` as the bytes the host reads (flush.pack)."""
        return pack(state)

    def _live(self, per_step: float, records: float, seconds: Callable[[], float]) -> bool:
        """Whether the loop being rewritten (at the top: inside no other loop), which
        taps `per_step` records a step and `records` in all, runs live."""
        if self.loops != 1 or self.latency <= 0 or not 0 < per_step <= self.plan.capacity:
            return False
        overflows = records > self.plan.capacity and not self.plan.never_full
        return live.is_live(math.inf if overflows else seconds(), overflows, self.latency)

    def _run_cond(
        self, params: dict[str, Any], invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        branches: Sequence[ClosedJaxpr] = params["branches"]
        records = max(most_records(branch.jaxpr) for branch in branches)
        if checked and self._bounded(records):
            state, checked = self.make_room(state, records), False
        branch_index, *operands = invals

        def branch(closed: ClosedJaxpr) -> Callable[..., Any]:
            return lambda ops, st: self.run(closed.jaxpr, closed.consts, ops, st, checked)

        outs, state = lax.switch(branch_index, [branch(b) for b in branches], operands, state)
        return list(outs), state

    def _run_scan(
        self, params: dict[str, Any], invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        body: ClosedJaxpr = params["jaxpr"]
        consts, carry, xs = _scan_operands(params, invals)
        carry_count = len(carry)
        length, reverse = params["length"], params["reverse"]
        per_step = most_records(body.jaxpr)
        if self._live(
            per_step,
            length * per_step,
            lambda: length * live.estimated_seconds(body.jaxpr, self.platform),
        ):
            return live.scan(self, params, consts, carry, xs, state, int(per_step))

        def scan(
            carry: list[Any], state: Gathered, xs: list[Any], length: int, checked: bool
        ) -> tuple[list[Any], Gathered, list[Any]]:
            def step(both: tuple[list[Any], Gathered], x: list[Any]) -> tuple[Any, list[Any]]:
                values, st = both
                outs, st = self.run(body.jaxpr, body.consts, [*consts, *values, *x], st, checked)
                return (outs[:carry_count], st), outs[carry_count:]

            (carry, state), ys = lax.scan(
                step, (carry, state), xs, length=length, reverse=reverse, unroll=params["unroll"]
            )
            return list(carry), state, list(ys)

        if not checked or not self._bounded(per_step) or per_step == 0:
            carry, state, ys = scan(carry, state, xs, length, checked)
            return [*carry, *ys], state
        if self._bounded(length * per_step):
            carry, state, ys = scan(
                carry, self.make_room(state, length * per_step), xs, length, False
            )
            return [*carry, *ys], state
        # In chunks of as many steps as the log holds, each flushed at its end.
        steps = int(self.plan.capacity // per_step)
        chunks, rest = divmod(length, steps)
        state = self.flush_if(state.count > 0, state)
        certain = certainly_taps(body.jaxpr)
        split = rest if reverse else chunks * steps
        head = [x[:split] for x in xs]
        tail = [x[split:] for x in xs]
        chunked_xs, rest_xs = (tail, head) if reverse else (head, tail)

        def chunk(both: tuple[list[Any], Gathered], x: list[Any]) -> tuple[Any, list[Any]]:
            values, st = both
            values, st, ys = scan(values, st, x, steps, False)
            st = self.chunk_end(st, certain)
            return (values, st), ys

        (carry, state), chunked_ys = lax.scan(
            chunk,
            (carry, state),
            [x.reshape(chunks, steps, *x.shape[1:]) for x in chunked_xs],
            length=chunks,
            reverse=reverse,
        )
        chunked_ys = [y.reshape(chunks * steps, *y.shape[2:]) for y in chunked_ys]
        carry, state, rest_ys = scan(list(carry), state, rest_xs, rest, False)
        parts = (rest_ys, chunked_ys) if reverse else (chunked_ys, rest_ys)
        ys = [lax.concatenate([first, second], 0) for first, second in zip(*parts, strict=True)]
        return [*carry, *ys], state

    def _run_while(
        self, params: dict[str, Any], invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        cond: ClosedJaxpr = params["cond_jaxpr"]
        body: ClosedJaxpr = params["body_jaxpr"]
        if taps_within(cond.jaxpr):
            raise NotGatherable("taps in a loop's condition")
        cond_count, body_count = params["cond_nconsts"], params["body_nconsts"]
        cond_consts = invals[:cond_count]
        body_consts = invals[cond_count : cond_count + body_count]
        carry = list(invals[cond_count + body_count :])
        per_step = most_records(body.jaxpr)

        # A vmapped loop's predicate may stay batched (one per element): as JAX lowers
        # `while`, the loop goes on while any element does, and a step keeps its new
        # values only for the elements whose predicate held (its taps saw them all).
        batched = bool(np.ndim(cond.out_avals[0]))

        def predicate(values: list[Any]) -> Any:
            return core.eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *values)[0]

        def going_on(values: list[Any]) -> Any:
            going = predicate(values)
            return lax.reduce_or(going, tuple(range(np.ndim(going)))) if batched else going

        def step(values: list[Any], st: Gathered, checked: bool) -> tuple[list[Any], Gathered]:
            outs, st = self.run(body.jaxpr, body.consts, [*body_consts, *values], st, checked)
            if batched:
                held = predicate(values)
                outs = [
                    new if aval is core.abstract_token else _where(held, new, old)
                    for new, old, aval in zip(outs, values, body.out_avals, strict=True)
                ]
            return outs, st

        if self._live(per_step, math.inf, lambda: math.inf):
            return live.while_loop(self, going_on, step, carry, state, int(per_step))
        if not checked or not self._bounded(per_step) or per_step == 0:
            carry, state = lax.while_loop(
                lambda both: going_on(both[0]), lambda both: step(*both, checked), (carry, state)
            )
            return list(carry), state
        # In chunks: an inner loop, unchecked, of as many steps as the log has room for;
        # each chunk after the first begins with a flush (the one before it stopped for
        # want of room). So the loop's end flushes nothing: what it logged leaves with
        # what follows (a call whose taps fit runs no flush at all).
        most = np.int32(self.plan.capacity - per_step)

        def room(st: Gathered) -> Any:
            return st.count <= most

        def chunk(both: tuple[list[Any], Gathered]) -> tuple[list[Any], Gathered]:
            st = self.flush_if(lax.bitwise_not(room(both[1])), both[1])

            def inner_going_on(inner: tuple[list[Any], Gathered]) -> Any:
                return lax.bitwise_and(room(inner[1]), going_on(inner[0]))

            def inner_step(inner: tuple[list[Any], Gathered]) -> Any:
                return step(inner[0], inner[1], False)

            values, st = lax.while_loop(inner_going_on, inner_step, (both[0], st))
            return values, st

        carry, state = lax.while_loop(lambda both: going_on(both[0]), chunk, (carry, state))
        return list(carry), state


def _where(predicate: Any, new: Any, old: Any) -> Any:
    """`new` where `predicate` (over `new`'s leading dimensions) holds, else `old`."""
    dims = tuple(range(np.ndim(predicate)))
    return lax.select(lax.broadcast_in_dim(predicate, np.shape(new), dims), new, old)


def _scan_operands(params: dict[str, Any], invals: list[Any]) -> list[list[Any]]:
    """A scan's operands as (constants, carry, xs): split by its parameters before JAX
    0.12, by its `ft_in` (a FlatTree of those three groups, as JAX's own rules read it)
    since."""
    if "num_consts" in params:
        consts, carry = int(params["num_consts"]), int(params["num_carry"])
        return [invals[:consts], invals[consts : consts + carry], invals[consts + carry :]]
    return [list(group) for group in params["ft_in"].update(invals).unpack()]


def _bind(eqn: core.JaxprEqn, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)  # type: ignore[no-untyped-call]
    subfuns: Sequence[Any] = ()
    if isinstance(params, tuple):  # (JAX before 0.9: subfuns, params)
        subfuns, params = params
    with eqn.ctx.manager:
        result = eqn.primitive.bind(*subfuns, *invals, **params)  # type: ignore[no-untyped-call]
    return list(result) if eqn.primitive.multiple_results else [result]
