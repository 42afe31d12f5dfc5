"""How a tap becomes XLA: the native FFI handler, or a Python callback into the ring.

Chosen per tap when JAX lowers it, by what this process has:
- **native**: the platform has tapd's FFI handler (CPU; CUDA where built): XLA calls the
  C++ handler, which copies the operands into the shared-memory ring. No Python runs.
- **portable, ring**: a host callback (what `jax.debug.callback` uses) whose Python
  function makes one call into the native library, which writes the same ring record
  the handler would. TPU, or a platform without tapd's handler.
- **portable, sender**: no ring here (the daemon is not on this host, or the native
  library cannot load): the callback copies the leaves and hands them to the `Sender`.

Whichever runs, the record is the same: site id (the site is registered in the
`.sites` file at lowering time), seq, step, device and shard coordinates. The device is
an operand of the callback (the partition or replica id, mapped to the local device
ordinal the FFI handler would report), so both backends give the same `meta.device`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax._src import core, ffi, sharding_impls
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import (
    dormant_twin,
    entries,
    gathered,
    host_writers,
    jax_compat,
    lifecycle,
    order,
    primitive,
    program_order,
)
from tapd.emitter.native_backend import FFI_TARGET, RingSites
from tapd.emitter.primitive import ORDERED, PROGRAM_ORDER, TapSiteParams
from tapd.emitter.taps_as_outputs import OutputsEffect
from tapd.errors import TapDefinitionError
from tapd.protocol.ring_format import RINGS, writer_every

logger = logging.getLogger("tapd.emitter")


def lower_tap(ctx: mlir.LoweringRuleContext, *operands: Any, site: TapSiteParams) -> list[Any]:
    leaf_count = site.leaf_count(len(operands))
    leaves = list(operands[:leaf_count])
    leaf_avals = list(ctx.avals_in[:leaf_count])
    rest = list(operands[leaf_count:])
    rest_avals = list(ctx.avals_in[leaf_count:])
    step, step_aval = (rest[0], rest_avals[0]) if site.has_step else (None, None)
    coords, coords_aval = (rest[-1], rest_avals[-1]) if site.has_coords else (None, None)
    # The ring record's leaves: the tapped leaves, then the shard coordinates, which the
    # daemon takes off again (site field "shard").
    tapped = [*leaves, *([coords] if site.has_coords else [])]
    tapped_avals = [*leaf_avals, *([coords_aval] if site.has_coords else [])]

    # A site whose function runs in this process writes the local ring, which needs no
    # daemon (tapd.emitter.local); any other, the daemon's ring (or its sender).
    local = lifecycle.local_path_of(site.consumer)
    native: RingSites | None = local if local is not None else lifecycle.get_sender().native
    ring = RINGS["local" if local is not None else "daemon"]
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    # Strict: JAX's runtime token. Otherwise the computation's own, PROGRAM_ORDER's,
    # which JAX threads through every loop, branch and call (tapd.emitter.program_order);
    # where a lowering rule did not pass it in, the chain of this block only
    # (tapd.emitter.order).
    own_order = site.ordered and not site.strict
    chained = own_order and PROGRAM_ORDER in ctx.tokens_in.effects()
    token = ctx.tokens_in.get(ORDERED) if site.strict else None
    if chained:
        token = ctx.tokens_in.get(PROGRAM_ORDER)
    elif own_order:
        token = order.before_tap(ctx)
    axis_context = module.axis_context
    # A jit the compiler partitions whose mesh the trace could not see (tapping.emit
    # wraps the others in shard_map): only JAX's own callback targets keep the one-device
    # placement XLA needs there, so the tap goes through a callback, on the gathered value.
    partitioned = (
        isinstance(axis_context, sharding_impls.ShardingContext) and axis_context.num_devices > 1
    )
    handled_here = platform in lifecycle.handler_platforms(local=local is not None)
    native_here = native is not None and handled_here and not partitioned
    if jax_compat.lowering_for_export(ctx):
        _check_exportable(site, local=local is not None, native=native_here, platform=platform)
    if native is not None:
        host_writers.check_fits(native, site, tapped_avals)
    if native_here:
        assert native is not None
        fields = host_writers.site_fields(site, platform)
        leaf_entries = primitive.leaf_descriptions(tapped_avals)
        site_id = native.register_site(site.consumer, fields, leaf_entries)
        # The custom call names its site by its entry, not by this process's site id:
        # the same HLO in every process (the persistent cache), and a computation
        # compiled elsewhere still names it (jax.export; tapd.emitter.entries).
        entry = entries.encode(
            site.consumer if local is None else local.entry_name(site.consumer),
            fields,
            leaf_entries,
        )
        native.ring.put_entry(entry.encode("ascii"), site_id, native.consumer_id(site.consumer))
        operand_values = [*tapped, *([step] if site.has_step else [])]
        operand_avals = [*tapped_avals, *([step_aval] if site.has_step else [])]
        new_token = _emit_ffi_call(
            ctx,
            token,
            operand_values,
            operand_avals,
            entry=entry,
            has_step=site.has_step,
            # (an int64 attribute: the always bit, bit 63, makes it negative)
            every=np.uint64(writer_every(site.every, site.always)).astype(np.int64),
            ring=ring,
        )
    else:
        # A gathered tap in a partitioned jit runs on one device: id_tap's device_index.
        where = int(site.decoded_fields().get("meta", {}).get("device_index", 0))
        devices = getattr(axis_context, "num_devices", 1)
        if not partitioned or not 0 <= where < devices:
            where = 0
        # The device's index: an operand where each device runs the callback (inside
        # shard_map/pmap), else `where`, known now (one operand less to convert a call).
        device_operand = host_writers.partition_index(ctx)
        devices_at = host_writers.DeviceOrdinals(
            host_writers.local_ordinals(ctx), None if device_operand else where
        )
        callback = host_writers.ring_writer if native is not None else host_writers.sender_writer
        fields = host_writers.site_fields(site, platform)
        host_function = callback(native, site, fields, tapped_avals, devices_at)
        device_values, device_avals = device_operand or ([], [])
        operand_values = [*tapped, *([step] if site.has_step else []), *device_values]
        callback_avals: list[Any] = [
            *tapped_avals,
            *([step_aval] if site.has_step else []),
            *device_avals,
        ]
        # The callback's custom call is laid out from its context's avals: ours.
        callback_ctx = dataclasses.replace(ctx, avals_in=callback_avals, avals_out=[])
        sharding = jax_compat.callback_op_sharding(
            axis_context, _single_device(axis_context, where)
        )

        def emit(token: Any) -> Any:
            return jax_compat.emit_python_callback(
                callback_ctx,
                host_function,
                token,
                operand_values,
                callback_avals,
                returns_token=site.ordered,
                sharding=sharding,
            )

        if native is not None and _guarded_here(platform, axis_context, tapped_avals):
            wanted = _ring_guard(native, site, fields, tapped_avals, devices_at)
            # The question keeps an operand where its device is known (its index, unread):
            # without one it cost a dormant 1 MiB tap more (bench/RESULTS.md §9, portable).
            question, question_avals = device_operand or _constant_index(where)
            new_token = _emit_guarded(ctx, wanted, token, question, question_avals, sharding, emit)
        else:
            new_token = emit(token)
    if site.strict and token is not None:
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({ORDERED: new_token})))
    elif chained:
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({PROGRAM_ORDER: new_token})))
    elif own_order:
        order.after_tap(ctx, new_token)
    return leaves


def _check_exportable(site: TapSiteParams, *, local: bool, native: bool, platform: Any) -> None:
    """What `jax.export` cannot carry to another process, refused as it is exported,
    naming the site: a tap function of this process, and a tap that would be a host
    callback (a Python function of this process; the portable backend)."""
    if local:
        raise TapDefinitionError(
            f"tap site {site.consumer!r} cannot be exported: its tap function runs in the "
            "process that traced it (an id_tap of a closure, tapd.debug). Tap it by a "
            "name a subscriber takes (tapd.tap(x, 'name'), or an importable function)"
        )
    if not native:
        raise TapDefinitionError(
            f"tap site {site.consumer!r} cannot be exported for platform {platform!r}: it "
            "would be a host callback there (the portable backend, a daemon on another "
            "host, or a jit the compiler partitions); only tapd's native handler travels "
            "(tapd doctor says where it is built)"
        )


def _emit_ffi_call(
    ctx: mlir.LoweringRuleContext,
    token: Any,
    operands: Sequence[Any],
    avals: Sequence[Any],
    **attributes: Any,
) -> Any:
    """The custom call of tapd's handler, taking and returning the ordering token when
    there is one (the handler skips token arguments)."""
    with_token = token is not None
    call_ctx = dataclasses.replace(
        ctx,
        avals_in=[*([core.abstract_token] if with_token else []), *avals],
        avals_out=[core.abstract_token] if with_token else [],
    )
    op = ffi.build_ffi_lowering_function(FFI_TARGET, has_side_effect=True)(
        call_ctx,
        *([token] if with_token else []),
        *operands,
        **{
            name: value if isinstance(value, str) else np.int64(value)
            for name, value in attributes.items()
        },
    )
    sharding = jax_compat.callback_op_sharding(ctx.module_context.axis_context, None)
    if sharding is not None:
        jax_compat.set_sharding(ctx.module_context, op, sharding)
    return op.results[0] if with_token else None


def _single_device(axis_context: Any, index: int) -> Any:
    """The sharding that places a gathered tap on device `index` of a partitioned jit."""
    if index == 0 or not isinstance(axis_context, sharding_impls.ShardingContext):
        return None  # JAX's default: the first device
    assignment = axis_context.device_assignment
    return None if not assignment else jax_compat.single_device_sharding(assignment[index])


def _constant_index(index: int) -> tuple[list[Any], list[Any]]:
    return [mlir.ir_constant(np.uint32(index))], [core.ShapedArray((), np.dtype(np.uint32))]


# A portable tap of this many bytes or more first asks whether its site wants it
# (`_ring_guard`): JAX's host callback copies its operands to the host before any of
# tapd's Python runs (a dormant 1 MiB tap added 172 µs a call on the benchmark CPU
# without the question, bench/RESULTS.md §9 at 7ef3e29), and a device-to-host transfer
# on a GPU, which a dormant tap would then throw away. A small tap's copy costs less
# than the question's own callback (a dormant 64 B portable tap adds ~5 µs, the callback
# alone); where between the two the crossover lies was not measured: 64 KiB is a guess
# on the safe side.
_GUARD_BYTES = 64 * 1024
# Where a host callback holds up the computation anyway, so that asking costs one more
# small callback. A TPU goes on past an unordered tap's callback without waiting for the
# host; there the question would add a wait per tap: not measured, so not asked.
_GUARD_PLATFORMS = frozenset({"cpu", "cuda", "rocm"})


def _guarded_here(platform: str | None, axis_context: Any, tapped_avals: Sequence[Any]) -> bool:
    """Whether a portable tap into the ring is guarded: big enough, on a platform of
    `_GUARD_PLATFORMS`, in a computation on one device (a partitioned module's
    conditional on a host value is not tried)."""
    nbytes = sum(int(np.prod(aval.shape)) * aval.dtype.itemsize for aval in tapped_avals)
    one_device = (
        isinstance(axis_context, sharding_impls.ShardingContext) and axis_context.num_devices == 1
    )
    return nbytes >= _GUARD_BYTES and platform in _GUARD_PLATFORMS and one_device


def _ring_guard(
    native: RingSites,
    site: TapSiteParams,
    fields: dict[str, Any],
    tapped_avals: Sequence[Any],
    devices_at: host_writers.DeviceOrdinals,
) -> Callable[..., tuple[Any]]:
    """The host function a guarded tap asks first: 1 if its site takes this tap, 0 if it
    is dormant or sampled out (its seq then used up and counted as skipped, as
    `host_writers.ring_writer` does; the one that writes decides again, the same way)."""
    site_id, consumer_id, every, lib = host_writers.ring_site(native, site, fields, tapped_avals)
    skip = lib.tapd_ring_skip
    handle = native.ring.handle

    def wanted(*args: Any) -> tuple[Any]:
        lifecycle.host_callback_ran()
        device = devices_at(args)
        return (np.int32(0 if skip(handle, site_id, consumer_id, device, every) else 1),)

    return wanted


def _emit_guarded(
    ctx: mlir.LoweringRuleContext,
    wanted: Callable[..., tuple[Any]],
    token: Any,
    device_values: list[Any],
    device_avals: list[Any],
    sharding: Any,
    emit: Callable[[Any], Any],
) -> Any:
    """`wanted(*device_values)` as a host callback, then a `case` on its answer whose second
    branch is the tap's own callback (`emit`); returns the token after both (None
    without one). The question takes the tap's token first, and the `case` returns
    the one the next tap takes."""
    flag_aval = core.ShapedArray((), np.int32)
    question_ctx = dataclasses.replace(ctx, avals_in=device_avals, avals_out=[flag_aval])
    flag, asked = jax_compat.emit_python_callback_with_result(
        question_ctx, wanted, token, device_values, device_avals, flag_aval, sharding=sharding
    )
    case = hlo.CaseOp([hlo.TokenType.get()] if asked is not None else [], flag, 2)
    skipped, taken = case.regions[0].blocks.append(), case.regions[1].blocks.append()
    with ir.InsertionPoint(skipped):
        hlo.ReturnOp([asked] if asked is not None else [])
    with ir.InsertionPoint(taken):
        written = emit(asked)
        hlo.ReturnOp([written] if asked is not None else [])
    return case.results[0] if asked is not None else None


def _lower_module_in_order(lower: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`mlir.lower_jaxpr_to_module`, on the computation with its taps gathered on the
    device (tapd.emitter.gathered) where they are, else with its ordered taps chained
    by one token (tapd.emitter.program_order)."""
    gathered.start_module()
    args, kwargs, effect = _rewritten(args, kwargs)
    result = lower(*args, **kwargs)
    way_out = gathered.module_way_out()
    if way_out is not None:
        with result.module.context:
            position = gathered.attach_way_out(result.module, way_out)
            if effect is not None:
                dormant_twin.keep_module(effect, result.module, position)
    return result


def _rewritten(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any], OutputsEffect | None]:
    """The module's jaxpr gathered, or chained; else the arguments as they came. With
    them, the gathered computation's way out, where its taps leave as an output."""
    closed = args[1] if len(args) > 1 else kwargs.get("jaxpr")
    if closed is None:
        return args, kwargs, None
    parameters = kwargs.get("lowering_parameters")
    ordered_effects = kwargs.get("ordered_effects")
    ordered_effects = ordered_effects if isinstance(ordered_effects, list) else None
    chosen = gathered.maybe_gathered(
        closed,
        kwargs.get("platforms") or (),
        kwargs.get("axis_context"),
        bool(getattr(parameters, "for_export", False)),
        # The way out is an ordered effect: JAX's caller keeps this very list, and so
        # passes the effect's token in and out of each call (taps_as_outputs).
        output=ordered_effects is not None,
    )
    way_out = None
    if chosen is not None:
        rewritten, way_out = chosen
        if way_out is not None and ordered_effects is not None:
            ordered_effects.append(way_out)
    else:
        rewritten = program_order.chained(closed, ordered_effects)
        if rewritten is None:
            return args, kwargs, None
    if len(args) > 1:
        return (args[0], rewritten, *args[2:]), kwargs, way_out
    return args, {**kwargs, "jaxpr": rewritten}, way_out


primitive.register_lowering(lower_tap)
jax_compat.wrap_module_lowering(_lower_module_in_order)
