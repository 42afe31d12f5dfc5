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

from tapd.emitter import entries, jax_compat
from tapd.emitter.entries import RingSites as RingSites  # (lowering's name for it)
from tapd.native import library
from tapd.native.ring import Ring, round_capacity
from tapd.native.sites import encode_entry
from tapd.runtime import make_first_file

logger = logging.getLogger("tapd.emitter")

FFI_TARGET = "tapd_tap"
# The no-op order custom call that tapd emitted before its taps' order was a token JAX
# threads (tapd.emitter.program_order): no longer emitted, still registered, so that a
# computation exported (jax.export) by an earlier tapd still runs.
ORDER_TARGET = "tapd_order"


class NativeEmitter:
    """Owns this process's ring and sites file; registers tap sites."""

    def __init__(self, directory: Path, capacity: int, policy: str) -> None:
        stem = directory / f"{os.getpid()}-{secrets.token_hex(4)}"
        self.ring_path = stem.with_suffix(".ring")
        self.sites_path = stem.with_suffix(".sites")
        self._sites_file = make_first_file(
            directory,
            lambda: open(self.sites_path, "ab", buffering=0),  # noqa: SIM115
        )
        os.chmod(self.sites_path, 0o600)
        self.ring = Ring.create(self.ring_path, round_capacity(capacity), policy)
        self.ring.install()
        self._lock = threading.Lock()
        self._sites: dict[bytes, int] = {}
        self._consumers: dict[str, int] = {}
        self._site_consumers: list[str] = []  # by site id

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int:
        """The id of this tap site, appending it to the sites file the first time."""
        entry = {"consumer": consumer, **fields, "leaves": leaves}
        key = msgpack.packb(entry, use_bin_type=True)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = len(self._sites)
                self._site_consumers.append(consumer)
                consumer_id = self._consumers.setdefault(consumer, len(self._consumers))
                self._sites_file.write(
                    encode_entry({**entry, "site": site, "consumer_id": consumer_id})
                )
            return site

    def sites_of(self, consumer: str) -> list[int]:
        """The ids of `consumer`'s tap sites registered so far (its slots in the ring's
        site table)."""
        with self._lock:
            return [site for site, name in enumerate(self._site_consumers) if name == consumer]

    def consumer_id(self, consumer: str) -> int:
        with self._lock:
            return self._consumers[consumer]

    def identity(self) -> dict[str, str]:
        return {"ring": str(self.ring_path), "sites": str(self.sites_path)}

    def settled_position(self) -> int:
        """Where the ring's records end once every one reserved so far is committed
        (commits still on their way from a CUDA stream too; waits for them)."""
        return self.ring.settled()

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
        return {
            "sent": counters.taps,
            "dropped": counters.dropped,
            "blocked_ns": counters.blocked_ns,
            "skipped": counters.skipped,
        }

    def skipped_by_consumer(self) -> dict[str, int]:
        """Taps skipped (dormant or sampled out), by consumer: those that skipped any."""
        by_site = self.ring.skipped_by_site()
        counts: dict[str, int] = {}
        with self._lock:
            for site, count in by_site.items():
                if site < len(self._site_consumers):
                    consumer = self._site_consumers[site]
                    counts[consumer] = counts.get(consumer, 0) + count
        return counts


_ffi_registered = False
_registered_platforms: frozenset[str] = frozenset()
_ffi_lock = threading.Lock()


def register_ffi_target() -> bool:
    """Register tapd's C++ handlers with XLA: for CPU where the library has it, and for
    CUDA where JAX has a CUDA backend and tapd's CUDA handler is built (`library.
    has_handler("cuda")`). False if none was registered (`library.handler_reason`
    says why); a handler that fails to register is logged once, never raised."""
    global _ffi_registered, _registered_platforms
    with _ffi_lock:
        if _ffi_registered:
            return True
        if library.load() is None:
            return False
        import jax

        registered: set[str] = set()
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
            if not _register(FFI_TARGET, function, xla_platform, "tap"):
                continue
            registered.add(platform)
            order = library.order_handler()
            if order is not None:
                _register(ORDER_TARGET, order, xla_platform, "order")
        if not registered:
            return False
        # (a computation compiled elsewhere asks for its sites: tapd.emitter.entries)
        lib = library.load()
        assert lib is not None
        entries.install_resolver(lib)
        jax_compat.export_targets_stable(FFI_TARGET, ORDER_TARGET)
        _registered_platforms = frozenset(registered)
        _ffi_registered = True
        return True


def _register(target: str, function: Any, xla_platform: str, what: str) -> bool:
    """Register one of tapd's C handlers with XLA; a failure is logged, never raised."""
    import jax

    try:
        capsule = jax.ffi.pycapsule(function)  # type: ignore[no-untyped-call]
        jax.ffi.register_ffi_target(target, capsule, platform=xla_platform)
    except Exception as exc:
        logger.warning("tapd: could not register the %s %s handler: %s", xla_platform, what, exc)
        return False
    return True


def registered_platforms() -> frozenset[str]:
    """The JAX platforms tapd's FFI handler is registered for in this process."""
    register_ffi_target()
    return _registered_platforms
