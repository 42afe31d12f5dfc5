"""Which computations are gathered, and the rewrite that gathers one (the room's face,
`tapd.emitter.gathered`, says what the gathered path is): `maybe_gathered` decides from
the settings, the platform and the computation's devices; `rewrite` threads the buffers
(`tapd.emitter.gathered.rewrite`) and adds the way out (`tapd.emitter.gathered.flush`)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax._src import core
from jax._src import linear_util as lu
from jax._src.interpreters import partial_eval as pe

from tapd.emitter import host_writers, jax_compat, lifecycle, outputs_fast_path
from tapd.emitter.gathered import host, sampling, slices, threaded
from tapd.emitter.gathered import live as live_loops
from tapd.emitter.gathered.flush import ClosedJaxpr, FlushPlan, WayOut, call
from tapd.emitter.gathered.live import Pace
from tapd.emitter.gathered.rewrite import (
    NotGatherable,
    Rewriter,
    certainly_taps,
    exact_taps,
    most_records,
    site_operands,
    taps_within,
    taps_within_eqn,
)
from tapd.emitter.native_backend import RingSites
from tapd.emitter.primitive import TapSiteParams, tap_p
from tapd.emitter.taps_as_outputs import OutputsEffect
from tapd.errors import TapDefinitionError

logger = logging.getLogger("tapd.emitter")


def maybe_gathered(
    closed: ClosedJaxpr,
    platforms: Sequence[str],
    axis_context: Any,
    for_export: bool,
    *,
    output: bool = False,
) -> tuple[ClosedJaxpr, OutputsEffect | None] | None:
    """`closed` gathered, where the settings ask and the computation can be (see the
    module docstring), and the effect of its way out where it ends with an output
    (`output`: the module can have one; tapd.emitter.taps_as_outputs); None where it
    keeps the per-tap path."""
    settings = lifecycle.settings()
    if settings.gather == "off" or for_export or len(platforms) != 1:
        return None
    platform = str(platforms[0]).lower()
    if settings.gather == "auto" and platform != "tpu":
        return None
    if not taps_within(closed.jaxpr):
        return None
    # Taps in shard_map or pmap bodies (over one device, or several): each device's.
    chosen = _slices(closed, platform, axis_context, output)
    if chosen is not None:
        return chosen
    one_device = getattr(axis_context, "num_devices", None) == 1
    if not one_device:
        if not _partitioned(axis_context):
            return None
        # A jit the compiler partitions: its taps are of whole (gathered) values, each
        # a callback on its first device; gathered, one flush there, at its end.
        output = False
    # On one device flushes answer, and long loops run live (tapd.emitter.gathered.live).
    live_on = (platform, settings.gather_latency) if one_device else None
    found: dict[TapSiteParams, list[Any]] = {}
    try:
        site_operands(closed.jaxpr, found)
    except NotGatherable:
        return None
    if not all(_host_callback_here(site, platform) for site in found):
        return None
    if not one_device and any(_device_index(site) for site in found):
        return None  # (id_tap's device_index: the per-tap path taps on that device)
    _check_fits(found)
    taps, max_bytes = settings.gather_taps, settings.gather_bytes
    try:
        if output and outputs_fast_path.install():
            try:
                effect = OutputsEffect(len(found))
                gathered, _ = rewrite(
                    closed, found, taps=taps, max_bytes=max_bytes, way_out=effect, live=live_on
                )
                return gathered, effect
            except Exception:  # (a dtype the packing does not take): a flush at the end
                logger.debug("gathered taps end with a flush", exc_info=True)
        gathered, _ = rewrite(closed, found, taps=taps, max_bytes=max_bytes, live=live_on)
        return gathered, None
    except Exception as exc:
        _not_gathered(exc, "the device")
        return None


def _not_gathered(exc: Exception, where: str) -> None:
    """Say why a computation keeps the per-tap path: quietly where the rewrite declined
    it (NotGatherable), aloud where it failed (a JAX this rewrite does not know; its
    taps keep working)."""
    if isinstance(exc, NotGatherable):
        logger.debug("taps not gathered: %s", exc)
        return
    logger.warning(
        "tapd could not gather this computation's taps on %s (one host callback a tap "
        "instead; TAPD_GATHER=off says so for good)",
        where,
        exc_info=exc,
    )


def _slices(
    closed: ClosedJaxpr, platform: str, axis_context: Any, output: bool
) -> tuple[ClosedJaxpr, OutputsEffect | None] | None:
    """A computation over several devices with each shard_map body's taps gathered on
    each device (tapd.emitter.gathered.slices); None where it keeps the per-tap path.
    With `output` (the module can have one), a computation whose one tapping shard_map
    spans its devices ends with each device's buffers as its shard of an output."""
    settings = lifecycle.settings()

    def gather_body(
        body: Any, found: dict[TapSiteParams, list[Any]], varying: tuple[str, ...], packed: bool
    ) -> tuple[Any, FlushPlan]:
        if not all(_host_callback_here(site, platform) for site in found):
            raise NotGatherable("a tap in a body that is not a host callback here")
        _check_fits(found)
        gathered, plan = rewrite(
            _closed(body, []),
            found,
            taps=settings.gather_taps,
            max_bytes=settings.gather_bytes,
            varying=varying,
            ends_packed=packed,
        )
        jaxpr = gathered if isinstance(gathered, core.Jaxpr) else gathered.jaxpr
        if jaxpr.constvars:
            raise NotGatherable("a gathered body with constants")
        return jaxpr, plan

    if platform == "cpu" and not jax_compat.cpu_partition_id_in_branches():
        return None  # (this JAX's CPU compiler would abort on a device's flush in a cond)
    devices = getattr(axis_context, "num_devices", None)
    if output and isinstance(devices, int) and outputs_fast_path.install():
        try:
            packed = _slices_ending_packed(closed, gather_body, devices)
            if packed is not None:
                return packed
        except TapDefinitionError:
            raise
        except Exception:  # (what the packing does not take): a flush at each body's end
            logger.debug("gathered slices end with a flush", exc_info=True)
    if isinstance(devices, int):
        try:
            threaded_result = _threaded(closed, platform, devices, output)
            if threaded_result is not None:
                return threaded_result
        except TapDefinitionError:
            raise
        except Exception:  # (what the rewrite does not take): body by body
            logger.debug("gathered slices body by body", exc_info=True)
    try:
        chosen = slices.gathered_bodies(closed, gather_body)
    except TapDefinitionError:
        raise
    except Exception as exc:
        _not_gathered(exc, "its devices")
        return None
    return None if chosen is None else (chosen, None)


def _threaded(
    closed: ClosedJaxpr, platform: str, devices: int, output: bool
) -> tuple[ClosedJaxpr, OutputsEffect | None] | None:
    """A computation whose taps lie in shard_map bodies over one mesh, each device's
    buffers carried across them (tapd.emitter.gathered.threaded); None where that does
    not apply."""
    mesh = threaded.common_mesh(closed.jaxpr, devices)
    if mesh is None:
        return None
    found: dict[TapSiteParams, list[Any]] = {}
    site_operands(closed.jaxpr, found)
    if not all(_host_callback_here(site, platform) for site in found):
        return None
    _check_fits(found)
    settings = lifecycle.settings()
    taps, max_bytes = settings.gather_taps, settings.gather_bytes
    effect = OutputsEffect(len(found)) if output and outputs_fast_path.install() else None
    gathered, _ = rewrite(closed, found, taps=taps, max_bytes=max_bytes, way_out=effect, mesh=mesh)
    return gathered, effect


def _slices_ending_packed(
    closed: ClosedJaxpr, gather_body: slices.GatherBody, devices: int
) -> tuple[ClosedJaxpr, OutputsEffect] | None:
    """`closed` (over `devices`) ending with each device's packed buffers as its shard
    of its way out (slices.ends_packed, flush.WayOut); None where that does not apply."""
    packed = slices.ends_packed(closed, gather_body, devices, lambda info: _debug_info(info, 1))
    if packed is None:
        return None
    effect = OutputsEffect(len(packed.plan.sites))
    inner = packed.jaxpr if isinstance(closed, core.Jaxpr) else closed.replace(jaxpr=packed.jaxpr)
    effect.refreshed = False  # (a body's flushes do not answer: flags only at dispatch)
    # (Its taps all lie in the one body: the computation's counts are each device's.)
    counts = exact_taps(closed.jaxpr)
    if counts is not None:
        effect.call_counts = tuple(counts[site] for site in packed.plan.sites)
    way_out = WayOut(effect, packed.plan, per_device=True)
    in_avals = [var.aval for var in closed.jaxpr.invars]
    return _as_call(inner, in_avals, closed.jaxpr.debug_info, way_out), effect


def _partitioned(axis_context: Any) -> bool:
    from jax._src import sharding_impls

    return isinstance(axis_context, sharding_impls.ShardingContext)


def _check_fits(found: dict[TapSiteParams, list[Any]]) -> None:
    """What the per-tap path refuses (a tap larger than its whole ring), refused here."""
    for site, avals in found.items():
        native = _ring_of(site)
        if native is not None:
            leaves = site.leaf_count(len(avals))
            tapped = [*avals[:leaves], *(avals[-1:] if site.has_coords else [])]
            host_writers.check_fits(native, site, tapped)


def _host_callback_here(site: TapSiteParams, platform: str) -> bool:
    """Whether the tap would be a host callback here (not tapd's native handler), and
    may leave JAX's token alone (not strict)."""
    if site.strict:
        return False
    local = lifecycle.local_path_of(site.consumer)
    handled = platform in lifecycle.handler_platforms(local=local is not None)
    return _ring_of(site) is None or not handled


def _device_index(site: TapSiteParams) -> int:
    """id_tap's `device_index`: the device of a partitioned jit its taps run on."""
    return int(site.decoded_fields().get("meta", {}).get("device_index", 0))


def _ring_of(site: TapSiteParams) -> RingSites | None:
    """The ring the site's taps are written to (None: they go to the sender)."""
    local = lifecycle.local_path_of(site.consumer)
    return local if local is not None else lifecycle.get_sender().native


def rewrite(
    closed: ClosedJaxpr,
    found: dict[TapSiteParams, list[Any]],
    *,
    taps: int,
    max_bytes: int,
    way_out: OutputsEffect | None = None,
    varying: tuple[str, ...] = (),
    live: tuple[str, float] | None = None,
    ends_packed: bool = False,
    mesh: Any = None,
) -> tuple[ClosedJaxpr, FlushPlan]:
    """`closed` with its taps gathered (see the module docstring); raises NotGatherable.

    `found`: its sites and their operands' avals (`site_operands`); `taps` and
    `max_bytes` size the buffers (`plan_buffers`); with `way_out`, the computation
    takes its sites' wake flags and ends with its buffers as an output (`call`);
    `varying`: in a shard_map body, the manual axes its buffers vary along; `live`: on
    one device, (the platform, `gather_latency`): its flushes answer with fresh wake
    flags, and its long loops run live (tapd.emitter.gathered.live); `ends_packed`: a
    shard_map body that takes the wake flags first and returns its packed buffers last
    (no flush at its end: tapd.emitter.gathered.slices.ends_packed); `mesh`: a
    computation over several devices whose taps lie in shard_map bodies over `mesh`,
    each device's buffers carried across them (tapd.emitter.gathered.threaded; its way
    out, each device's its shard). Returns the gathered jaxpr and its buffers' plan."""
    sites = list(found)
    records = most_records(closed.jaxpr)
    packs = way_out is not None or ends_packed
    # Where each call brings the flags, a site the device samples by its own `every=K`
    # keeps one tap in K at most: its log is sized for those.
    kept = most_kept(closed.jaxpr, sites) if packs else records
    if kept < records:  # (a row more: a tap not kept is written where the next would go)
        kept += 1
    hint = 0 if math.isinf(kept) else int(kept)
    log_bytes = lifecycle.settings().gather_log_bytes
    # (A loop paced live sends its whole log with each chunk's flush: where one may run,
    # the log stays small.)
    long = _may_run_long(closed.jaxpr, live)
    plan = plan_buffers(
        sites,
        [found[s] for s in sites],
        hint,
        taps=taps,
        max_bytes=max_bytes,
        log_bytes=log_bytes,
        may_run_long=long,
    )
    if kept < records:
        plan = dataclasses.replace(plan, sampled_bound=True)
    if live is not None:
        plan = dataclasses.replace(plan, answers=True, pace=Pace(live[1]))
    # The wake flags come in with a call that ends with an output, and on one device
    # again with each answer of a live chunk's flush or poll, so that a site woken while
    # a long loop runs takes its taps from the next chunk on. Over several devices they
    # come with the call only (flushes do not answer). Without them every tap is kept,
    # and a flush skips those of dormant sites.
    assert way_out is None or plan.answers or mesh is not None, "flags its flushes renew"
    platform, latency = live if live is not None else ("cpu", 0.0)
    rewriter: Rewriter
    if mesh is not None:
        rewriter = threaded.Threaded(plan, mesh)
    else:
        rewriter = Rewriter(plan, varying, platform=platform, latency=latency)
    in_avals = [var.aval for var in closed.jaxpr.invars]
    flags_avals = [plan.flags_aval()] if packs else []

    def gathered(*args: Any) -> list[Any]:
        flags, args = (args[0], args[1:]) if packs else (None, args)
        state = rewriter.empty(flags)
        outs, state = rewriter.run(
            closed.jaxpr, closed.consts, list(args), state, checked=not plan.never_full
        )
        if packs:
            packed = rewriter.packed(state)
            if way_out is not None and mesh is None:  # (one device's output)
                packed = host.as_rows(packed)
            return [*outs, packed]
        rewriter.final(state, certain=certainly_taps(closed.jaxpr))
        return outs

    debug_info = _debug_info(closed.jaxpr.debug_info, len(flags_avals))
    traced = pe.trace_to_jaxpr_dynamic(
        lu.wrap_init(gathered, debug_info=debug_info), [*flags_avals, *in_avals]
    )
    inner = _closed(traced[0], traced[2])
    if way_out is not None:  # (its dormant calls' buffers need not move: taps_as_outputs)
        way_out.refreshed = rewriter.answers_traced
        way_out.sampled_bound = plan.sampled_bound
        counts = exact_taps(closed.jaxpr)
        if counts is not None:
            way_out.call_counts = tuple(counts[site] for site in sites)
    # The flushes' order (primitive.PROGRAM_ORDER) is kept inside the computation.
    out = None if way_out is None else WayOut(way_out, plan, per_device=mesh is not None)
    debug_info = closed.jaxpr.debug_info
    if ends_packed:
        debug_info = _debug_info(debug_info, 1)
    outer_avals = [*(flags_avals if ends_packed else []), *in_avals]
    return _as_call(inner, outer_avals, debug_info, out), plan


def _may_run_long(jaxpr: core.Jaxpr, live: tuple[str, float] | None) -> bool:
    """Whether a loop of `jaxpr` may run live (`live`: on one device, the platform and
    `gather_latency`): its work estimated at a quarter of the latency or more."""
    if live is None:
        return False
    try:
        seconds = live_loops.estimated_seconds(jaxpr, live[0])
    except Exception:  # (an equation the estimate does not know: taken as long)
        seconds = math.inf
    return live_loops.is_live(seconds, False, live[1])


def _as_call(inner: ClosedJaxpr, in_avals: list[Any], debug_info: Any, way_out: Any) -> Any:
    """`inner` as one `flush.call` (its flushes' token made inside; `way_out`, if any,
    its exit), traced over `in_avals`."""
    wrapped = lu.wrap_init(lambda *args: call(inner, args, way_out), debug_info=debug_info)
    traced = pe.trace_to_jaxpr_dynamic(wrapped, in_avals)
    return _closed(traced[0], traced[2])


def _debug_info(debug_info: Any, flags: int) -> Any:
    """The computation's debug info, for a jaxpr with `flags` more arguments first and
    one more result last (the wake flags and the packed buffers)."""
    if not flags or debug_info is None:
        return debug_info
    names = getattr(debug_info, "arg_names", None)
    results = getattr(debug_info, "result_paths", None)
    changes: dict[str, Any] = {}
    if isinstance(names, tuple):
        changes["arg_names"] = ("tapd_wake_flags", *names)
    if isinstance(results, tuple):
        changes["result_paths"] = (*results, "tapd_gathered")
    replace = getattr(debug_info, "_replace", None)
    return replace(**changes) if replace is not None and changes else None


def _closed(jaxpr: Any, consts: list[Any]) -> Any:
    """A jaxpr with its constants: a ClosedJaxpr before JAX 0.12, a Jaxpr holding them
    since (whose constructor still takes the pair)."""
    make: Any = getattr(core, "ClosedJaxpr", core.Jaxpr)
    return make(jaxpr, consts)


def most_kept(jaxpr: core.Jaxpr, sites: Sequence[TapSiteParams]) -> float:
    """The most records one run of `jaxpr` keeps where each call brings the sites' flags
    (inf where a `while` loop taps): each site's most taps, one in K where the device
    samples it by its own `every=K` whatever its consumers ask (`_sampled_by`)."""
    taps = _most_taps_by_site(jaxpr)
    if taps is None:
        return math.inf
    return float(sum(-(-count // _sampled_by(site, sites)) for site, count in taps.items()))


def _sampled_by(site: TapSiteParams, sites: Sequence[TapSiteParams]) -> int:
    """K where every call's flags make the device keep at most one of the site's taps in
    K (`host.SiteWriter.keep`, `sampling.keep_flag`): it writes a ring, is not `always`,
    and is its consumer's only site here; else 1."""
    every = site.every
    if every <= 1 or every >= sampling.MOST or site.always or _ring_of(site) is None:
        return 1
    if sum(other.consumer == site.consumer for other in sites) != 1:
        return 1
    return every


def _most_taps_by_site(jaxpr: core.Jaxpr) -> dict[TapSiteParams, int] | None:
    """Each site's most taps in one run of `jaxpr` (None where a `while` loop taps)."""
    total: dict[TapSiteParams, int] = {}
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        parts: list[dict[TapSiteParams, int]] = []
        if eqn.primitive is tap_p:
            parts = [{eqn.params["site"]: 1}]
        elif not taps_within_eqn(eqn):
            continue
        elif name == "while":
            return None
        elif name == "cond":
            branches = [_most_taps_by_site(b.jaxpr) for b in eqn.params["branches"]]
            if any(b is None for b in branches):
                return None
            found = [b for b in branches if b is not None]
            keys = {site for b in found for site in b}
            parts = [{site: max(b.get(site, 0) for b in found) for site in keys}]
        else:
            subs = [_most_taps_by_site(sub) for sub in core.jaxprs_in_params(eqn.params)]
            if any(sub is None for sub in subs):
                return None
            times = eqn.params["length"] if name == "scan" else 1
            parts = [{k: v * times for k, v in sub.items()} for sub in subs if sub is not None]
        for part in parts:
            for site, count in part.items():
                total[site] = total.get(site, 0) + count
    return total


# Why one log for a run whose records are counted before it runs (`plan_buffers`,
# `gather_log_bytes`): a flush while it runs puts a host callback in the computation,
# which costs a TPU ~2 ms a call, run or not, and the Python path. On the TPU v5e,
# woken / dormant ÷ the floor of moving the bytes, one log against logs of 8 MiB: 1 MiB
# x 9 0.93 / 0.12 against 1.21 / 0.46; 4 MiB x 3 2.91 / 0.15 against 5.48 / 0.78
# (bench/RESULTS-tpu.md, session 19). A log is fetched as words in rows of 128
# (`host.as_rows`): the host's cost of fetching 32 MiB or more is its page faults on the
# memory it maps afresh for each array, whatever its shape, and the floor's `scan`
# outputs pay them alike (tpu_fetch_probe, retired, session 21). A run that may be paced
# live takes one log only where it packs into this many times `gather_bytes` (its
# count within `gather_taps`), as before session 21.
LONG_RUN_LOG = 2


def plan_buffers(
    sites: list[TapSiteParams],
    operand_avals: list[list[Any]],
    records: int,
    *,
    taps: int,
    max_bytes: int,
    log_bytes: int,
    may_run_long: bool = False,
) -> FlushPlan:
    """Buffers for `taps` records at most (fewer where one run makes fewer, `records`,
    0 if unbounded), and at most `max_bytes` of them (at least one record); a run's
    `records`, where they pack into `log_bytes` (`gather_log_bytes`), in one log, however
    many. Where the run `may_run_long` (a loop in it paced live flushes its whole log
    each chunk: tapd.emitter.gathered.live), only if they are at most `taps` and pack
    into LONG_RUN_LOG times `max_bytes`."""
    row_bytes = sum(
        int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
        for avals in operand_avals
        for a in avals
    )
    capacity = max(1, min(taps, max_bytes // max(row_bytes, 1)))
    bound = min(log_bytes, LONG_RUN_LOG * max_bytes) if may_run_long else log_bytes
    if capacity < records and (records <= taps or not may_run_long):
        # (the packed size reckoned only past one log)
        one_log = host.packed_size(host.packed_layout(len(sites), records, operand_avals))
        if one_log <= bound:
            capacity = records
    never_full = 0 < records <= capacity
    if records > 0:
        # As many flushes as the most buffers need, each as full as the next: 9 records
        # of a log of 8 move as 5 and 4 (10 rows), not as 8 and 1 (16 rows: the last
        # log moves whole), so that cost grows with records, with no step at a log's size.
        flushes = -(-records // capacity)
        capacity = -(-records // flushes)
    return FlushPlan(
        sites=tuple(sites),
        operand_avals=tuple(
            tuple(core.ShapedArray(a.shape, a.dtype) for a in avals)  # (ShapedArrays)
            for avals in operand_avals
        ),
        capacity=capacity,
        never_full=never_full,
    )
