"""Ring records in bulk: read as columns (tapd/native/record_columns.py) and sent as
columnar runs (docs/PROTOCOL.md, "taps"), the same taps as rows and records one by one.

The end-to-end paths (order, counts, barriers, drops, a daemon restart) run through
these columns in tests/test_batching.py, test_restart_counts.py, test_ring_counts.py
and test_shm_subscribers.py: the subscriber library says `columns`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tapd.errors import ProtocolError
from tapd.native.library import unavailable_reason
from tapd.protocol import decode
from tapd.protocol.batch import BatchRun, encode_batch
from tapd.protocol.message import MAGIC
from tapd.protocol.ring_format import NO_STEP

STATIC: dict[str, Any] = {
    "consumer": "x", "process": 0, "host": "h", "pid": 1, "transforms": [], "meta": {},
    "tree": ["*"], "leaves": [["int32", [2], 8]],
}  # fmt: skip


def run_of(count: int, steps: list[Any], stride: int = 56, first_tid: int = 10) -> BatchRun:
    """`count` int32[2] taps (i, 10 i) laid out `stride` bytes apart after a 48-byte gap."""
    body = bytearray(48 + stride * count)
    offsets = []
    for i in range(count):
        offset = 48 + stride * i
        body[offset : offset + 8] = np.array([i, 10 * i], np.int32).tobytes()
        offsets.append(offset)
    return BatchRun(STATIC, bytes(body), offsets, first_tid, "h:1", "site",
                    seqs=[100 + i for i in range(count)], steps=steps,
                    devices=[i % 3 for i in range(count)],
                    times=[1_700_000_000_000_000_000 + i for i in range(count)])  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize(
    "steps",
    [[5, 6, 7, 8], [None] * 4, [5, None, 7, None]],
    ids=["steps", "no-steps", "some-steps"],
)
def test_a_columnar_run_decodes_to_the_same_taps_as_its_rows(steps: list[Any]) -> None:
    rows = decode(encode_batch([run_of(4, steps)]))
    runs = decode(encode_batch([run_of(4, steps)], columns=True))
    assert rows.header["taps"] and not rows.header.get("runs")
    assert runs.header["taps"] == [] and len(runs.header["runs"]) == 1
    assert (runs.header["runs"][0][6] is None) == (steps == [None] * 4)  # nil: no steps
    (run,) = runs.runs
    assert run.columns is not None and len(run) == 4 and run.last_tid == 13
    # Rows made from the columns, as the wire's rows (but for the body frame's number:
    # the rows' message keeps frame 0 for single taps).
    assert [r[:7] + r[8:] for r in run.rows] == [r[:7] + r[8:] for r in rows.runs[0].rows]
    assert [t.header for t in runs.batch] == [t.header for t in rows.batch]
    assert [t.value().tolist() for t in runs.batch] == [[i, 10 * i] for i in range(4)]
    tids, seqs, got_steps, devices, _, coords = run.column_lists()
    assert list(tids) == [10, 11, 12, 13] and seqs == [100, 101, 102, 103]
    assert got_steps == steps and devices == [0, 1, 2, 0] and coords == [None] * 4
    stacked = run.leaves()[0]
    assert stacked.shape == (4, 2) and not stacked.flags.writeable  # a view of the body
    assert stacked.base is not None


@pytest.mark.fast
def test_runs_and_single_taps_never_share_a_message() -> None:
    """A message holds rows or runs: where a piece cannot be a columnar run (a single
    tap, a sharded site), the whole message goes as rows."""
    from tapd.protocol.batch import BatchTap

    single = BatchTap({**STATIC, "seq": 1, "step": None, "device": None, "time": 5},
                      [np.zeros(2, np.int32).tobytes()], 9, "h:1", "site")  # fmt: skip
    mixed = decode(encode_batch([single, run_of(3, [1, 2, 3])], columns=True))
    assert not mixed.header.get("runs") and len(mixed.header["taps"]) == 4
    assert [t.header["tid"] for t in mixed.batch] == [9, 10, 11, 12]


def tamper(frames: list[Any], change: Any) -> list[Any]:
    header = msgpack.unpackb(frames[1], raw=False)
    change(header)
    return [MAGIC, msgpack.packb(header, use_bin_type=True), *frames[2:]]


def _set_run(field: int, value: Any) -> Any:
    def change(header: dict[str, Any]) -> None:
        header["runs"][0][field] = value

    return change


@pytest.mark.fast
@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (_set_run(3, 0), "bad_field"),  # no taps
        (_set_run(3, 5), "bad_field"),  # a count its columns do not hold
        (_set_run(5, b"\0" * 8), "bad_field"),  # a short column
        (_set_run(1, 3), "bad_field"),  # no such body frame
        (_set_run(0, 1), "bad_field"),  # no such static
        (_set_run(4, np.array([48, 50, 104, 160], "<i8").tobytes()), "bad_frames"),  # overlap
        (_set_run(4, np.array([48, 104, 160, 270], "<i8").tobytes()), "bad_frames"),  # overrun
        (_set_run(4, np.array([-8, 104, 160, 216], "<i8").tobytes()), "bad_frames"),
        (lambda h: h["taps"].append([0] * 9), "bad_field"),  # rows beside runs
        (lambda h: h.update(runs=[h["runs"][0][:8]]), "bad_field"),
    ],
    ids=[
        "empty",
        "count",
        "short",
        "frame",
        "static",
        "overlap",
        "overrun",
        "negative",
        "rows-and-runs",
        "short-entry",
    ],
)
def test_a_malformed_columnar_run_is_refused(change: Any, reason: str) -> None:
    frames = encode_batch([run_of(4, [1, 2, 3, 4])], columns=True)
    decode(frames)  # (untampered: fine)
    with pytest.raises(ProtocolError) as caught:
        decode(tamper(frames, change))
    assert caught.value.reason == reason


@pytest.mark.fast
@pytest.mark.skipif(unavailable_reason() is not None, reason="needs tapd's native library")
def test_ring_records_read_as_columns_are_the_records_read_one_by_one(tmp_path: Path) -> None:
    """`read_columns` (the daemon's) and `read_span` (record by record) read the same
    records: a long uniform stretch at once, then records of other lengths, an abandoned
    one, and steps of every kind one by one."""
    from tapd.native.record_columns import read_columns
    from tapd.native.ring import Ring

    ring = Ring.create(tmp_path / "1-ab.ring", 1 << 16)
    for i in range(40):  # uniform: read from their headers at once
        ring.write(1, np.array([i, i], np.int32).tobytes(), step=i)
    ring.write(2, bytes(24), consumer=1, device=1)  # another length, no step
    held = ring.reserve_for_test(1, bytes(8), step=7)
    assert held is not None
    ring.abandon_for_test(held)  # never committed: skipped
    for i in range(3):
        ring.write(1, bytes(8), step=None if i % 2 else -5)
    position, seen = 0, []
    while True:
        span, columns = read_columns(ring, position, 4096)
        if not len(columns):
            break
        _, records = ring.read_span(position, len(columns))
        assert columns.records() == list(records)
        assert len(span) >= int(columns.ends[-1]) - position
        seen.extend(columns.records())
        position = int(columns.ends[-1])
    assert len(seen) == 44 and [r.step for r in seen][:40] == list(range(40))
    assert [r.step for r in seen][40:] == [None, -5, None, -5]
    assert [r.site for r in seen] == [1] * 40 + [2] + [1] * 3
    assert [r.device for r in seen][40] == 1 and NO_STEP not in [r.step for r in seen]
    ring.close()


@pytest.mark.fast
@pytest.mark.parametrize("gap", [0, 56], ids=["back-to-back", "a-record-between"])
def test_a_run_s_body_is_its_leaves_alone_where_its_records_lie_back_to_back(gap: int) -> None:
    """The daemon sends a run's leaves without the 48-byte record headers between them
    where its records lie back to back (a scalar's record is mostly header), else the
    ring span as it is: the subscriber gets the same taps either way."""
    from tapd.daemon.runs import TapRun
    from tapd.native.ring import Records
    from tapd.native.sites import Site

    entry = {key: STATIC[key] for key in ("consumer", "transforms", "meta", "tree", "leaves")}
    site = Site(entry, {"process": 0, "host": "h", "pid": 1})
    chunks, starts, position = [], [], 0
    for i in range(5):
        if i == 3:  # (an abandoned record's bytes, skipped by the reader)
            chunks.append(bytes(gap))
            position += gap
        chunks.append(bytes(48) + np.array([i, 10 * i], np.int32).tobytes())
        starts.append(position)
        position += 56
    span = memoryview(b"".join(chunks))
    records = Records(span, 0, header_bytes=48)
    for i, start in enumerate(starts):
        records.append(start, start + 56, 0, 100 + i, i, 7, 0)
    piece = TapRun(site, records, span).batch_piece(0, "h:1")
    if gap:
        assert bytes(piece.body) == bytes(span) and list(piece.offsets) == [48, 104, 160, 272, 328]
    else:
        assert len(piece.body) == 5 * 8 and list(piece.offsets) == [0, 8, 16, 24, 32]
    message = decode(encode_batch([piece], columns=True))
    assert [t.value().tolist() for t in message.batch] == [[i, 10 * i] for i in range(5)]
    assert [t.header["seq"] for t in message.batch] == [100, 101, 102, 103, 104]
    (run,) = message.runs
    # (back to back: the stacked leaf views the body, contiguous; else a gathered copy)
    stacked = run.leaves()[0]
    assert np.shares_memory(stacked, np.frombuffer(run.body, np.uint8)) == (not gap)
