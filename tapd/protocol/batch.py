"""`taps` messages: many small taps, daemon to subscriber, in one message.

A tap's header is mostly the same from one tap of a site to the next: consumer,
emitter, tree, leaves, transforms, metadata. A batch sends those *static* fields once
(`statics`) and each tap as a short row of what changes: its static's index, delivery
id, sequence number, step, device, time and shard coordinates, and where its leaves
start: a body frame and an offset in it, each leaf then padded to 8 bytes
(docs/PROTOCOL.md, "taps"). Bytes between taps are ignored, so a daemon can send a span
of ring records as a body as it is, record headers and all, copying nothing.

`encode_batch` makes such a message; `read_runs` reads one (for `decode`, wire.py),
checking it through schema.py. It copies only small single taps (into body frame 0, so
that one frame carries them all); a single tap of one leaf from `OWN_FRAME_BYTES` up,
and every run's body, go out as body frames of their own, as they are.

A `ring_taps` message is the same rows for taps whose bytes a same-host subscriber
reads from the emitters' rings itself: each row names a ring (an index into `rings`,
the ring files' names) and the ring position where the tap's leaves start, instead of
a body frame and an offset, and the message has no body frames. `encode_ring_batch`
makes one from `RingPiece`s; `read_spans` reads one, as spans of one static entry that
lie close together in one ring (`RingSpan`), which the subscriber reads in one go each
(tapd_client/shm.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import msgpack
import numpy as np

from tapd.errors import ProtocolError
from tapd.protocol.message import (
    MAGIC,
    Frame,
    RingSpan,
    RunColumns,
    SiteRun,
    StaticEntry,
    encode_header,
)
from tapd.protocol.ring_format import NO_STEP
from tapd.protocol.rules import U64_MAX, Limits
from tapd.protocol.schema import PER_TAP, RING_NAME, check_batch_row, check_batch_static

# SiteRun lives in message.py (a decoded `taps` message holds its runs); the subscriber
# library names it from here, with the rest of the batch.
__all__ = [
    "BatchRun",
    "BatchTap",
    "RingPiece",
    "RingSpan",
    "SiteRun",
    "encode_batch",
    "encode_ring_batch",
    "read_runs",
    "read_spans",
]

_NOT_STATIC = frozenset((*PER_TAP, "kind", "shard"))
# A single tap of one leaf this large (and padded already: a multiple of 8 bytes) is a
# body frame of its own: a frame costs less than copying it into the shared one.
OWN_FRAME_BYTES = 8 * 1024
# Taps of one static entry in one ring, this close or closer (the bytes between one
# tap's leaves and the next one's start: a record header, other sites' records), make
# one span, which a subscriber reads in one go, gap and all.
SPAN_GAP_BYTES = 4096
# ... while the span stays within this many bytes (a larger tap is a span of its own):
# a subscriber's copy of a span lives as long as any value of it a handler keeps.
SPAN_BYTES = 1024 * 1024


# A run's per-tap field: a list, or an array (a ring's columns: tapd/daemon/runs.py,
# steps NO_STEP where a tap has none).
Column = Sequence[Any] | np.ndarray


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
    offsets: Column
    first_tid: int
    emitter: str
    site: Hashable
    seqs: Column
    steps: Column
    devices: Column
    times: Column
    coords: Sequence[list[int]] | None = None


def _static_of(header: Mapping[str, Any], emitter: str) -> dict[str, Any]:
    static = {k: v for k, v in header.items() if k not in _NOT_STATIC}
    static["emitter"] = emitter
    shard = header.get("shard")
    if shard is not None:
        static["shard"] = {k: v for k, v in shard.items() if k != "coords"}
    return static


class _Statics:
    """A batch's static entries, each once: by site token (and emitter) where there is
    one, else by the packed fields."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._index_of: dict[Hashable, int] = {}

    def index(self, site: Hashable | None, header: Mapping[str, Any], emitter: str) -> int:
        key: Hashable = (site, emitter)
        index = self._index_of.get(key) if site is not None else None
        if index is None:
            static = _static_of(header, emitter)
            if site is None:
                key = msgpack.packb(static, use_bin_type=True)
                index = self._index_of.get(key)
            if index is None:
                index = self._index_of[key] = len(self.entries)
                self.entries.append(static)
        return index


def encode_batch(
    pieces: Sequence[BatchTap | BatchRun], *, columns: bool = False
) -> list[Frame | bytearray]:
    """The frames of one `taps` message carrying `pieces`' taps, in order: small single
    taps' arrays copied into the first body frame, each run's body and each large
    one-leaf tap's array as a frame of its own, uncopied. `columns` (the subscriber
    decodes them): where every piece is a run that can be, the runs go as columnar
    runs, a few bytes strings each rather than a row per tap."""
    if columns and pieces:
        entries = [_columnar(piece) for piece in pieces]
        if all(entry is not None for entry in entries):
            runs = cast("list[BatchRun]", pieces)
            return _encode_columnar(runs, cast("list[list[bytes]]", entries))
    statics = _Statics()
    static_index = statics.index
    rows: list[Sequence[Any]] = []  # (msgpack packs tuples and lists alike, as arrays)
    shared = bytearray()
    bodies: list[Frame | bytearray] = [shared]  # frame 0: small single taps' arrays, copied
    for piece in pieces:
        if isinstance(piece, BatchRun):
            index = static_index(piece.site, piece.header, piece.emitter)
            rows.extend(_run_rows(index, piece, len(bodies), piece.offsets))
            bodies.append(piece.body)
            continue
        header = piece.header
        shard = header.get("shard")
        frames = piece.frames
        if len(frames) == 1 and len(frames[0]) >= OWN_FRAME_BYTES and not len(frames[0]) % 8:
            frame, offset = len(bodies), 0
            bodies.append(frames[0])
        else:
            frame, offset = 0, len(shared)
            for array in frames:
                shared += array
                shared += bytes(-len(array) % 8)
        rows.append(
            [
                static_index(piece.site, header, piece.emitter),
                piece.tid,
                header["seq"],
                header["step"],
                header["device"],
                header["time"],
                None if shard is None else shard["coords"],
                frame,
                offset,
            ]
        )
    header_bytes = encode_header({"kind": "taps", "statics": statics.entries, "taps": rows})
    return [MAGIC, header_bytes, *bodies]


class RingPiece(NamedTuple):
    """Taps of one site whose leaves lie in an emitter's ring file `ring` (its name), tap
    i's from ring position `positions[i]` on; `header` holds the site's static fields,
    the columns the rest (as in `BatchRun`)."""

    header: Mapping[str, Any]
    ring: str
    positions: Sequence[int]
    first_tid: int
    emitter: str
    site: Hashable
    seqs: Column
    steps: Column
    devices: Column
    times: Column
    coords: Sequence[list[int]] | None = None


def encode_ring_batch(pieces: Sequence[RingPiece]) -> list[Frame]:
    """The frames of one `ring_taps` message describing `pieces`' taps, in order: the
    header only (no bytes travel)."""
    statics = _Statics()
    rings: list[str] = []
    ring_index: dict[str, int] = {}
    rows: list[Sequence[Any]] = []
    for piece in pieces:
        index = statics.index(piece.site, piece.header, piece.emitter)
        ring = ring_index.get(piece.ring)
        if ring is None:
            ring = ring_index[piece.ring] = len(rings)
            rings.append(piece.ring)
        rows.extend(_run_rows(index, piece, ring, piece.positions))
    header = {"kind": "ring_taps", "statics": statics.entries, "rings": rings, "taps": rows}
    return [MAGIC, encode_header(header)]


def _run_rows(
    static: int, piece: BatchRun | RingPiece, where: int, offsets: Column
) -> Iterable[tuple[Any, ...]]:
    """The wire rows of a run of one site's taps: the statics' index, tid, seq, step,
    device, time, coords, then where each tap's bytes are (a body frame of `taps`, a
    ring of `ring_taps`) and from which offset. Column by column, zipped in C: a run is
    thousands of small taps. (Columns may be arrays, a ring's: made Python ints here,
    a step of NO_STEP None.)"""
    count = len(offsets)
    coords: Iterable[list[int] | None] = piece.coords or itertools.repeat(None, count)
    return zip(
        itertools.repeat(static, count),
        range(piece.first_tid, piece.first_tid + count),
        _listed(piece.seqs),
        _steps_listed(piece.steps),
        _listed(piece.devices),
        _listed(piece.times),
        coords,
        itertools.repeat(where, count),
        _listed(offsets),
        strict=True,
    )


def _listed(column: Column) -> Sequence[Any]:
    return column.tolist() if isinstance(column, np.ndarray) else column


def _steps_listed(steps: Column) -> Sequence[int | None]:
    if not isinstance(steps, np.ndarray):
        return steps
    values: list[int | None] = steps.tolist()
    if (steps == NO_STEP).any():
        values = [None if step == NO_STEP else step for step in values]
    return values


# ---- columnar runs (docs/PROTOCOL.md, "taps") ------------------------------------------
# A run entry: [static, body frame, first tid, count, offsets, seqs, steps, devices,
# times], each column the little-endian bytes of `count` int64 (seqs: uint64; steps: nil
# where no tap has a step, else NO_STEP for one that has none).
RUN_ENTRY_LENGTH = 9
_I8 = np.dtype("<i8")
_U8 = np.dtype("<u8")


def _column_bytes(values: Column, dtype: np.dtype[Any]) -> bytes | None:
    """`values` as the bytes of a wire column, or None where they cannot be (None
    among them, out of range)."""
    if isinstance(values, np.ndarray):  # (a ring's columns: int64 and uint64)
        return values.astype(dtype, copy=False).tobytes()
    try:
        return np.array(values, dtype=dtype).tobytes()
    except (TypeError, ValueError, OverflowError):
        return None


def _columnar(piece: BatchTap | BatchRun) -> list[Any] | None:
    """A run's columns as a run entry's (its static index and frame left to fill in);
    None for a single tap, a sharded run (its coordinates go in rows), or columns
    that do not fit."""
    if not isinstance(piece, BatchRun) or piece.coords is not None:
        return None
    steps = piece.steps
    if not isinstance(steps, np.ndarray):
        steps = [NO_STEP if step is None else step for step in steps]
    steps_bytes = _column_bytes(steps, _I8)
    if steps_bytes is not None and (np.frombuffer(steps_bytes, _I8) == NO_STEP).all():
        steps_bytes = b""  # (nil on the wire)
    entry = [
        _column_bytes(piece.offsets, _I8),
        _column_bytes(piece.seqs, _U8),
        steps_bytes,
        _column_bytes(piece.devices, _I8),
        _column_bytes(piece.times, _I8),
    ]
    return None if any(column is None for column in entry) else entry


def _encode_columnar(pieces: list[BatchRun], entries: list[list[bytes]]) -> list[Frame | bytearray]:
    statics = _Statics()
    runs = []
    bodies: list[Frame | bytearray] = []
    for piece, (offsets, seqs, steps, devices, times) in zip(pieces, entries, strict=True):
        index = statics.index(piece.site, piece.header, piece.emitter)
        count = len(piece.offsets)
        runs.append(
            [index, len(bodies), piece.first_tid, count, offsets, seqs, steps or None,
             devices, times]
        )  # fmt: skip
        bodies.append(piece.body)
    header = {"kind": "taps", "statics": statics.entries, "taps": [], "runs": runs}
    return [MAGIC, encode_header(header), *bodies]


def read_runs(header: dict[str, Any], payload: list[memoryview], limits: Limits) -> list[SiteRun]:
    """The taps of a decoded `taps` message, checked, as runs of one static entry and
    body frame each, in order; raises ProtocolError on any inconsistency."""
    if not payload:
        raise ProtocolError("bad_frames", "'taps' needs at least one body frame")
    if header.get("runs"):
        return _read_columnar(header, payload, limits)
    rows, statics_given = header["taps"], header["statics"]
    if max(len(rows), len(statics_given), len(payload)) > limits.max_batch:
        raise ProtocolError(
            "too_large",
            f"{len(rows)} taps, {len(statics_given)} statics, {len(payload)} bodies: "
            f"more than {limits.max_batch}",
        )
    statics = [
        StaticEntry(static, check_batch_static(i, static, limits))
        for i, static in enumerate(statics_given)
    ]
    shard_sizes = [static.shard_sizes for static in statics]
    used = [0] * len(payload)  # per body frame: where the last tap's leaves ended
    bodies = len(payload)
    runs: list[SiteRun] = []
    run_key: tuple[int, int] | None = None
    for number, row in enumerate(rows):
        check_batch_row(row, number, shard_sizes)
        static = statics[row[0]]
        frame, offset = row[7], row[8]
        if not (type(frame) is int and 0 <= frame < bodies and type(offset) is int):
            raise ProtocolError(
                "bad_frames",
                f"batch tap {number}: body {frame!r:.20}, offset {offset!r:.20} name no body frame",
            )
        if offset < used[frame]:
            raise ProtocolError(
                "bad_frames",
                f"batch tap {number}: offset {offset} overlaps the tap before it in body {frame}",
            )
        if offset + static.extent > len(payload[frame]):
            raise ProtocolError(
                "bad_frames",
                f"batch tap {number}: leaves overrun the {len(payload[frame])}-byte body {frame}",
            )
        used[frame] = offset + static.extent
        if run_key == (row[0], frame):
            runs[-1].rows.append(row)
        else:
            run_key = (row[0], frame)
            runs.append(SiteRun(static, payload[frame], [row]))
    return runs


def _read_columnar(
    header: dict[str, Any], payload: list[memoryview], limits: Limits
) -> list[SiteRun]:
    """The columnar runs of a decoded `taps` message, checked as rows are (each check
    made on a whole column at once)."""
    runs_given, statics_given = header["runs"], header["statics"]
    if header["taps"]:
        raise ProtocolError("bad_field", "a 'taps' message has both rows and runs")
    if max(len(runs_given), len(statics_given), len(payload)) > limits.max_batch:
        raise ProtocolError("too_large", f"{len(runs_given)} runs: more than {limits.max_batch}")
    statics = [
        StaticEntry(static, check_batch_static(i, static, limits))
        for i, static in enumerate(statics_given)
    ]
    used = [0] * len(payload)  # per body frame: where the last tap's leaves ended
    runs: list[SiteRun] = []
    total = 0
    for number, entry in enumerate(runs_given):
        where = f"batch run {number}"
        if not (
            type(entry) is list
            and len(entry) == RUN_ENTRY_LENGTH
            and all(type(field) is int for field in entry[:4])
            and 0 <= entry[0] < len(statics)
            and 0 <= entry[1] < len(payload)
            and 0 <= entry[2] <= U64_MAX
            and 0 < entry[3] <= limits.max_batch
        ):
            raise ProtocolError("bad_field", f"{where}: {entry!r:.60} is not a run")
        static_index, frame, first_tid, count = entry[:4]
        static = statics[static_index]
        if static.shard_sizes is not None:
            raise ProtocolError("bad_shard", f"{where}: a sharded site's taps come in rows")
        total += count
        if total > limits.max_batch:
            raise ProtocolError("too_large", f"more than {limits.max_batch} taps in runs")
        offsets, seqs, devices, times = (
            _wire_column(entry[i], count, dtype, where)
            for i, dtype in ((4, _I8), (5, _U8), (7, _I8), (8, _I8))
        )
        steps = None if entry[6] is None else _wire_column(entry[6], count, _I8, where)
        body = payload[frame]
        gaps = np.diff(offsets)
        if offsets[0] < used[frame] or (count > 1 and int(gaps.min()) < static.extent):
            raise ProtocolError("bad_frames", f"{where}: a tap's leaves overlap another's")
        end = int(offsets[-1]) + static.extent
        if end > len(body):
            raise ProtocolError(
                "bad_frames", f"{where}: leaves overrun the {len(body)}-byte body {frame}"
            )
        used[frame] = end
        columns = RunColumns(first_tid, offsets, seqs, steps, devices, times)
        runs.append(SiteRun(static, body, columns=columns, place=(static_index, frame)))
    return runs


def _wire_column(raw: Any, count: int, dtype: np.dtype[Any], where: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) != count * dtype.itemsize:
        raise ProtocolError("bad_field", f"{where}: a column is not {count} {dtype} values")
    return np.frombuffer(raw, dtype)


def read_spans(header: dict[str, Any], payload: list[memoryview], limits: Limits) -> list[RingSpan]:
    """The taps of a decoded `ring_taps` message, checked, as spans of one static entry
    and one ring each, in order; raises ProtocolError on any inconsistency. Each row's
    offset (its last field) is rewritten to count from its span's start."""
    if payload:
        raise ProtocolError("bad_frames", f"'ring_taps' message has {len(payload)} body frames")
    rows, statics_given, rings = header["taps"], header["statics"], header["rings"]
    if max(len(rows), len(statics_given), len(rings)) > limits.max_batch:
        raise ProtocolError(
            "too_large",
            f"{len(rows)} taps, {len(statics_given)} statics, {len(rings)} rings: "
            f"more than {limits.max_batch}",
        )
    for number, name in enumerate(rings):
        if not isinstance(name, str) or RING_NAME.fullmatch(name) is None:
            raise ProtocolError("bad_field", f"ring {number}: {name!r:.80} is not a ring file name")
    statics = [
        StaticEntry(static, check_batch_static(i, static, limits))
        for i, static in enumerate(statics_given)
    ]
    shard_sizes = [static.shard_sizes for static in statics]
    used: dict[int, int] = {}  # per ring: where the last tap's leaves ended
    read = 0  # bytes the spans cover: what a subscriber reads
    spans: list[RingSpan] = []
    span: RingSpan | None = None
    span_key: tuple[int, int] | None = None
    for number, row in enumerate(rows):
        check_batch_row(row, number, shard_sizes)
        static = statics[row[0]]
        ring, position = row[7], row[8]
        if not (
            type(ring) is int
            and 0 <= ring < len(rings)
            and type(position) is int
            and 0 <= position <= U64_MAX - static.extent
        ):
            raise ProtocolError(
                "bad_field",
                f"ring tap {number}: ring {ring!r:.20}, position {position!r:.30} "
                "name no ring bytes",
            )
        if position < used.get(ring, 0):
            raise ProtocolError(
                "bad_field",
                f"ring tap {number}: position {position} overlaps the tap before it in ring {ring}",
            )
        end = used[ring] = position + static.extent
        row[7] = 0
        close = (
            span is not None
            and position - span.end <= SPAN_GAP_BYTES
            and end - span.start <= SPAN_BYTES
        )
        if span is not None and close and span_key == (row[0], ring):
            read += end - span.end
            row[8] = position - span.start
            span.rows.append(row)
            span.end = end
        else:
            read += static.extent
            row[8] = 0
            span_key = (row[0], ring)
            span = RingSpan(static, rings[ring], position, end, [row])
            spans.append(span)
        if read > limits.max_message_bytes:
            raise ProtocolError(
                "too_large", f"ring taps of more than {limits.max_message_bytes} bytes"
            )
    return spans
