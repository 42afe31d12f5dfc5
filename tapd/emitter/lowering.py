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

import ctypes
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core, ffi, sharding_impls
from jax._src import mesh as mesh_lib
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]
from jax.sharding import Mesh, SingleDeviceSharding

from tapd.emitter import entries, jax_compat, lifecycle, native_backend, order, primitive
from tapd.emitter.device_names import device_names
from tapd.emitter.native_backend import FFI_TARGET, RingSites
from tapd.emitter.primitive import ORDERED, TapSiteParams
from tapd.emitter.sender import TapSite
from tapd.errors import TapDefinitionError
from tapd.native import library
from tapd.native.ring import NO_STEP
from tapd.protocol.ring_format import EVERY_ALWAYS_BIT, RINGS, writer_every

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
    # daemon (tapd.emitter.local_path); any other, the daemon's ring (or its sender).
    local = lifecycle.local_path_of(site.consumer)
    native: RingSites | None = local if local is not None else lifecycle.get_sender().native
    ring = RINGS["local" if local is not None else "daemon"]
    module = ctx.module_context
    platform = module.platforms[0] if len(module.platforms) == 1 else None
    # Strict: JAX's token; otherwise tapd's own (tapd.emitter.order), or none.
    own_order = site.ordered and not site.strict
    token = ctx.tokens_in.get(ORDERED) if site.strict else None
    if own_order:
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
    if native_here:
        assert native is not None
        fields = _site_fields(site, platform)
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
        device_operand = _partition_index(ctx)
        devices_at = _DeviceOrdinals(_local_ordinals(ctx), None if device_operand else where)
        callback = _ring_callback if native is not None else _sender_callback
        fields = _site_fields(site, platform)
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
        order.strict_tap_lowered()
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


def _site_fields(site: TapSiteParams, platform: str | None) -> dict[str, Any]:
    """The site's fields; a site that asked for its device (`tap_with_device`) also gets
    the device's platform and what this JAX calls its devices, so that a subscriber
    names it as this process's JAX does (`cpu:0`, `TFRT_CPU_0`: tapd.emitter.device_names)."""
    fields = site.site_fields()
    meta = fields.get("meta", {})
    if meta.get("tap_with_device") and platform is not None:
        fields["meta"] = {**meta, "device_platform": platform, **device_names(platform)}
    return fields


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
    return None if not assignment else SingleDeviceSharding(assignment[index])


def _partition_index(ctx: mlir.LoweringRuleContext) -> tuple[list[Any], list[Any]] | None:
    """([this device's index in the computation's device assignment, a u32 scalar], its
    aval) inside shard_map/pmap, where the callback runs on every device; None under a
    jit (ShardingContext), where it runs once, on one device known when it is lowered."""
    if not isinstance(ctx.module_context.axis_context, sharding_impls.SPMDAxisContext):
        return None
    value = hlo.partition_id()
    scalar = ir.RankedTensorType.get([], ir.IntegerType.get_unsigned(32))
    if value.type != scalar:
        value = hlo.reshape(scalar, value)
    return [value], [core.ShapedArray((), np.dtype(np.uint32))]


def _constant_index(index: int) -> tuple[list[Any], list[Any]]:
    return [mlir.ir_constant(np.uint32(index))], [core.ShapedArray((), np.dtype(np.uint32))]


class _DeviceOrdinals:
    """The local device ordinal a host callback reports, from its device's index in the
    assignment (its last operand), or `fixed`: the one it always runs on."""

    def __init__(self, ordinals: Sequence[int], index: int | None) -> None:
        self.table = tuple(ordinals)
        self.fixed = None if index is None else self.of(index)

    def of(self, index: int) -> int:
        return self.table[index] if index < len(self.table) else index

    def __call__(self, args: Sequence[Any]) -> int:
        return self.fixed if self.fixed is not None else self.of(int(args[-1]))


def _local_ordinals(ctx: mlir.LoweringRuleContext) -> list[int]:
    """The local device ordinal (what XLA's FFI calls DeviceOrdinal) of each device of
    the computation's device assignment, which `_partition_index` gives; -1 for another
    process's device."""
    context = ctx.module_context.axis_context
    devices: Sequence[Any] = ()
    if isinstance(context, sharding_impls.ShardingContext):
        devices = context.device_assignment or ()
    elif isinstance(context, sharding_impls.SPMDAxisContext):
        devices = _mesh_devices(context.mesh)
    ordinals = []
    for device in devices:
        ordinal = getattr(device, "local_hardware_id", None)
        ordinals.append(-1 if ordinal is None else int(ordinal))
    return ordinals


def _mesh_devices(mesh: Any) -> tuple[Any, ...]:
    """The devices of a shard_map's mesh, in partition order. Its mesh may be abstract
    here; the concrete one is then the ambient mesh (`jax.set_mesh`, or the one
    shard_map was given). With neither, the local devices in order (the callback then
    reports the partition index's local device, right for meshes made in that order)."""
    if isinstance(mesh, Mesh):
        return tuple(mesh.devices.flat)
    concrete = mesh_lib.get_concrete_mesh()
    if concrete is not None and not concrete.empty and concrete.shape_tuple == mesh.shape_tuple:
        return tuple(concrete.devices.flat)
    return tuple(jax.local_devices())


def _ring_site(
    native: RingSites, site: TapSiteParams, fields: dict[str, Any], tapped_avals: Sequence[Any]
) -> tuple[int, int, int, ctypes.CDLL]:
    """(site id, consumer id, every, the ring library): what a portable tap's host
    functions hand the library. The same ids each time for the same site (a guarded tap
    registers it twice: its question and its write)."""
    site_id = native.register_site(site.consumer, fields, primitive.leaf_descriptions(tapped_avals))
    lib = library.load()
    assert lib is not None  # the ring exists, so the library loaded
    every = writer_every(site.every, site.always)
    return site_id, native.consumer_id(site.consumer), every, lib


def _ring_callback(
    native: RingSites | None,
    site: TapSiteParams,
    fields: dict[str, Any],
    tapped_avals: Sequence[Any],
    devices_at: _DeviceOrdinals,
) -> Callable[..., tuple[()]]:
    """The host function of a portable tap: one call into the library writes the record.
    A dormant or sampled-out tap (the ring's site table) returns before any copy, its
    seq used up and counted as skipped by `tapd_ring_skip`; JAX's callback itself (and,
    off CPU, its device-to-host transfer of the operands) is still paid, unless the
    tap is big enough to ask first (`_emit_guarded`). A site that takes every tap
    (`always`, no `every=K`) need not ask.

    It runs in the step, on the thread that runs the computation (the dispatching one
    on CPU), so every call counts: a leaf of up to `_COPIED_BYTES` is handed to the
    library as a ctypes copy, whose address costs a fifth of `ndarray.ctypes.data`'s
    (bench/RESULTS.md §10, portable (b))."""
    assert native is not None
    site_id, consumer_id, every, lib = _ring_site(native, site, fields, tapped_avals)
    skip, write = _unconverted(lib, "tapd_ring_skip"), _unconverted(lib, "tapd_ring_write_leaves")
    asks = not (every & EVERY_ALWAYS_BIT and every & ~EVERY_ALWAYS_BIT <= 1)
    # Each argument a ctypes value of its C type, made once where it can be.
    handle = ctypes.c_void_p(native.ring.handle)  # (the daemon's ring, or the local one)
    site_c, consumer_c = ctypes.c_uint64(site_id), ctypes.c_uint32(consumer_id)
    every_c, count_c = ctypes.c_uint64(every), ctypes.c_uint32(len(tapped_avals))
    fixed = None if devices_at.fixed is None else ctypes.c_int32(devices_at.fixed)
    device_of, no_step = devices_at.of, ctypes.c_int64(NO_STEP)
    int32, int64 = ctypes.c_int32, ctypes.c_int64
    count = len(tapped_avals)
    has_step = site.has_step
    pointer_array = ctypes.c_void_p * count
    size_array = ctypes.c_uint64 * count
    addressof, chars = ctypes.addressof, _char_array

    def write_record(*args: Any) -> tuple[()]:
        # Runs on an XLA thread; the arrays view XLA's buffers: copy them into the ring
        # now, in this one call, and keep nothing.
        device = fixed if fixed is not None else int32(device_of(int(args[-1])))
        if asks and skip(handle, site_c, consumer_c, device, every_c):
            return ()  # dormant or sampled out: counted, nothing copied
        pointers, sizes, kept = pointer_array(), size_array(), []
        for i in range(count):
            leaf = np.ascontiguousarray(args[i])
            sizes[i] = size = leaf.nbytes
            if size <= _COPIED_BYTES:
                leaf = chars(size).from_buffer_copy(leaf)
                pointers[i] = addressof(leaf)
            else:
                pointers[i] = leaf.ctypes.data
            kept.append(leaf)  # (alive until the library has copied it)
        step = int64(int(args[count])) if has_step else no_step
        write(handle, site_c, consumer_c, device, step, every_c, count_c, pointers, sizes)
        return ()

    return write_record


def _unconverted(lib: ctypes.CDLL, name: str) -> Any:
    """The ring library's function `name` returning an int, without ctypes' conversion
    of its arguments (`argtypes`, ~0.5 µs a call of `tapd_ring_write_leaves`): each
    argument must be a ctypes value of its C type."""
    function = lib._FuncPtr((name, lib))  # (the CDLL's own function type, unbound)
    function.restype = ctypes.c_int
    return function


# A portable tap's leaf of up to this many bytes goes to the library as a ctypes copy
# (`_ring_callback`): one more copy, cheaper than asking numpy for the address up to a
# few KiB.
_COPIED_BYTES = 4096


@functools.cache
def _char_array(size: int) -> Any:
    return ctypes.c_char * size


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
    devices_at: _DeviceOrdinals,
) -> Callable[..., tuple[Any]]:
    """The host function a guarded tap asks first: 1 if its site takes this tap, 0 if it
    is dormant or sampled out (its seq then used up and counted as skipped, as
    `_ring_callback` does; the one that writes decides again, the same way)."""
    site_id, consumer_id, every, lib = _ring_site(native, site, fields, tapped_avals)
    skip = lib.tapd_ring_skip
    handle = native.ring.handle

    def wanted(*args: Any) -> tuple[Any]:
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
    without one). The question takes the chain's token first and is marked a tap of it,
    so that tapd's order pass places it as it places taps; the `case`, which returns
    the next token, is the tap itself to the pass (`order.after_tap`)."""
    flag_aval = core.ShapedArray((), np.int32)
    question_ctx = dataclasses.replace(ctx, avals_in=device_avals, avals_out=[flag_aval])
    flag, asked = jax_compat.emit_python_callback_with_result(
        question_ctx, wanted, token, device_values, device_avals, flag_aval, sharding=sharding
    )
    if asked is not None:
        order.mark_tap(asked.owner)
    case = hlo.CaseOp([hlo.TokenType.get()] if asked is not None else [], flag, 2)
    skipped, taken = case.regions[0].blocks.append(), case.regions[1].blocks.append()
    with ir.InsertionPoint(skipped):
        hlo.ReturnOp([asked] if asked is not None else [])
    with ir.InsertionPoint(taken):
        written = emit(asked)
        hlo.ReturnOp([written] if asked is not None else [])
    return case.results[0] if asked is not None else None


def _sender_callback(
    native: RingSites | None,
    site: TapSiteParams,
    fields: dict[str, Any],
    tapped_avals: Sequence[Any],
    devices_at: _DeviceOrdinals,
) -> Callable[..., tuple[()]]:
    """The host function of a portable tap without a ring: copy, hand to the sender.
    The site's own `every=K` samples here too (by the sender's seq, before the copy);
    dormancy does not: with no ring there is no site table for the daemon to write, so
    every sampled-in tap is sent (docs/PROTOCOL.md, "Dormant and sampled taps")."""
    tap_site = TapSite(site.consumer, fields)
    leaf_count = len(tapped_avals) - site.has_coords
    has_step = site.has_step
    has_coords = site.has_coords

    def submit(*args: Any) -> tuple[()]:
        device = devices_at(args)
        sender = lifecycle.get_sender()
        if sender.sampled_out(tap_site, device):
            return ()  # its seq used up, counted as skipped
        copies = [np.array(a, copy=True) for a in args[:leaf_count]]
        coords = [int(c) for c in np.asarray(args[leaf_count])] if has_coords else None
        step = int(np.asarray(args[leaf_count + has_coords])) if has_step else None
        sender.submit(tap_site, copies, step=step, device=device, coords=coords)
        return ()

    return submit


def _lower_module_in_order(lower: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`mlir.lower_jaxpr_to_module`, then tapd's order for the taps it lowered
    (tapd.emitter.order): where the module is one partition and its platforms have the
    order handler; and, in any module with strict taps too, tapd's chain joined to
    JAX's token."""
    order.start_module()
    result = lower(*args, **kwargs)
    if order.lowered_taps() and order.partitions(result.module) == 1:
        platforms = {str(platform).lower() for platform in kwargs.get("platforms") or ()}
        if platforms and platforms <= native_backend.order_platforms():
            with result.module.context:
                order.order_module(result.module)
    if order.lowered_taps() and order.lowered_strict_taps():
        with result.module.context:
            order.join_chains(result.module)
    return result


primitive.register_lowering(lower_tap)
jax_compat.wrap_module_lowering(_lower_module_in_order)
