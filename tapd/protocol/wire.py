"""Encode and decode tapd messages (docs/PROTOCOL.md). Pure functions, no sockets.

A message is `[MAGIC, msgpack header, *array frames]`. Decoding checks everything the
spec fixes (magic, version, header fields and their types, frame count, frame sizes,
limits) and raises `ProtocolError` with a short reason code on the first violation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from tapd.errors import ProtocolError
from tapd.protocol import schema
from tapd.protocol.dtypes import dtype_from_name, dtype_name
from tapd.protocol.schema import KINDS_SCHEMA, check_header, required_types
from tapd.protocol.tree import LEAF, count_leaves, unflatten

if TYPE_CHECKING:
    from tapd.protocol.batch import SiteRun

VERSION = 1
MAGIC = b"TAPD" + bytes([VERSION])

Frame = bytes | memoryview


Limits = schema.Limits
DEFAULT_LIMITS = schema.DEFAULT_LIMITS
KINDS = schema.KINDS
# The kinds, their fields and the limits live in tapd/protocol/schema.py; the simple
# view here (required fields and their types) is what older callers and tests use.
Schema = dict[str, type | tuple[type, ...]]
_SCHEMAS: dict[str, Schema] = {kind: required_types(s) for kind, s in KINDS_SCHEMA.items()}


@dataclasses.dataclass(frozen=True)
class Message:
    """A decoded message: its header and, for taps, the raw array frames."""

    header: dict[str, Any]
    frames: Sequence[Frame] = ()
    runs: Sequence[SiteRun] = ()  # a `taps` message's taps, checked, by static entry
    site: Hashable | None = None  # equal for taps of one site: static fields equal too

    @functools.cached_property
    def batch(self) -> list[Message]:
        """A `taps` message's taps, each a `tap` Message viewing a body frame."""
        return [run.message(i) for run in self.runs for i in range(len(run))]

    @property
    def kind(self) -> str:
        return str(self.header["kind"])

    def arrays(self) -> list[np.ndarray]:
        """The tap's leaves as read-only numpy arrays viewing the frames."""
        out = []
        for (name, shape, _), frame in zip(self.header["leaves"], self.frames, strict=True):
            array = np.frombuffer(frame, dtype=dtype_from_name(name)).reshape(shape)
            array.flags.writeable = False  # it views the message's frame
            out.append(array)
        return out

    def value(self) -> Any:
        """The tapped value, rebuilt with its pytree structure."""
        arrays = self.arrays()
        if self.header["tree"] == LEAF:  # the common case: one array, nothing to rebuild
            return arrays[0]
        return unflatten(self.header["tree"], arrays)


def describe_array(array: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    """A C-contiguous little-endian copy-if-needed of `array` and its `leaves` entry."""
    name = dtype_name(array.dtype)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
        array = array.copy(order="C")
    return array, [name, list(array.shape), array.nbytes]


def array_frame(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, without copying (works for ml_dtypes too)."""
    return memoryview(array.reshape(-1).view(np.uint8).data)


def encode(kind: str, fields: Mapping[str, Any], arrays: Sequence[np.ndarray] = ()) -> list[Frame]:
    """Frames for one message. For `tap`, `fields` omits `leaves`: it is built here."""
    if kind not in KINDS or kind == "taps":
        raise ValueError(f"unknown message kind {kind!r}" if kind != "taps" else
                         "'taps' messages are made by tapd.protocol.batch")  # fmt: skip
    header = {**fields, "kind": kind}
    frames: list[Frame] = []
    if kind == "tap":
        leaves = []
        for array in arrays:
            array, leaf = describe_array(array)
            leaves.append(leaf)
            frames.append(array_frame(array))
        header["leaves"] = leaves
    elif arrays:
        raise ValueError(f"{kind!r} messages carry no arrays")
    return [MAGIC, encode_header(header), *frames]


def encode_header(header: Mapping[str, Any]) -> bytes:
    """Pack a header (the daemon also uses it to stamp delivery ids on forwarded taps)."""
    packed: bytes = msgpack.packb(dict(header), use_bin_type=True)
    return packed


def _buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    return buffer if buffer is not None else memoryview(frame)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Validate and decode one multipart message; raises ProtocolError."""
    if len(frames) < 2:
        raise ProtocolError("bad_frames", f"expected at least 2 frames, got {len(frames)}")
    magic = _buffer(frames[0])  # (not copied: a peer may send anything here, of any size)
    if len(magic) != len(MAGIC) or magic[:4] != MAGIC[:4]:
        raise ProtocolError("bad_magic", f"first frame {bytes(magic[:16])!r} is not a tapd magic")
    if magic[4] != VERSION:
        raise ProtocolError("bad_version", f"protocol version {magic[4]}, expected {VERSION}")
    header = _unpack_header(_buffer(frames[1]), limits)
    kind = header.get("kind")
    if not isinstance(kind, str) or kind not in KINDS:
        raise ProtocolError("bad_header", f"unknown message kind {kind!r:.40}")
    check_header(kind, header, limits)
    payload = [_buffer(f) for f in frames[2:]]
    if kind == "tap":
        _check_tap(header, payload, limits)
    elif kind == "taps":
        from tapd.protocol.batch import read_runs  # (batch.py builds on this module)

        return Message(header, payload, read_runs(header, payload, limits))
    elif payload:
        raise ProtocolError("bad_frames", f"{kind!r} message has {len(payload)} extra frames")
    return Message(header, payload)


def check_fields(kind: str, header: dict[str, Any], limits: Limits = DEFAULT_LIMITS) -> None:
    """Every field of `kind`'s schema (tapd/protocol/schema.py) is there and valid."""
    check_header(kind, header, limits)


def _unpack_header(raw: memoryview, limits: Limits) -> dict[str, Any]:
    if len(raw) > limits.max_header_bytes:
        raise ProtocolError("too_large", f"header of {len(raw)} bytes > {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError("bad_header", f"header is not valid msgpack ({exc})") from exc
    if not isinstance(header, dict):
        raise ProtocolError("bad_header", f"header is a {type(header).__name__}, not a map")
    return header


def _check_tap(header: dict[str, Any], payload: list[memoryview], limits: Limits) -> None:
    sizes = leaf_sizes(header, limits)
    if len(sizes) != len(payload):
        raise ProtocolError("bad_frames", f"{len(sizes)} leaves but {len(payload)} array frames")
    for index, (nbytes, frame) in enumerate(zip(sizes, payload, strict=True)):
        if len(frame) != nbytes:
            raise ProtocolError("bad_frames", f"leaf {index} needs {nbytes} bytes, "
                                f"its frame has {len(frame)}")  # fmt: skip
    if header["seq"] < 0:
        raise ProtocolError("bad_field", f"negative seq {header['seq']}")
    shard = header.get("shard")
    if shard is not None:
        check_shard(shard, header["leaves"], limits)


def leaf_sizes(header: dict[str, Any], limits: Limits) -> list[int]:
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
        dtype = dtype_from_name(name)
        if (
            not isinstance(shape, list)
            or len(shape) > limits.max_ndim
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ProtocolError("bad_field", f"leaf {index} has bad shape {shape!r:.60}")
        expected = math.prod(shape) * dtype.itemsize
        if not isinstance(nbytes, int) or isinstance(nbytes, bool):
            raise ProtocolError("bad_field", f"leaf {index} nbytes {nbytes!r:.20} is not an int")
        if nbytes != expected:
            raise ProtocolError("bad_frames", f"leaf {index} ({name}{shape}) needs {expected} "
                                f"bytes; header says {nbytes!r:.20}")  # fmt: skip
        total += expected
        if total > limits.max_message_bytes:
            raise ProtocolError("too_large", f"arrays exceed {limits.max_message_bytes} bytes")
        sizes.append(expected)
    return sizes


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_shard(shard: Any, leaves: list[Any], limits: Limits) -> None:
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
