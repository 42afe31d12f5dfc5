"""A tap site as its custom call carries it: the `entry` attribute (docs/PROTOCOL.md,
"The tap's custom call").

The entry is the site itself (consumer, tree, static metadata, transforms, leaf dtypes
and shapes), not a number of this process's registry. So a computation's HLO, and
JAX's persistent cache key, is the same in every process that traces it, whatever
other sites each traced first; and a computation compiled elsewhere (a `jax.export`
artifact, a persistent-cache hit) still names its sites. The handler looks the entry up
in its ring (`tapd_ring_put_entry`, done here as a tap is lowered); an entry new there
is handed to `resolve`, which registers it in this process's sites file, as lowering
would have: in the daemon's ring that tapd.emitter.lifecycle hands it (`resolve_into`),
made on demand.

The format is versioned: `tapd1:` then the base64 of the msgpack map the sites file
records (without the ids). A later tapd reads every version before its own, or refuses
the entry with an error that names the version.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from tapd.consumers import MAX_NAME
from tapd.emitter.local.functions import LOCAL_PREFIX
from tapd.native.ring import Ring
from tapd.protocol.ring_format import RINGS

logger = logging.getLogger("tapd.emitter")

VERSION = "tapd1"
_PREFIX = VERSION + ":"
# What a site's fields may hold besides its consumer and leaves (tapd.emitter.primitive).
_FIELDS = frozenset({"tree", "meta", "shard", "transforms", "every", "always"})


class EntryError(ValueError):
    """An entry this tapd cannot take: say which, and why."""


class RingSites(Protocol):
    """What lowering and `resolve` need of a ring a tap writes: its sites' ids (the
    daemon's ring: tapd.emitter.native_backend.NativeEmitter; the local ring:
    tapd.emitter.local.path.LocalPath)."""

    ring: Ring

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int: ...

    def consumer_id(self, consumer: str) -> int: ...


def encode(consumer: str, fields: dict[str, Any], leaves: list[Any]) -> str:
    """The entry of a site, as the custom call carries it."""
    packed = msgpack.packb({"consumer": consumer, **fields, "leaves": leaves}, use_bin_type=True)
    return _PREFIX + base64.b64encode(packed).decode("ascii")


def decode(entry: bytes) -> tuple[str, dict[str, Any], list[Any]]:
    """(consumer, fields, leaves) of an entry; EntryError if it is not one this tapd
    reads."""
    version, colon, body = entry.partition(b":")
    if not colon or not version.startswith(b"tapd"):
        raise EntryError(f"not a tapd site entry: {entry[:40]!r}")
    if version.decode("ascii", "replace") != VERSION:
        raise EntryError(
            f"a tap site entry of format {version.decode('ascii', 'replace')!r}, which this "
            f"tapd does not read (it reads {VERSION!r}): the computation was made by "
            "another tapd version; export it again with this one"
        )
    try:
        decoded = msgpack.unpackb(base64.b64decode(body, validate=True), raw=False)
    except (binascii.Error, ValueError, msgpack.ExtraData, msgpack.FormatError) as exc:
        raise EntryError(f"a tap site entry that does not decode: {exc}") from None
    if not isinstance(decoded, dict):
        raise EntryError("a tap site entry that is not a map")
    consumer, leaves = decoded.pop("consumer", None), decoded.pop("leaves", None)
    if not isinstance(consumer, str) or not 0 < len(consumer) <= MAX_NAME:
        raise EntryError(f"a tap site entry whose consumer is not a name: {consumer!r}")
    if not isinstance(leaves, list) or not all(_is_leaf(leaf) for leaf in leaves):
        raise EntryError(f"tap site {consumer!r}: its leaves are not [dtype, shape, bytes]")
    unknown = set(decoded) - _FIELDS
    if unknown:
        raise EntryError(
            f"tap site {consumer!r}: fields this tapd does not know: {sorted(unknown)}"
        )
    return consumer, decoded, leaves


def _is_leaf(leaf: Any) -> bool:
    return (
        isinstance(leaf, list)
        and len(leaf) == 3
        and isinstance(leaf[0], str)
        and isinstance(leaf[1], list)
        and all(isinstance(n, int) and n >= 0 for n in leaf[1])
        and isinstance(leaf[2], int)
    )


def resolve(which: int, entry: bytes) -> tuple[int, int]:
    """Register the site of `entry`, which a computation compiled elsewhere runs, in this
    process's ring `which`, and put its ids there: (site id, consumer id)."""
    consumer, fields, leaves = decode(entry)
    if which != RINGS["daemon"] or consumer.startswith(LOCAL_PREFIX):
        raise EntryError(
            f"tap site {consumer!r} runs a tap function of the process that traced it (an "
            "id_tap of a closure, tapd.debug): it cannot run in another process"
        )
    if not _daemon_ring:
        raise EntryError(
            f"tap site {consumer!r}: this process has not loaded tapd's emitter "
            "(tapd.emitter.lifecycle), which makes the ring to write"
        )
    native = _daemon_ring[0]()
    if native is None:
        raise EntryError(
            f"tap site {consumer!r}: this process has no ring to write (its daemon is on "
            "another host, or the native library is unavailable: tapd doctor says which)"
        )
    site = native.register_site(consumer, fields, leaves)
    consumer_id = native.consumer_id(consumer)
    native.ring.put_entry(entry, site, consumer_id)
    logger.info("tapd: registered tap site %r of a computation compiled elsewhere", consumer)
    return site, consumer_id


# int resolver(which, entry, length, *site, *consumer, error, error_size) (ring.cc)
_RESOLVER_TYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_int32,
    ctypes.c_void_p,
    ctypes.c_uint64,
    ctypes.POINTER(ctypes.c_uint64),
    ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_void_p,
    ctypes.c_uint64,
)


def _resolver(
    which: int, entry: int, length: int, site: Any, consumer: Any, error: int, error_size: int
) -> int:
    # Runs on an XLA thread, once per site new to a ring; ctypes takes the GIL.
    try:
        site[0], consumer[0] = resolve(which, ctypes.string_at(entry, length))
        return 0
    except Exception as exc:
        text = str(exc) if isinstance(exc, EntryError) else f"tapd: {type(exc).__name__}: {exc}"
        logger.error("%s", text)
        data = text.encode("utf-8", "replace")[: max(0, error_size - 1)] + b"\0"
        ctypes.memmove(error, data, len(data))
        return 1


_callback = _RESOLVER_TYPE(_resolver)  # (kept alive: the library holds its address)
_installed: list[bool] = []
_lock = threading.Lock()
_daemon_ring: list[Callable[[], RingSites | None]] = []  # (one: resolve_into's)


def resolve_into(daemon_ring: Callable[[], RingSites | None]) -> None:
    """Have `resolve` register sites in `daemon_ring()`: this process's ring to the
    daemon, made on demand, or None where it has none (tapd.emitter.lifecycle's)."""
    _daemon_ring[:] = [daemon_ring]


def install_resolver(lib: ctypes.CDLL) -> None:
    """Have the ring library ask `resolve` for entries new to its rings (idempotent)."""
    with _lock:
        if not _installed:
            lib.tapd_set_site_resolver(_callback)
            _installed.append(True)
