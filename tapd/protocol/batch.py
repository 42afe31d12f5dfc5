"""`taps` messages: many small taps, daemon to subscriber, in one message.

A tap's header is mostly the same from one tap of a site to the next: consumer,
emitter, tree, leaves, transforms, metadata. A batch sends those *static* fields once
(`statics`) and each tap as a short row of what changes: its static's index, delivery
id, sequence number, step, device, time and shard coordinates. The arrays of all taps
share one body frame, each leaf padded to 8 bytes (docs/PROTOCOL.md, "taps"). For 64 B
taps this turns a message, a header and its checks per tap into a few integers per tap.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack

from tapd.errors import ProtocolError
from tapd.protocol.wire import (
    _SCHEMAS,
    MAGIC,
    Frame,
    Limits,
    Message,
    Schema,
    check_fields,
    check_shard,
    encode_header,
    is_int,
    leaf_sizes,
)

# A tap's fields that change from tap to tap; the rest is static per site and emitter.
PER_TAP = ("tid", "seq", "step", "device", "time")
ROW_LENGTH = 1 + len(PER_TAP) + 1  # static index, PER_TAP..., shard coordinates or nil
STATIC_SCHEMA: Schema = {
    **{k: v for k, v in _SCHEMAS["tap"].items() if k not in PER_TAP},
    "emitter": str,
}
_NOT_STATIC = frozenset((*PER_TAP, "kind", "shard"))


class BatchTap(NamedTuple):
    """One tap to batch: its header as the daemon holds it, its frames, the delivery id
    and emitter name the subscriber is told, and a token equal for taps whose static
    fields are equal (a ring site; None: derive and compare them)."""

    header: Mapping[str, Any]
    frames: Sequence[Frame]
    tid: int
    emitter: str
    site: Hashable | None = None


def encode_batch(taps: Sequence[BatchTap]) -> list[Frame]:
    """The frames of one `taps` message carrying `taps`, in order."""
    statics: list[dict[str, Any]] = []
    index_of: dict[Hashable, int] = {}
    rows = []
    body = bytearray()
    for tap in taps:
        header = tap.header
        key: Hashable = (tap.site, tap.emitter)
        index = index_of.get(key) if tap.site is not None else None
        shard = header.get("shard")
        if index is None:
            static = {k: v for k, v in header.items() if k not in _NOT_STATIC}
            static["emitter"] = tap.emitter
            if shard is not None:
                static["shard"] = {k: v for k, v in shard.items() if k != "coords"}
            if tap.site is None:
                key = msgpack.packb(static, use_bin_type=True)
                index = index_of.get(key)
            if index is None:
                index = index_of[key] = len(statics)
                statics.append(static)
        rows.append([index, tap.tid, header["seq"], header["step"], header["device"],
                     header["time"], None if shard is None else shard["coords"]])  # fmt: skip
        for frame in tap.frames:
            body += frame
            body += bytes(-len(frame) % 8)
    header_bytes = encode_header({"kind": "taps", "statics": statics, "taps": rows})
    return [MAGIC, header_bytes, bytes(body)]


class _Static:
    """A checked static entry: its fields, leaf sizes, and shard axes if any."""

    def __init__(self, index: int, static: Any, limits: Limits) -> None:
        if not isinstance(static, dict):
            raise ProtocolError("bad_field", f"batch static {index} is not a map")
        check_fields("tap", static, STATIC_SCHEMA)
        self.fields = static
        self.sizes = leaf_sizes(static, limits)
        self.padded = [n + (-n % 8) for n in self.sizes]
        shard = static.get("shard")
        self.shard_sizes: list[int] | None = None
        if shard is not None:
            axes = shard.get("axes") if isinstance(shard, dict) else None
            zeros = [0] * len(axes) if isinstance(axes, list) else None
            check_shard({**shard, "coords": zeros} if zeros is not None else shard,
                        static["leaves"], limits)  # fmt: skip
            self.shard_sizes = list(shard["sizes"])

    def tap_header(self, row: list[Any], where: str) -> dict[str, Any]:
        _, tid, seq, step, device, time, coords = row
        if not (
            is_int(tid)
            and is_int(seq)
            and seq >= 0
            and is_int(time)
            and (step is None or is_int(step))
            and (device is None or is_int(device))
        ):
            raise ProtocolError("bad_field", f"{where}: bad tid/seq/step/device/time "
                                f"{row[1:6]!r:.80}")  # fmt: skip
        header = {**self.fields, "kind": "tap", "tid": tid, "seq": seq, "step": step,
                  "device": device, "time": time}  # fmt: skip
        if self.shard_sizes is None:
            if coords is not None:
                raise ProtocolError("bad_shard", f"{where}: coordinates for an unsharded tap")
            return header
        if not (
            isinstance(coords, list)
            and len(coords) == len(self.shard_sizes)
            and all(is_int(c) and 0 <= c < n for c, n in zip(coords, self.shard_sizes, strict=True))
        ):
            raise ProtocolError("bad_shard", f"{where}: coordinates {coords!r:.40} do not fit "
                                f"axes of sizes {self.shard_sizes}")  # fmt: skip
        header["shard"] = {**self.fields["shard"], "coords": coords}
        return header


def split_batch(header: dict[str, Any], payload: list[memoryview], limits: Limits) -> list[Message]:
    """The taps of a decoded `taps` message, each a `tap` Message whose frames view the
    body; raises ProtocolError on any inconsistency."""
    if len(payload) != 1:
        raise ProtocolError("bad_frames", f"'taps' needs one body frame, got {len(payload)}")
    rows, statics_given = header["taps"], header["statics"]
    if max(len(rows), len(statics_given)) > limits.max_batch:
        raise ProtocolError("too_large", f"{len(rows)} taps, {len(statics_given)} statics in "
                            f"a batch: more than {limits.max_batch}")  # fmt: skip
    statics = [_Static(i, static, limits) for i, static in enumerate(statics_given)]
    body = payload[0]
    offset = 0
    taps = []
    for number, row in enumerate(rows):
        where = f"batch tap {number}"
        if not (isinstance(row, list) and len(row) == ROW_LENGTH and is_int(row[0])
                and 0 <= row[0] < len(statics)):  # fmt: skip
            raise ProtocolError("bad_field", f"{where}: {row!r:.60} is not a tap row")
        static = statics[row[0]]
        tap_header = static.tap_header(row, where)
        frames = []
        for nbytes, padded in zip(static.sizes, static.padded, strict=True):
            if offset + nbytes > len(body):
                raise ProtocolError("bad_frames", f"{where}: leaves overrun the "
                                    f"{len(body)}-byte body")  # fmt: skip
            frames.append(body[offset : offset + nbytes])
            offset += padded
        taps.append(Message(tap_header, frames))
    if offset != len(body):
        raise ProtocolError("bad_frames", f"batch body has {len(body)} bytes, taps need {offset}")
    return taps
