"""`taps` messages: many small taps, daemon to subscriber, in one message.

A tap's header is mostly the same from one tap of a site to the next: consumer,
emitter, tree, leaves, transforms, metadata. A batch sends those *static* fields once
(`statics`) and each tap as a short row of what changes: its static's index, delivery
id, sequence number, step, device, time and shard coordinates, and where its leaves
start: a body frame and an offset in it, each leaf then padded to 8 bytes
(docs/PROTOCOL.md, "taps"). Bytes between taps are ignored, so a daemon can send a span
of ring records as a body as it is, record headers and all, copying nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgpack

from tapd.errors import ProtocolError
from tapd.protocol.schema import TAP, Schema, check_fields, req
from tapd.protocol.wire import (
    MAGIC,
    Frame,
    Limits,
    Message,
    check_shard,
    encode_header,
    is_int,
    leaf_sizes,
)

# A tap's fields that change from tap to tap; the rest is static per site and emitter.
PER_TAP = ("tid", "seq", "step", "device", "time")
# A row: static index, PER_TAP..., shard coordinates or nil, body frame, offset.
ROW_LENGTH = 1 + len(PER_TAP) + 3
STATIC_SCHEMA: Schema = {
    **{k: v for k, v in TAP.items() if k not in PER_TAP},
    "emitter": req(TAP["emitter"].rule),
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


class BatchRun(NamedTuple):
    """Taps of one site whose leaves already lie in one buffer (ring records): `body`
    goes out as a frame of its own, uncopied; tap i's leaves start at `offsets[i]`.
    `header` holds the site's static fields; the columns hold the rest."""

    header: Mapping[str, Any]
    body: Frame
    offsets: Sequence[int]
    first_tid: int
    emitter: str
    site: Hashable
    seqs: Sequence[int]
    steps: Sequence[int | None]
    devices: Sequence[int | None]
    times: Sequence[int]
    coords: Sequence[list[int]] | None = None


def _static_of(header: Mapping[str, Any], emitter: str) -> dict[str, Any]:
    static = {k: v for k, v in header.items() if k not in _NOT_STATIC}
    static["emitter"] = emitter
    shard = header.get("shard")
    if shard is not None:
        static["shard"] = {k: v for k, v in shard.items() if k != "coords"}
    return static


def encode_batch(pieces: Sequence[BatchTap | BatchRun]) -> list[Frame]:
    """The frames of one `taps` message carrying `pieces`' taps, in order: single taps'
    arrays copied into the first body frame, each run's body as a frame of its own."""
    statics: list[dict[str, Any]] = []
    index_of: dict[Hashable, int] = {}

    def static_index(site: Hashable | None, header: Mapping[str, Any], emitter: str) -> int:
        key: Hashable = (site, emitter)
        index = index_of.get(key) if site is not None else None
        if index is None:
            static = _static_of(header, emitter)
            if site is None:
                key = msgpack.packb(static, use_bin_type=True)
                index = index_of.get(key)
            if index is None:
                index = index_of[key] = len(statics)
                statics.append(static)
        return index

    rows: list[Sequence[Any]] = []  # (msgpack packs tuples and lists alike, as arrays)
    shared = bytearray()
    bodies: list[Frame] = [b""]  # frame 0: single taps' arrays, copied
    for piece in pieces:
        if isinstance(piece, BatchRun):
            index = static_index(piece.site, piece.header, piece.emitter)
            frame = len(bodies)
            bodies.append(piece.body)
            count = len(piece.offsets)
            coords: Iterable[list[int] | None] = piece.coords or itertools.repeat(None, count)
            # Column by column, zipped in C: a run is thousands of small taps.
            rows.extend(zip(
                itertools.repeat(index, count), range(piece.first_tid, piece.first_tid + count),
                piece.seqs, piece.steps, piece.devices, piece.times, coords,
                itertools.repeat(frame, count), piece.offsets, strict=True))  # fmt: skip
            continue
        header = piece.header
        shard = header.get("shard")
        rows.append([static_index(piece.site, header, piece.emitter), piece.tid,
                     header["seq"], header["step"], header["device"], header["time"],
                     None if shard is None else shard["coords"], 0, len(shared)])  # fmt: skip
        for array in piece.frames:
            shared += array
            shared += bytes(-len(array) % 8)
    bodies[0] = bytes(shared)
    header_bytes = encode_header({"kind": "taps", "statics": statics, "taps": rows})
    return [MAGIC, header_bytes, *bodies]


class _Static:
    """A checked static entry: its fields, leaf sizes, and shard axes if any."""

    def __init__(self, index: int, static: Any, limits: Limits) -> None:
        if not isinstance(static, dict):
            raise ProtocolError("bad_field", f"batch static {index} is not a map")
        check_fields("batch static", static, STATIC_SCHEMA, limits)
        self.fields = static
        self.sizes = leaf_sizes(static, limits)
        # Each leaf's (start, size) from the tap's offset, padded to 8; and the whole.
        self.layout = []
        self.extent = 0
        for nbytes in self.sizes:
            self.layout.append((self.extent, nbytes))
            self.extent += nbytes + (-nbytes % 8)
        shard = static.get("shard")
        self.shard_sizes: list[int] | None = None
        if shard is not None:
            axes = shard.get("axes") if isinstance(shard, dict) else None
            zeros = [0] * len(axes) if isinstance(axes, list) else None
            check_shard({**shard, "coords": zeros} if zeros is not None else shard,
                        static["leaves"], limits)  # fmt: skip
            self.shard_sizes = list(shard["sizes"])

    def check_row(self, row: list[Any], number: int) -> None:
        """Check tap `number`'s per-tap fields (its row), as the wire requires."""
        _, tid, seq, step, device, time, coords, _, _ = row
        # (`type(x) is int`: quicker than isinstance, and refuses bools as the wire must)
        if not (
            type(tid) is int
            and type(seq) is int
            and seq >= 0
            and type(time) is int
            and (step is None or type(step) is int)
            and (device is None or type(device) is int)
        ):
            raise ProtocolError("bad_field", f"batch tap {number}: bad tid/seq/step/device/"
                                f"time {row[1:6]!r:.80}")  # fmt: skip
        if self.shard_sizes is None:
            if coords is not None:
                raise ProtocolError("bad_shard", f"batch tap {number}: coordinates for an "
                                    "unsharded tap")  # fmt: skip
            return
        if not (
            isinstance(coords, list)
            and len(coords) == len(self.shard_sizes)
            and all(is_int(c) and 0 <= c < n for c, n in zip(coords, self.shard_sizes, strict=True))
        ):
            raise ProtocolError("bad_shard", f"batch tap {number}: coordinates {coords!r:.40} "
                                f"do not fit axes of sizes {self.shard_sizes}")  # fmt: skip

    def tap_header(self, row: list[Any]) -> dict[str, Any]:
        """The full header of the tap a (checked) row describes."""
        _, tid, seq, step, device, time, coords, _, _ = row
        header = {**self.fields, "kind": "tap", "tid": tid, "seq": seq, "step": step,
                  "device": device, "time": time}  # fmt: skip
        if coords is not None:
            header["shard"] = {**self.fields["shard"], "coords": coords}
        return header


class SiteRun:
    """Consecutive taps of a `taps` message that share one static entry and one body
    frame, checked: what a batch handler gets as columns (tapd_client.TapBatch) and a
    per-tap handler as one `tap` Message each."""

    __slots__ = ("body", "rows", "static")

    def __init__(self, static: _Static, body: memoryview, rows: list[list[Any]]) -> None:
        self.static = static
        self.body = body
        self.rows = rows  # [static, tid, seq, step, device, time, coords, frame, offset]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fields(self) -> dict[str, Any]:
        """The static fields every tap of the run shares (consumer, tree, leaves, ...)."""
        return self.static.fields

    @property
    def layout(self) -> list[tuple[int, int]]:
        """Each leaf's (start, size) in bytes, from a tap's offset in `body`."""
        return self.static.layout

    def header(self, i: int) -> dict[str, Any]:
        return self.static.tap_header(self.rows[i])

    def message(self, i: int) -> Message:
        offset, body = self.rows[i][8], self.body
        frames = [body[offset + start : offset + start + n] for start, n in self.static.layout]
        return Message(self.header(i), frames, site=self.static)


def read_runs(header: dict[str, Any], payload: list[memoryview], limits: Limits) -> list[SiteRun]:
    """The taps of a decoded `taps` message, checked, as runs of one static entry and
    body frame each, in order; raises ProtocolError on any inconsistency."""
    if not payload:
        raise ProtocolError("bad_frames", "'taps' needs at least one body frame")
    rows, statics_given = header["taps"], header["statics"]
    if max(len(rows), len(statics_given), len(payload)) > limits.max_batch:
        raise ProtocolError("too_large", f"{len(rows)} taps, {len(statics_given)} statics, "
                            f"{len(payload)} bodies: more than {limits.max_batch}")  # fmt: skip
    statics = [_Static(i, static, limits) for i, static in enumerate(statics_given)]
    used = [0] * len(payload)  # per body frame: where the last tap's leaves ended
    bodies = len(payload)
    runs: list[SiteRun] = []
    run_key: tuple[int, int] | None = None
    for number, row in enumerate(rows):
        if not (type(row) is list and len(row) == ROW_LENGTH and type(row[0]) is int
                and 0 <= row[0] < len(statics)):  # fmt: skip
            raise ProtocolError("bad_field", f"batch tap {number}: {row!r:.60} is not a row")
        static = statics[row[0]]
        static.check_row(row, number)
        frame, offset = row[7], row[8]
        if not (type(frame) is int and 0 <= frame < bodies and type(offset) is int):
            raise ProtocolError("bad_frames", f"batch tap {number}: body {frame!r:.20}, "
                                f"offset {offset!r:.20} name no body frame")  # fmt: skip
        if offset < used[frame]:
            raise ProtocolError("bad_frames", f"batch tap {number}: offset {offset} overlaps "
                                f"the tap before it in body {frame}")  # fmt: skip
        if offset + static.extent > len(payload[frame]):
            raise ProtocolError("bad_frames", f"batch tap {number}: leaves overrun the "
                                f"{len(payload[frame])}-byte body {frame}")  # fmt: skip
        used[frame] = offset + static.extent
        if run_key == (row[0], frame):
            runs[-1].rows.append(row)
        else:
            run_key = (row[0], frame)
            runs.append(SiteRun(static, payload[frame], [row]))
    return runs
