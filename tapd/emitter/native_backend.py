"""The native backend's emitter side: this process's ring, its tap sites, the FFI target.

At trace time each distinct tap site (consumer, tree, leaf dtypes and shapes, static
metadata, transforms) gets an id and is appended to the process's `.sites` file, which
the daemon reads to interpret ring records; the record itself carries only the site id,
sequence number, device, step, time and the leaves' bytes. At run time XLA calls the
C++ handler, which copies the operands into the ring: no Python, no GIL.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any

import msgpack

from tapd.errors import TapDefinitionError
from tapd.native import library
from tapd.native.ring import Ring, round_capacity
from tapd.native.sites import encode_entry
from tapd.runtime import ensure_private_dir

logger = logging.getLogger("tapd.emitter")

FFI_TARGET = "tapd_tap"


class NativeEmitter:
    """Owns this process's ring and sites file; registers tap sites."""

    def __init__(self, directory: Path, capacity: int, policy: str) -> None:
        ensure_private_dir(directory)
        stem = directory / f"{os.getpid()}-{secrets.token_hex(4)}"
        self.ring_path = stem.with_suffix(".ring")
        self.sites_path = stem.with_suffix(".sites")
        self._sites_file = open(self.sites_path, "ab", buffering=0)  # noqa: SIM115
        os.chmod(self.sites_path, 0o600)
        self.ring = Ring.create(self.ring_path, round_capacity(capacity), policy)
        self.ring.install()
        self._lock = threading.Lock()
        self._sites: dict[bytes, int] = {}
        self._consumers: dict[str, int] = {}

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int:
        """The id of this tap site, appending it to the sites file the first time."""
        entry = {"consumer": consumer, **fields, "leaves": leaves}
        key = msgpack.packb(entry, use_bin_type=True)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = len(self._sites)
                consumer_id = self._consumers.setdefault(consumer, len(self._consumers))
                self._sites_file.write(
                    encode_entry({**entry, "site": site, "consumer_id": consumer_id})
                )
            return site

    def consumer_id(self, consumer: str) -> int:
        with self._lock:
            return self._consumers[consumer]

    def identity(self) -> dict[str, str]:
        return {"ring": str(self.ring_path), "sites": str(self.sites_path)}

    def committed(self) -> int:
        return self.ring.counters().committed

    def remove_files(self) -> None:
        self._sites_file.close()
        self.ring_path.unlink(missing_ok=True)
        self.sites_path.unlink(missing_ok=True)
        try:
            self.ring_path.parent.rmdir()  # only if no other emitter's ring is there
        except OSError:
            pass

    def stats(self) -> dict[str, int]:
        counters = self.ring.counters()
        return {"sent": counters.taps, "dropped": counters.dropped,
                "blocked_ns": counters.blocked_ns}  # fmt: skip


def _allow_under_remat() -> None:
    """Give side-effecting FFI calls (our taps) the standing `jax.debug.callback` has
    in JAX's effect tables: allowed under `jax.checkpoint` and in custom derivatives,
    and kept by partial evaluation. Without the last one, `grad` of a `scan` drops a
    native tap whose operand does not depend on the carry (the JAX #16637 family); the
    tests check both. The tap is a custom_jvp that taps the primal only, so
    rematerialisation does not run it twice. JAX has no public switch for this."""
    try:
        from jax._src import effects, ffi

        for table in (
            effects.remat_allowed_effects,
            effects.custom_derivatives_allowed_effects,
            effects.partial_eval_kept_effects,
        ):
            table.add_type(ffi.FfiEffect)
    except (ImportError, AttributeError):
        logger.warning(
            "tapd: this JAX version hides the tables that keep native taps under "
            "jax.checkpoint and grad-of-scan; if a tap is missing there, use "
            "TAPD_BACKEND=portable"
        )


def _lower_taps_per_device() -> None:
    """Lower our FFI call with the sharding JAX gives `jax.debug.callback`, and refuse
    the one placement XLA cannot compile, with a message that says what to do.

    XLA's SPMD partitioner needs a sharding on every side-effecting op, and
    `jax.ffi.ffi_call` sets none. Inside shard_map/pmap (manual axes) we ask JAX for the
    callbacks' MANUAL sharding: each device taps its block. In a jit that the compiler
    partitions, a MAXIMAL sharding (one device) is what callbacks get, but XLA keeps it
    only for its own callback targets (Shardy drops it on ours), so tapd wraps such
    taps in a shard_map at trace time (`tapd.emitter.sharding`). A tap that still
    reaches a partitioned lowering (the trace saw no mesh) gets a clear error here
    instead of XLA's RET_CHECK. JAX has no public switch for any of this."""
    try:
        from jax._src import callback, ffi, sharding_impls
        from jax._src.interpreters import mlir

        def lower(ctx: Any, *operands: Any, target_name: str, **params: Any) -> Any:
            if target_name != FFI_TARGET:
                return ffi.ffi_call_lowering(ctx, *operands, target_name=target_name, **params)
            module = ctx.module_context
            context = module.axis_context
            if isinstance(context, sharding_impls.ShardingContext) and context.num_devices > 1:
                raise TapDefinitionError(
                    f"a native tap is in a jit partitioned over {context.num_devices} "
                    "devices whose mesh it could not see while tracing. Put the tapped "
                    "value on a mesh (jax.device_put(x, NamedSharding(mesh, spec)) or "
                    "jax.set_mesh(mesh)), tap inside shard_map, or use "
                    "TAPD_BACKEND=portable."
                )
            attributes = ffi._unwrap_kwargs_hashable(params["attributes"])
            op = ffi.build_ffi_lowering_function(FFI_TARGET, has_side_effect=True)(
                ctx, *operands, **attributes
            )
            sharding = callback._callback_op_sharding(context, None, ctx.avals_out)
            if sharding is not None:
                mlir.set_sharding(module, op, sharding)
            return op.results

        mlir.register_lowering(ffi.ffi_call_p, lower, platform="cpu")
    except (ImportError, AttributeError):
        logger.warning(
            "tapd: this JAX version hides how callbacks are placed on devices; a native "
            "tap in a jit partitioned over several devices may fail to compile there "
            "(use TAPD_BACKEND=portable for such programs)"
        )


_ffi_registered = False
_ffi_lock = threading.Lock()


def register_ffi_target() -> bool:
    """Register tapd's C++ handlers with XLA: for CPU where the library has it, and for
    CUDA where JAX has a CUDA backend and tapd's CUDA handler is built (`library.
    has_handler("cuda")`). False if none was registered (`library.handler_reason`
    says why); a handler that fails to register is logged once, never raised."""
    global _ffi_registered
    with _ffi_lock:
        if _ffi_registered:
            return True
        if library.load() is None:
            return False
        import jax

        registered = False
        for platform, xla_platform in (("cpu", "cpu"), ("cuda", "CUDA")):
            if platform == "cuda":
                try:
                    if not jax.devices("cuda"):
                        continue
                except Exception:  # no CUDA backend in this JAX
                    continue
            function = library.handler(platform)
            if function is None:
                logger.info(
                    "tapd: no %s tap handler: %s", platform, library.handler_reason(platform)
                )
                continue
            try:
                capsule = jax.ffi.pycapsule(function)  # type: ignore[no-untyped-call]
                jax.ffi.register_ffi_target(FFI_TARGET, capsule, platform=xla_platform)
            except Exception as exc:
                logger.warning("tapd: could not register the %s tap handler: %s", platform, exc)
                continue
            registered = True
        if not registered:
            return False
        _allow_under_remat()
        _lower_taps_per_device()
        _ffi_registered = True
        return True


def registered_platforms() -> frozenset[str]:
    """The JAX platforms tapd's FFI handler is registered for in this process."""
    return frozenset({"cpu"}) if register_ffi_target() else frozenset()
