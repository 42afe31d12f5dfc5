"""Encode and decode tapd messages (docs/PROTOCOL.md). Pure functions, no sockets.

A message is `[MAGIC, msgpack header, *array frames]`. Decoding checks everything the
spec fixes (magic, version, header fields and their types, frame count, frame sizes,
limits) and raises `ProtocolError` with a short reason code on the first violation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from tapd.errors import ProtocolError
from tapd.protocol import rules, schema
from tapd.protocol.batch import read_runs, read_spans
from tapd.protocol.dtypes import dtype_name
from tapd.protocol.message import MAGIC, VERSION, Frame, Message, encode_header
from tapd.protocol.rules import is_int
from tapd.protocol.schema import check_header, check_shard, leaf_sizes

# Named here too, for the callers that take the whole protocol from wire.py.
__all__ = [
    "KINDS",
    "MAGIC",
    "VERSION",
    "Frame",
    "Limits",
    "Message",
    "array_frame",
    "check_shard",
    "decode",
    "describe_array",
    "encode",
    "encode_header",
    "is_int",
    "leaf_sizes",
]

Limits = rules.Limits
KINDS = schema.KINDS


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
    if kind not in KINDS or kind in ("taps", "ring_taps"):
        raise ValueError(
            f"unknown message kind {kind!r}"
            if kind not in KINDS
            else f"{kind!r} messages are made by tapd.protocol.batch"
        )
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


def _buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    return buffer if buffer is not None else memoryview(frame)


def decode(frames: Sequence[Any], limits: Limits = rules.DEFAULT_LIMITS) -> Message:
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
        return Message(header, payload, read_runs(header, payload, limits))
    elif kind == "ring_taps":
        return Message(header, payload, spans=read_spans(header, payload, limits))
    elif payload:
        raise ProtocolError("bad_frames", f"{kind!r} message has {len(payload)} extra frames")
    return Message(header, payload)


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
            raise ProtocolError(
                "bad_frames", f"leaf {index} needs {nbytes} bytes, its frame has {len(frame)}"
            )
    if header["seq"] < 0:
        raise ProtocolError("bad_field", f"negative seq {header['seq']}")
    shard = header.get("shard")
    if shard is not None:
        check_shard(shard, header["leaves"], limits)
