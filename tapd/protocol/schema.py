"""Every message kind's fields and limits, in one place (docs/PROTOCOL.md).

`decode` (tapd/protocol/wire.py) calls `check_header` on every header it accepts, so a
handler anywhere (daemon, emitter, subscriber, forwarder) receives only messages whose
every known field is present, of its type, and within its bounds. Site entries of a
ring's `.sites` file and the ring's control page are checked here too
(`check_site_entry`, `split_site_entries`, `check_ring_control`): the daemon reads them
from files an emitter wrote, so they are input like any message.

A violation raises `ProtocolError` with a reason code used for counting:
`bad_field` (missing, mistyped or out of range), `too_large` (a string, list or map
longer than its limit), or the reasons of the checks that `wire.py` runs itself.
Unknown extra fields are allowed (a minor addition must not break older peers), and
bounded by the header's size limit.
"""

from __future__ import annotations

import dataclasses
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgpack

from tapd.consumers import MAX_NAME
from tapd.errors import ProtocolError, TapDefinitionError


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before it trusts anything in a message."""

    max_header_bytes: int = 1 << 20
    max_leaves: int = 4096
    max_tree_depth: int = 64
    max_ndim: int = 32
    max_message_bytes: int = 1 << 30
    max_batch: int = 4096  # taps in one `taps` message
    max_name: int = MAX_NAME  # consumer names and patterns, host and subscriber names
    max_id: int = 512  # daemon ids, emitter names ("host:pid"), forwarder ids
    max_text: int = 8192  # an error's text
    max_patterns: int = 1024  # consumer patterns in a subscriber's hello
    max_window: int = 1 << 20  # a subscriber's window, in taps
    max_entries: int = 1 << 16  # errors in one ack; keys of meta; transforms
    max_path: int = 4096  # ring and sites paths in an emitter's hello
    max_sites_bytes: int = 64 << 20  # a ring's whole `.sites` file
    max_outcome_ranges: int = 16384  # in a barrier_done to a forwarder


DEFAULT_LIMITS = Limits()

# What a tap site's static fields (consumer, tree, meta, transforms, leaves, shard
# layout) may take of a tap header: the rest of `max_header_bytes` is left for the
# per-tap fields and what the daemon adds (tid, emitter name, host). An emitter
# refuses larger sites at trace time (`check_static_size`), so that no subscriber and
# no daemon has to reject them later.
STATIC_RESERVE = 16 << 10


def max_static_bytes(limits: Limits = DEFAULT_LIMITS) -> int:
    return limits.max_header_bytes - STATIC_RESERVE


PID_MAX = 2**31 - 1  # pid_t is a 32-bit int; os.kill refuses anything larger
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

# A ring's file name as emitters make it (`<pid>-<random hex>.ring`), and its sites
# file beside it: the daemon opens and later removes both, so neither may name
# anything else (docs/PROTOCOL.md, "Shared-memory ring").
RING_NAME = re.compile(r"[0-9]{1,10}-[0-9a-f]{1,64}\.ring")


# ---- field rules -----------------------------------------------------------------------

# A rule checks one value and returns None, or (reason, complaint).
Complaint = tuple[str, str] | None
Rule = Callable[[Any, Limits], Complaint]


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass in Python, never one on the wire


def Int(lo: int = I64_MIN, hi: int = U64_MAX, *, optional: bool = False) -> Rule:
    def rule(value: Any, limits: Limits) -> Complaint:
        if value is None and optional:
            return None
        if not _is_int(value):
            return ("bad_field", f"has bad type: {value!r:.60}")
        if not lo <= value <= hi:
            return ("bad_field", f"{value} is not within [{lo}, {hi}]")
        return None

    rule.types = (int, type(None)) if optional else int  # type: ignore[attr-defined]
    return rule


def Str(limit: str | None = None, *, empty: bool = True) -> Rule:
    """A str of at most `getattr(limits, limit)` characters (unbounded: None)."""

    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, str):
            return ("bad_field", f"has bad type: {value!r:.60}")
        if not empty and not value:
            return ("bad_field", "is empty")
        bound = getattr(limits, limit) if limit else None
        if bound is not None and len(value) > bound:
            return ("too_large", f"is {len(value)} characters long; the limit is {bound}")
        return None

    rule.types = str  # type: ignore[attr-defined]
    return rule


def Of(types: type | tuple[type, ...]) -> Rule:
    """Only a type (containers whose insides other checks look at)."""

    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            return ("bad_field", f"has bad type: {value!r:.60}")
        return None

    rule.types = types  # type: ignore[attr-defined]
    return rule


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def ListOf(item: Rule, limit: str, *, empty: bool = True) -> Rule:
    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, list):
            return ("bad_field", f"has bad type: {value!r:.60}")
        bound = getattr(limits, limit)
        if len(value) > bound:
            return ("too_large", f"has {len(value)} entries; the limit is {bound}")
        if not empty and not value:
            return ("bad_field", "is empty")
        for index, entry in enumerate(value):
            complaint = item(entry, limits)
            if complaint is not None:
                return (complaint[0], f"entry {index} {complaint[1]}")
        return None

    rule.types = list  # type: ignore[attr-defined]
    return rule


def _meta(value: Any, limits: Limits) -> Complaint:
    if not isinstance(value, dict):
        return ("bad_field", f"has bad type: {value!r:.60}")
    if len(value) > limits.max_entries:
        return ("too_large", f"has {len(value)} keys; the limit is {limits.max_entries}")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > limits.max_name:
            return ("bad_field", f"key {key!r:.60} is not a str of at most {limits.max_name}")
        if not isinstance(item, str | int | float | bool | None):
            return ("bad_field", f"{key!r:.60} is not a scalar: {item!r:.60}")
    return None


_meta.types = dict  # type: ignore[attr-defined]


def _transform(value: Any, limits: Limits) -> Complaint:
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and len(value[0]) <= limits.max_name and isinstance(value[1], dict)):  # fmt: skip
        return ("bad_field", f"is not [name, {{params}}]: {value!r:.60}")
    return None


def _ack_error(value: Any, limits: Limits) -> Complaint:
    if not isinstance(value, dict):
        return ("bad_field", f"is not a map: {value!r:.60}")
    tid, text = value.get("tid"), value.get("error")
    if not (type(tid) is int and 0 <= tid <= U64_MAX):
        return ("bad_field", f"has no delivery id 'tid': {tid!r:.30}")
    if not isinstance(text, str):
        return ("bad_field", f"has no text 'error': {text!r:.30}")
    if len(text) > limits.max_text:
        return ("too_large", f"text is {len(text)} characters; the limit is {limits.max_text}")
    return None


_NAME = Str("max_name")
_ID = Str("max_id")
_OUTCOMES = ("delivered", "dropped", "unrouted")


def _outcome_range(value: Any, limits: Limits) -> Complaint:
    if not (isinstance(value, list) and len(value) == 3 and _is_int(value[0])
            and _is_int(value[1]) and 0 <= value[0] <= value[1] <= U64_MAX
            and value[2] in _OUTCOMES):  # fmt: skip
        return ("bad_field", f"is not [first fid, last fid, outcome]: {value!r:.60}")
    return None


@dataclasses.dataclass(frozen=True)
class Field:
    rule: Rule
    required: bool = True


def req(rule: Rule) -> Field:
    return Field(rule, True)


def opt(rule: Rule) -> Field:
    return Field(rule, False)


Schema = Mapping[str, Field]

TAP: Schema = {
    "consumer": req(Str("max_name", empty=False)),
    "seq": req(Int(0)),
    "step": req(Int(optional=True)),
    "device": req(Int(optional=True)),
    "process": req(Int(0, PID_MAX)),
    "host": req(_NAME),
    "pid": req(Int(0, PID_MAX)),
    "time": req(Int()),
    "transforms": req(ListOf(_transform, "max_entries")),
    "meta": req(_meta),
    "tree": req(Of(list)),  # tapd/protocol/tree.py checks it
    "leaves": req(Of(list)),  # wire.leaf_sizes checks them
    "tid": opt(Int(0)),
    "emitter": opt(_ID),
    "fid": opt(Int(0)),  # forwarder -> upstream: the forwarder's number for the tap
    # `shard`: wire.check_shard
}

EMITTER_HELLO: Schema = {
    "pid": req(Int(1, PID_MAX)),
    "host": req(Str("max_name", empty=False)),
    "process": opt(Int(0, PID_MAX)),
    "forwarder": opt(_ID),
    "nonce": opt(Int(0)),  # echoed by the welcome that answers this hello
    "ring": opt(Str("max_path")),
    "sites": opt(Str("max_path")),
}

SUBSCRIBER_HELLO: Schema = {
    "consumers": req(ListOf(Str("max_name", empty=False), "max_patterns", empty=False)),
    "window": req(Int(1, DEFAULT_LIMITS.max_window)),
    "name": opt(_NAME),
    "batch": opt(Of(bool)),
    "group": opt(Str("max_name", empty=False)),  # a worker pool (docs/PROTOCOL.md)
}

HELLO_ROLES: dict[str, Schema] = {"emitter": EMITTER_HELLO, "subscriber": SUBSCRIBER_HELLO}

_COUNT = Int(0)
KINDS_SCHEMA: dict[str, Schema] = {
    "hello": {"role": req(Str("max_name"))},
    "welcome": {"window_bytes": req(_COUNT), "daemon": req(_ID), "held_bytes": opt(_COUNT),
                "nonce": opt(_COUNT)},
    "rehello": {},
    "tap": TAP,
    "taps": {"statics": req(Of(list)), "taps": req(Of(list))},  # tapd/protocol/batch.py
    # `delivered`, `dropped`, `unrouted`: this emitter's totals at this daemon so far.
    "credit": {"bytes": req(_COUNT), "delivered": opt(_COUNT), "dropped": opt(_COUNT),
               "unrouted": opt(_COUNT)},
    "ack": {"upto": req(Int(-1)), "errors": req(ListOf(_ack_error, "max_entries"))},
    "error": {"consumer": req(_NAME), "seq": req(Int()), "error": req(Str("max_text")),
              "subscriber": req(_ID), "emitter": opt(_ID), "device": opt(Int(optional=True))},
    "barrier": {"id": req(Int(0)), "ring_position": opt(Int(0))},
    # `outcomes` (to a forwarder): [first fid, last fid, outcome] ranges, docs/PROTOCOL.md
    "barrier_done": {"id": req(Int(0)), "delivered": req(_COUNT), "dropped": req(_COUNT),
                     "unrouted": req(_COUNT),
                     "outcomes": opt(ListOf(_outcome_range, "max_outcome_ranges"))},
    "heartbeat": {},
    "bye": {},
    "stats": {},
    "stats_reply": {"stats": req(Of(dict))},
    "shutdown": {},
}  # fmt: skip
KINDS = frozenset(KINDS_SCHEMA)


def required_types(schema: Schema) -> dict[str, type | tuple[type, ...]]:
    """The required fields of `schema` and their types (the simple view of it)."""
    return {name: f.rule.types for name, f in schema.items() if f.required}  # type: ignore[attr-defined]


# ---- checks ----------------------------------------------------------------------------

_MISSING = object()


def check_fields(
    kind: str, header: Mapping[str, Any], schema: Schema, limits: Limits = DEFAULT_LIMITS
) -> None:
    """Every field of `schema` that is required is there, and every one there obeys its
    rule; raises ProtocolError naming the kind, the field and what is wrong."""
    for name, field in schema.items():
        value = header.get(name, _MISSING)
        if value is _MISSING:
            if field.required:
                raise ProtocolError("bad_field", f"{kind!r} message lacks {name!r}")
            continue
        complaint = field.rule(value, limits)
        if complaint is not None:
            reason, why = complaint
            raise ProtocolError(reason, f"{kind!r} field {name!r} {why}")


def check_header(kind: str, header: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> None:
    """The checks of `kind`'s schema (and, for `hello`, of its role's)."""
    check_fields(kind, header, KINDS_SCHEMA[kind], limits)
    if kind == "hello":
        role = header["role"]
        schema = HELLO_ROLES.get(role)
        if schema is None:
            raise ProtocolError("bad_field", f"hello with unknown role {role!r:.40}")
        check_fields(f"{role} hello", header, schema, limits)
        if role == "emitter":
            check_ring_names(header)


def check_ring_names(header: Mapping[str, Any]) -> None:
    """An emitter's `ring` and `sites`: a ring file name as emitters make them, and its
    sites file beside it. (Which directory they must be in is the daemon's to check.)"""
    ring, sites = header.get("ring"), header.get("sites")
    if ring is None:
        if sites is not None:
            raise ProtocolError("bad_field", "emitter hello names 'sites' without 'ring'")
        return
    directory, _, name = ring.rpartition("/")
    if not directory or RING_NAME.fullmatch(name) is None:
        raise ProtocolError("bad_field", f"emitter hello: ring {ring!r:.80} is not a path to "
                            "a '<pid>-<hex>.ring' file")  # fmt: skip
    if sites is not None and sites != ring.removesuffix(".ring") + ".sites":
        raise ProtocolError("bad_field", f"emitter hello: sites {sites!r:.80} is not the "
                            f"sites file of ring {ring!r:.80}")  # fmt: skip


def sites_path_of(ring: str) -> str:
    return ring.removesuffix(".ring") + ".sites"


# ---- tap sites: the trace-time bound and the `.sites` file -----------------------------


def check_static_size(
    consumer: str, fields: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS
) -> None:
    """At trace time: refuse a tap site whose static fields (tree, metadata, transforms,
    shard layout) would make a tap header larger than subscribers and the daemon accept,
    naming the limit."""
    size = len(msgpack.packb({"consumer": consumer, **fields}, use_bin_type=True))
    limit = max_static_bytes(limits)
    if size > limit:
        raise TapDefinitionError(
            f"tap {consumer!r}: its static fields (tree structure, metadata, transforms) take "
            f"{size} bytes packed; a tap header may spend at most {limit} bytes on them "
            f"(tapd.protocol.schema.max_static_bytes: the {limits.max_header_bytes}-byte "
            "header limit less a reserve for per-tap fields). Pass large values as arrays."
        )


SITE_ENTRY: Schema = {
    "site": req(Int(0, U64_MAX)),
    "consumer": req(Str("max_name", empty=False)),
    "consumer_id": opt(Int(0, U64_MAX)),
    "tree": req(Of(list)),
    "meta": req(_meta),
    "transforms": req(ListOf(_transform, "max_entries")),
    "leaves": req(Of(list)),
    "shard": opt(Of(dict)),
}

_LENGTH = struct.Struct("<I")


def split_site_entries(
    data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS
) -> tuple[list[Any], int]:
    """The msgpack entries framed in `data` (each a little-endian u32 length, then that
    many bytes), and how many bytes they took: whole entries only, a half-written one is
    left for later. Raises ProtocolError on an entry longer than a header may be or
    that is not msgpack; the entries themselves are checked by `check_site_entry`."""
    entries = []
    position = 0
    while position + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, position)
        if length > limits.max_header_bytes:
            raise ProtocolError("too_large", f"sites entry at byte {position} is {length} "
                                f"bytes; the limit is {limits.max_header_bytes}")  # fmt: skip
        start = position + _LENGTH.size
        if start + length > len(data):
            break
        try:
            entries.append(msgpack.unpackb(data[start : start + length], raw=False,
                                           strict_map_key=True, max_ext_len=0))  # fmt: skip
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError("bad_header", f"sites entry at byte {position} is not valid "
                                f"msgpack ({exc})") from exc  # fmt: skip
        position = start + length
    return entries, position


def check_site_entry(entry: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """One `.sites` entry: its fields as a tap's static fields are checked, its tree and
    leaves against each other, its size against `max_static_bytes`."""
    from tapd.protocol.wire import check_shard, leaf_sizes  # (wire imports this module)

    if not isinstance(entry, dict):
        raise ProtocolError("bad_field", f"sites entry is a {type(entry).__name__}, not a map")
    check_fields("sites entry", entry, SITE_ENTRY, limits)
    leaves = entry["leaves"]
    shard = entry.get("shard")
    if shard is not None:
        # Its records carry the device's mesh coordinates as one more leaf, last.
        if not leaves:
            raise ProtocolError("bad_shard", "sharded sites entry without a coordinates leaf")
        coords = leaves[-1]
        axes = shard.get("axes")
        if not (isinstance(axes, list) and coords == ["int32", [len(axes)], 4 * len(axes)]):
            raise ProtocolError("bad_shard", f"sites entry: last leaf {coords!r:.60} is not "
                                "the int32 mesh coordinates of its axes")  # fmt: skip
        leaves = leaves[:-1]
        leaf_sizes({"tree": entry["tree"], "leaves": leaves}, limits)
        check_shard({**shard, "coords": [0] * len(axes)}, leaves, limits)
    else:
        leaf_sizes(entry, limits)
    size = len(msgpack.packb(entry, use_bin_type=True))
    if size > max_static_bytes(limits):
        raise ProtocolError("too_large", f"sites entry of {size} bytes; the limit is "
                            f"{max_static_bytes(limits)}")  # fmt: skip


# ---- a ring's control page -------------------------------------------------------------

RING_MAGIC = 0x31474E4952504154  # "TAPRING1", little-endian
# The fields checked here lead the control page in every ring format version since 2;
# which versions it can map exactly is the native library's to say (it refuses others).
RING_MIN_VERSION = 2
_CONTROL = struct.Struct("<QIIQq")  # magic, version, policy, capacity, writer pid


@dataclasses.dataclass(frozen=True)
class RingControl:
    version: int
    policy: int
    capacity: int
    writer_pid: int


def check_ring_control(page: bytes | memoryview, file_size: int, page_size: int) -> RingControl:
    """The first bytes of a ring file, checked before the file is mapped: the magic and
    version, a capacity that is a positive multiple of the page size and agrees with the
    file's size, a policy and a writer pid in range. Raises ProtocolError (`bad_ring`)."""
    control_bytes = max(page_size, 4096)
    if len(page) < _CONTROL.size:
        raise ProtocolError("bad_ring", f"ring control page of {len(page)} bytes is truncated")
    magic, version, policy, capacity, writer_pid = _CONTROL.unpack_from(page, 0)
    if magic != RING_MAGIC or version < RING_MIN_VERSION:
        raise ProtocolError("bad_ring", f"not a tapd ring (magic {magic:#x}, version {version})")
    if capacity <= 0 or capacity % page_size or capacity > 1 << 40:
        raise ProtocolError("bad_ring", f"ring capacity {capacity} is not a positive "
                            f"multiple of the page size {page_size}")  # fmt: skip
    if file_size != control_bytes + capacity:
        raise ProtocolError("bad_ring", f"ring file of {file_size} bytes does not hold its "
                            f"{capacity}-byte capacity")  # fmt: skip
    if policy not in (0, 1):
        raise ProtocolError("bad_ring", f"ring policy {policy} is unknown")
    if not 0 < writer_pid <= PID_MAX:
        raise ProtocolError("bad_ring", f"ring writer pid {writer_pid} is out of range")
    return RingControl(version, policy, capacity, writer_pid)


def check_record(payload_bytes: int, leaf_bytes: Sequence[int]) -> None:
    """A ring record's payload holds exactly its site's leaves, each padded to 8 bytes."""
    expected = sum((n + 7) & ~7 for n in leaf_bytes)
    if payload_bytes != expected:
        raise ProtocolError("bad_ring", f"record of {payload_bytes} payload bytes for a "
                            f"site whose leaves take {expected}")  # fmt: skip
