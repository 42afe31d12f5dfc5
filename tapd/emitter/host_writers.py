"""The host functions of portable taps: what runs on the host when a tap is a host
callback, and writes its record (into the ring, or to the sender).

`tapd.emitter.lowering` makes one per portable tap; `tapd.emitter.gathered.flush` makes
one per site of a gathered computation and calls it once per gathered record. Either
way the record is the one the native handler would write: site id, seq, step, device.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax._src import core, sharding_impls
from jax._src import mesh as mesh_lib
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir  # type: ignore[attr-defined]
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]
from jax.sharding import Mesh

from tapd.emitter import lifecycle, primitive
from tapd.emitter.device_names import device_names
from tapd.emitter.native_backend import RingSites
from tapd.emitter.primitive import TapSiteParams
from tapd.emitter.sender import TapSite
from tapd.emitter.taps_as_outputs import write_ready
from tapd.errors import TapDefinitionError
from tapd.native import library
from tapd.native.ring import NO_STEP
from tapd.protocol.ring_format import EVERY_ALWAYS_BIT, RECORD_HEADER, writer_every


def site_fields(site: TapSiteParams, platform: str | None) -> dict[str, Any]:
    """The site's fields; a site that asked for its device (`tap_with_device`) also gets
    the device's platform and what this JAX calls its devices, so that a subscriber
    names it as this process's JAX does (`cpu:0`, `TFRT_CPU_0`: tapd.emitter.device_names)."""
    fields = site.site_fields()
    meta = fields.get("meta", {})
    if meta.get("tap_with_device") and platform is not None:
        fields["meta"] = {**meta, "device_platform": platform, **device_names(platform)}
    return fields


class DeviceOrdinals:
    """The local device ordinal a host callback reports, from its device's index in the
    assignment (its last operand), or `fixed`: the one it always runs on."""

    def __init__(self, ordinals: Sequence[int], index: int | None) -> None:
        self.table = tuple(ordinals)
        self.fixed = None if index is None else self.of(index)

    def of(self, index: int) -> int:
        return self.table[index] if index < len(self.table) else index

    def __call__(self, args: Sequence[Any]) -> int:
        return self.fixed if self.fixed is not None else self.of(int(args[-1]))


def partition_index(ctx: mlir.LoweringRuleContext) -> tuple[list[Any], list[Any]] | None:
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


def local_ordinals(ctx: mlir.LoweringRuleContext) -> list[int]:
    """The local device ordinal (what XLA's FFI calls DeviceOrdinal) of each device of
    the computation's device assignment, which `partition_index` gives; -1 for another
    process's device."""
    ordinals = []
    for device in device_assignment(ctx):
        ordinal = getattr(device, "local_hardware_id", None)
        ordinals.append(-1 if ordinal is None else int(ordinal))
    return ordinals


def device_assignment(ctx: mlir.LoweringRuleContext) -> tuple[Any, ...]:
    """The devices of the computation, in the order `partition_index` counts them."""
    context = ctx.module_context.axis_context
    if isinstance(context, sharding_impls.ShardingContext):
        return tuple(context.device_assignment or ())
    if isinstance(context, sharding_impls.SPMDAxisContext):
        return _mesh_devices(context.mesh)
    return ()


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


def ring_site(
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


def check_fits(native: RingSites, site: TapSiteParams, tapped_avals: Sequence[Any]) -> None:
    """Refuse, as the computation lowers, a tap whose record is larger than the whole
    ring it writes, under the `block` policy: no wait could ever make room for it, and
    `block` promises that nothing is dropped. (Under `drop_newest` each one is dropped
    and counted, as that policy says; the library also says why on stderr.)"""
    settings = lifecycle.settings()
    if settings.policy != "block":
        return
    length = RECORD_HEADER.itemsize + sum(
        -(-int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize // 8) * 8
        for aval in tapped_avals
    )
    capacity = native.ring.counters().capacity
    if length > capacity:
        # (a function of this process is named as its code names it, not as its ring does)
        name = site.consumer.rsplit("/", 1)[-1] if site.consumer.startswith("local/") else None
        raise TapDefinitionError(
            f"tap {name or site.consumer!r}: one tap is {length} bytes, more than the whole ring "
            f"of {capacity} bytes it is written to, and the policy is 'block' (which never "
            "drops a tap): raise TAPD_BUFFER_BYTES (tapd.configure(buffer_bytes=...), now "
            f"{settings.buffer_bytes}) above {length}, or tap less at a time"
        )


def ring_writer(
    native: RingSites | None,
    site: TapSiteParams,
    fields: dict[str, Any],
    tapped_avals: Sequence[Any],
    devices_at: DeviceOrdinals,
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
    site_id, consumer_id, every, lib = ring_site(native, site, fields, tapped_avals)
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
        lifecycle.host_callback_ran()
        write_ready()  # (gathered taps dispatched before this computation: theirs first)
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
# (`ring_writer`): one more copy, cheaper than asking numpy for the address up to a
# few KiB.
_COPIED_BYTES = 4096


@functools.cache
def _char_array(size: int) -> Any:
    return ctypes.c_char * size


def sender_writer(
    native: RingSites | None,
    site: TapSiteParams,
    fields: dict[str, Any],
    tapped_avals: Sequence[Any],
    devices_at: DeviceOrdinals,
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
        lifecycle.host_callback_ran()
        write_ready()
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
