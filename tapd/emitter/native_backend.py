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
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack

from tapd.native import library
from tapd.native.ring import Ring, round_capacity
from tapd.runtime import ensure_private_dir

logger = logging.getLogger("tapd.emitter")

FFI_TARGET = "tapd_tap"
_LENGTH = struct.Struct("<I")


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
                record = msgpack.packb(
                    {**entry, "site": site, "consumer_id": consumer_id}, use_bin_type=True
                )
                self._sites_file.write(_LENGTH.pack(len(record)) + record)
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


def read_sites(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Site entries appended to `path` after `offset`, and the new offset (whole entries
    only: a half-written one is read next time)."""
    with open(path, "rb") as sites:
        sites.seek(offset)
        data = sites.read()
    entries = []
    position = 0
    while position + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, position)
        if position + _LENGTH.size + length > len(data):
            break
        start = position + _LENGTH.size
        entries.append(msgpack.unpackb(data[start : start + length], raw=False))
        position = start + length
    return entries, offset + position


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


_ffi_registered = False
_ffi_lock = threading.Lock()


def register_ffi_target() -> bool:
    """Register the C++ handler with XLA for the CPU platform; False if unavailable."""
    global _ffi_registered
    with _ffi_lock:
        if _ffi_registered:
            return True
        lib = library.load()
        if lib is None:
            return False
        import jax

        capsule = jax.ffi.pycapsule(lib.TapdTap)  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(FFI_TARGET, capsule, platform="cpu")
        _allow_under_remat()
        _ffi_registered = True
        return True
