"""Every message kind's fields and limits, and every check of them, in one place
(docs/PROTOCOL.md). The bottom of tapd/protocol/: it imports nothing from wire.py,
message.py or batch.py, which all check through it.

`decode` (tapd/protocol/wire.py) calls `check_header` on every header it accepts, and
the checks of a tap's leaves and shard layout (`leaf_sizes`, `check_shard`) and of a
`taps` message's statics and rows (`check_batch_static`, `check_batch_row`), so a
handler anywhere (daemon, emitter, subscriber, forwarder) receives only messages whose
every known field is present, of its type, and within its bounds. Site entries of a
ring's `.sites` file are checked here too (`check_site_entry`, `split_site_entries`):
the daemon reads them from a file an emitter wrote, so they are input like any message
(the ring's control page and records: tapd/protocol/ring_checks.py). Their layout is
tapd/protocol/ring_format.py's.

A violation raises `ProtocolError` with a reason code used for counting:
`bad_field` (missing, mistyped or out of range), `too_large` (a string, list or map
longer than its limit), or the reasons of the checks that `wire.py` runs itself.
Unknown extra fields are allowed (a minor addition must not break older peers), and
bounded by the header's size limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack

from tapd.errors import ProtocolError, TapDefinitionError
from tapd.protocol import ring_format
from tapd.protocol.dtypes import dtype_itemsize
from tapd.protocol.rules import (
    DEFAULT_LIMITS,
    U64_MAX,
    Complaint,
    Int,
    Limits,
    ListOf,
    Of,
    Schema,
    Str,
    check_fields,
    is_int,
    opt,
    req,
)
from tapd.protocol.tree import count_leaves
from tapd.runtime import PID_MAX

# What a tap site's static fields (consumer, tree, meta, transforms, leaves, shard
# layout) may take of a tap header: the rest of `max_header_bytes` is left for the
# per-tap fields and what the daemon adds (tid, emitter name, host). An emitter
# refuses larger sites at trace time (`check_static_size`), so that no subscriber and
# no daemon has to reject them later.
STATIC_RESERVE = 16 << 10


def max_static_bytes(limits: Limits = DEFAULT_LIMITS) -> int:
    return limits.max_header_bytes - STATIC_RESERVE


# A ring's file name as emitters make it (`<pid>-<random hex>.ring`), and its sites
# file beside it: the daemon opens and later removes both, so neither may name
# anything else (docs/PROTOCOL.md, "Shared-memory ring").
RING_NAME = re.compile(r"[0-9]{1,10}-[0-9a-f]{1,64}\.ring")


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
    if not (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and len(value[0]) <= limits.max_name
        and isinstance(value[1], dict)
    ):
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
    if not (
        isinstance(value, list)
        and len(value) == 3
        and is_int(value[0])
        and is_int(value[1])
        and 0 <= value[0] <= value[1] <= U64_MAX
        and value[2] in _OUTCOMES
    ):
        return ("bad_field", f"is not [first fid, last fid, outcome]: {value!r:.60}")
    return None


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
    "leaves": req(Of(list)),  # leaf_sizes checks them
    "tid": opt(Int(0)),
    "emitter": opt(_ID),
    "fid": opt(Int(0)),  # forwarder -> upstream: the forwarder's number for the tap
    "every": opt(Int(1, U64_MAX)),  # the site's own sampling, as its site entry says
    "always": opt(Of(bool)),  # never dormant (the site entry's)
    # `shard`: check_shard
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

# The most a taker may thin a site by (`every`): what a ring's site slot holds, below
# its "dormant" value (tapd/protocol/ring_format.py, EVERY_DORMANT).
MAX_EVERY = 2**32 - 2


def _every_pair(value: Any, limits: Limits) -> Complaint:
    """[pattern, n]: of the taps of consumers matching `pattern`, those with
    seq % (K * n) == 0 (K: the site's own every) are wanted."""
    if not (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and 0 < len(value[0]) <= limits.max_name
        and is_int(value[1])
        and 1 <= value[1] <= MAX_EVERY
    ):
        return ("bad_field", f"is not [pattern, every (1 to {MAX_EVERY})]: {value!r:.60}")
    return None


_EVERY_PAIRS = ListOf(_every_pair, "max_patterns")

SUBSCRIBER_HELLO: Schema = {
    "consumers": req(ListOf(Str("max_name", empty=False), "max_patterns", empty=False)),
    "window": req(Int(1, DEFAULT_LIMITS.max_window)),
    "name": opt(_NAME),
    "batch": opt(Of(bool)),
    "columns": opt(Of(bool)),  # it decodes `taps` messages of columnar runs
    "group": opt(Str("max_name", empty=False)),  # a worker pool (docs/PROTOCOL.md)
    "every": opt(_EVERY_PAIRS),  # [pattern, n] for some of `consumers`: sampling
}

HELLO_ROLES: dict[str, Schema] = {"emitter": EMITTER_HELLO, "subscriber": SUBSCRIBER_HELLO}

_COUNT = Int(0)
KINDS_SCHEMA: dict[str, Schema] = {
    "hello": {"role": req(Str("max_name"))},
    "welcome": {
        "window_bytes": req(_COUNT),
        "daemon": req(_ID),
        "held_bytes": opt(_COUNT),
        "nonce": opt(_COUNT),
    },
    "rehello": {},
    "tap": TAP,
    # A tap whose bytes a same-host subscriber reads from the emitter's ring: the ring's
    # file name and each leaf's ring position instead of frames (tapd_client/shm.py).
    "ring_tap": {
        **TAP,
        "ring": req(Str("max_name")),
        "positions": req(ListOf(Int(0), "max_leaves")),
    },
    # tapd/protocol/batch.py; `runs`: columnar runs, in a message whose `taps` is empty
    "taps": {"statics": req(Of(list)), "taps": req(Of(list)), "runs": opt(Of(list))},
    # Taps whose bytes a same-host subscriber reads from emitters' rings, as `taps` rows
    # with a ring and a ring position for a body frame and an offset (batch.py).
    "ring_taps": {"statics": req(Of(list)), "rings": req(Of(list)), "taps": req(Of(list))},
    # `delivered`, `dropped`, `unrouted`: this emitter's totals at this daemon so far.
    "credit": {
        "bytes": req(_COUNT),
        "delivered": opt(_COUNT),
        "dropped": opt(_COUNT),
        "unrouted": opt(_COUNT),
    },
    "ack": {"upto": req(Int(-1)), "errors": req(ListOf(_ack_error, "max_entries"))},
    "error": {
        "consumer": req(_NAME),
        "seq": req(Int()),
        "error": req(Str("max_text")),
        "subscriber": req(_ID),
        "emitter": opt(_ID),
        "device": opt(Int(optional=True)),
    },
    "barrier": {"id": req(Int(0)), "ring_position": opt(Int(0))},
    # `outcomes` (to a forwarder): [first fid, last fid, outcome] ranges, docs/PROTOCOL.md
    "barrier_done": {
        "id": req(Int(0)),
        "delivered": req(_COUNT),
        "dropped": req(_COUNT),
        "unrouted": req(_COUNT),
        "outcomes": opt(ListOf(_outcome_range, "max_outcome_ranges")),
    },
    # daemon -> forwarder: what this daemon's takers want (docs/PROTOCOL.md, "wants")
    "wants": {"patterns": req(_EVERY_PAIRS), "everything": opt(Of(bool))},
    "heartbeat": {},
    "bye": {},
    "stats": {},
    "stats_reply": {"stats": req(Of(dict))},
    "shutdown": {},
}
KINDS = frozenset(KINDS_SCHEMA)


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
        else:
            check_every_patterns(header)


def check_every_patterns(header: Mapping[str, Any]) -> None:
    """A subscriber's `every` names each pattern once, each one of its `consumers`."""
    pairs = header.get("every", [])
    named = [pattern for pattern, _ in pairs]
    unknown = set(named) - set(header["consumers"])
    if unknown or len(set(named)) != len(named):
        what = (
            f"{sorted(unknown)[0]!r:.80} is not one of its consumers"
            if unknown
            else ("names a pattern twice")
        )
        raise ProtocolError("bad_field", f"subscriber hello: 'every' {what}")


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
        raise ProtocolError(
            "bad_field",
            f"emitter hello: ring {ring!r:.80} is not a path to a '<pid>-<hex>.ring' file",
        )
    if sites is not None and sites != ring.removesuffix(".ring") + ".sites":
        raise ProtocolError(
            "bad_field",
            f"emitter hello: sites {sites!r:.80} is not the sites file of ring {ring!r:.80}",
        )


def sites_path_of(ring: str) -> str:
    return ring.removesuffix(".ring") + ".sites"


# ---- a tap's leaves and shard layout ---------------------------------------------------


def leaf_sizes(header: Mapping[str, Any], limits: Limits = DEFAULT_LIMITS) -> list[int]:
    """Check a tap header's `tree` and `leaves`; the byte size of each leaf."""
    leaves = header["leaves"]
    if len(leaves) > limits.max_leaves:
        raise ProtocolError("too_large", f"{len(leaves)} leaves > {limits.max_leaves}")
    expected_leaves = count_leaves(header["tree"], limits.max_tree_depth)
    if expected_leaves != len(leaves):
        raise ProtocolError("bad_tree", f"tree has {expected_leaves} leaves, header {len(leaves)}")
    total = 0
    sizes = []
    for index, leaf in enumerate(leaves):
        if not (isinstance(leaf, list) and len(leaf) == 3):
            raise ProtocolError("bad_field", f"leaf {index} is not [dtype, shape, nbytes]")
        name, shape, nbytes = leaf
        itemsize = dtype_itemsize(name)
        if (
            not isinstance(shape, list)
            or len(shape) > limits.max_ndim
            or not all(is_int(d) and d >= 0 for d in shape)
        ):
            raise ProtocolError("bad_field", f"leaf {index} has bad shape {shape!r:.60}")
        expected = math.prod(shape) * itemsize
        if not is_int(nbytes):
            raise ProtocolError("bad_field", f"leaf {index} nbytes {nbytes!r:.20} is not an int")
        if nbytes != expected:
            raise ProtocolError(
                "bad_frames",
                f"leaf {index} ({name}{shape}) needs {expected} bytes; header says {nbytes!r:.20}",
            )
        total += expected
        if total > limits.max_message_bytes:
            raise ProtocolError("too_large", f"arrays exceed {limits.max_message_bytes} bytes")
        sizes.append(expected)
    return sizes


def check_shard(shard: Any, leaves: list[Any], limits: Limits = DEFAULT_LIMITS) -> None:
    """A tap's optional `shard` field (docs/PROTOCOL.md): mesh axes, this device's
    coordinates on them, and each leaf's global shape and splitting axes."""

    def bad(why: str) -> ProtocolError:
        return ProtocolError("bad_shard", f"shard {why}")

    if not isinstance(shard, dict):
        raise bad(f"is a {type(shard).__name__}, not a map")
    axes, sizes, coords, layout = (shard.get(k) for k in ("axes", "sizes", "coords", "layout"))
    if not (isinstance(axes, list) and isinstance(sizes, list) and isinstance(coords, list)):
        raise bad("needs lists 'axes', 'sizes' and 'coords'")
    if not (len(axes) == len(sizes) == len(coords)) or len(axes) > limits.max_ndim:
        raise bad(f"axes/sizes/coords lengths {len(axes)}/{len(sizes)}/{len(coords)} differ")
    if not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise bad(f"axes {axes!r:.60} are not distinct names")
    for name, size, coord in zip(axes, sizes, coords, strict=True):
        if not (is_int(size) and is_int(coord) and 0 <= coord < size):
            raise bad(f"axis {name!r}: coordinate {coord!r:.20} not within size {size!r:.20}")
    if not isinstance(layout, list) or len(layout) != len(leaves):
        raise bad(f"layout must have one entry per leaf ({len(leaves)})")
    for index, (entry, leaf) in enumerate(zip(layout, leaves, strict=True)):
        if not (isinstance(entry, list) and len(entry) == 2):
            raise bad(f"layout {index} is not [global_shape, dims]")
        global_shape, dims = entry
        if not (isinstance(global_shape, list) and isinstance(dims, list)):
            raise bad(f"layout {index} is not [global_shape, dims]")
        if len(global_shape) != len(dims) or len(dims) > limits.max_ndim:
            raise bad(f"layout {index}: {len(global_shape)} dimensions but {len(dims)} dims")
        named = [a for split in dims if isinstance(split, list) for a in split]
        if len(set(map(str, named))) != len(named):  # as in a PartitionSpec: once at most
            raise bad(f"layout {index}: dims {dims!r:.60} name an axis twice")
        block = []
        for extent, split in zip(global_shape, dims, strict=True):
            if not (isinstance(split, list) and all(a in axes for a in split)):
                raise bad(f"layout {index}: dims {split!r:.40} name unknown axes")
            parts = math.prod(sizes[axes.index(a)] for a in split)
            if not is_int(extent) or extent < 0 or extent % parts:
                raise bad(f"layout {index}: extent {extent!r:.20} not divisible by {parts}")
            block.append(extent // parts)
        if math.prod(block) != math.prod(leaf[1]):
            raise bad(f"layout {index}: block {block} does not hold the leaf's shape {leaf[1]}")


# ---- a `taps` message's statics and rows (tapd/protocol/batch.py) ----------------------

# A tap's fields that change from tap to tap; the rest is static per site and emitter.
PER_TAP = ("tid", "seq", "step", "device", "time")
# A row: static index, PER_TAP..., shard coordinates or nil, body frame, offset.
ROW_LENGTH = 1 + len(PER_TAP) + 3
STATIC_SCHEMA: Schema = {
    **{k: v for k, v in TAP.items() if k not in PER_TAP},
    "emitter": req(TAP["emitter"].rule),
}


def check_batch_static(index: int, static: Any, limits: Limits = DEFAULT_LIMITS) -> list[int]:
    """Static entry `index` of a `taps` message: a tap's static fields, checked as a
    tap's are (its shard layout with zero coordinates); its leaves' sizes."""
    if not isinstance(static, dict):
        raise ProtocolError("bad_field", f"batch static {index} is not a map")
    check_fields("batch static", static, STATIC_SCHEMA, limits)
    sizes = leaf_sizes(static, limits)
    shard = static.get("shard")
    if shard is not None:
        axes = shard.get("axes") if isinstance(shard, dict) else None
        zeros = [0] * len(axes) if isinstance(axes, list) else None
        check_shard(
            shard if zeros is None else {**shard, "coords": zeros}, static["leaves"], limits
        )
    return sizes


def check_batch_row(row: Any, number: int, shard_sizes: Sequence[list[int] | None]) -> None:
    """Tap `number` of a `taps` message: a row naming one of its statics (whose shard
    axes have `shard_sizes`, None where unsharded), with a tap's per-tap fields. (Where
    its leaves lie in the bodies is batch.read_runs' to check.)"""
    # (`type(x) is int`: quicker than isinstance, and refuses bools as the wire must)
    if not (
        type(row) is list
        and len(row) == ROW_LENGTH
        and type(row[0]) is int
        and 0 <= row[0] < len(shard_sizes)
    ):
        raise ProtocolError("bad_field", f"batch tap {number}: {row!r:.60} is not a row")
    _, tid, seq, step, device, time, coords, _, _ = row
    if not (
        type(tid) is int
        and type(seq) is int
        and seq >= 0
        and type(time) is int
        and (step is None or type(step) is int)
        and (device is None or type(device) is int)
    ):
        raise ProtocolError(
            "bad_field", f"batch tap {number}: bad tid/seq/step/device/time {row[1:6]!r:.80}"
        )
    axes = shard_sizes[row[0]]
    if axes is None:
        if coords is not None:
            raise ProtocolError(
                "bad_shard", f"batch tap {number}: coordinates for an unsharded tap"
            )
        return
    if not (
        isinstance(coords, list)
        and len(coords) == len(axes)
        and all(is_int(c) and 0 <= c < n for c, n in zip(coords, axes, strict=True))
    ):
        raise ProtocolError(
            "bad_shard",
            f"batch tap {number}: coordinates {coords!r:.40} do not fit axes of sizes {axes}",
        )


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
    "every": opt(Int(1, U64_MAX)),  # the site's own sampling (absent: 1)
    "always": opt(Of(bool)),  # never dormant, never thinned by the daemon
}

_LENGTH = ring_format.SITE_ENTRY_LENGTH


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
        limit = limits.max_header_bytes
        if length > limit:
            why = f"sites entry at byte {position} is {length} bytes; the limit is {limit}"
            raise ProtocolError("too_large", why)
        start = position + _LENGTH.size
        if start + length > len(data):
            break
        packed = data[start : start + length]
        try:
            entries.append(msgpack.unpackb(packed, raw=False, strict_map_key=True, max_ext_len=0))
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(
                "bad_header", f"sites entry at byte {position} is not valid msgpack ({exc})"
            ) from exc
        position = start + length
    return entries, position


def check_site_entry(entry: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """One `.sites` entry: its fields as a tap's static fields are checked, its tree and
    leaves against each other, its size against `max_static_bytes`."""
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
            raise ProtocolError(
                "bad_shard",
                f"sites entry: last leaf {coords!r:.60} is not "
                "the int32 mesh coordinates of its axes",
            )
        leaves = leaves[:-1]
        leaf_sizes({"tree": entry["tree"], "leaves": leaves}, limits)
        check_shard({**shard, "coords": [0] * len(axes)}, leaves, limits)
    else:
        leaf_sizes(entry, limits)
    size = len(msgpack.packb(entry, use_bin_type=True))
    if size > max_static_bytes(limits):
        raise ProtocolError(
            "too_large", f"sites entry of {size} bytes; the limit is {max_static_bytes(limits)}"
        )
