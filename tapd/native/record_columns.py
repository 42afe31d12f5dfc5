"""Ring records as numpy columns, for the daemon (`Ring.read_columns`).

`Records` (tapd/native/ring.py) keeps its columns as Python lists, one int per record
per field: what the emitter's local path reads a record at a time. The daemon routes
runs of thousands of small records by their columns and sends those columns on as
they are (docs/PROTOCOL.md, "taps", columnar runs), so here they stay numpy arrays
from the ring headers on: no Python object is made per record unless one record is
asked for (`record`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tapd.native.ring import Record, Records, Ring
from tapd.protocol.ring_format import FLAG_STEP32, NO_STEP


class RecordColumns:
    """Records read from a ring, in ring order, each field an array: ring positions
    (`starts`, `ends`: int64), `sites` and `seqs` (uint64), `steps` (int64, NO_STEP
    for none), `times` (int64, ns) and `devices` (int64)."""

    __slots__ = (
        "devices",
        "ends",
        "header_bytes",
        "position",
        "seqs",
        "sites",
        "starts",
        "steps",
        "times",
        "view",
    )

    def __init__(self, view: memoryview, position: int, header_bytes: int, **columns: Any) -> None:
        self.view = view  # the ring bytes from `position` on
        self.position = position
        self.header_bytes = header_bytes
        self.starts: np.ndarray = columns["starts"]
        self.ends: np.ndarray = columns["ends"]
        self.sites: np.ndarray = columns["sites"]
        self.seqs: np.ndarray = columns["seqs"]
        self.steps: np.ndarray = columns["steps"]
        self.times: np.ndarray = columns["times"]
        self.devices: np.ndarray = columns["devices"]

    @classmethod
    def of_records(cls, records: Records) -> RecordColumns:
        """The same records, read one by one (list columns), as arrays."""
        steps = [NO_STEP if step is None else step for step in records.steps]
        return cls(
            records.view,
            records.position,
            records.header_bytes,
            starts=np.array(records.starts, np.int64),
            ends=np.array(records.ends, np.int64),
            sites=np.array(records.sites, np.uint64),
            seqs=np.array(records.seqs, np.uint64),
            steps=np.array(steps, np.int64),
            times=np.array(records.times, np.int64),
            devices=np.array(records.devices, np.int64),
        )

    def __len__(self) -> int:
        return len(self.starts)

    def part(self, first: int, end: int) -> RecordColumns:
        """Records [first, end): views of these columns, nothing copied."""
        return RecordColumns(
            self.view,
            self.position,
            self.header_bytes,
            starts=self.starts[first:end],
            ends=self.ends[first:end],
            sites=self.sites[first:end],
            seqs=self.seqs[first:end],
            steps=self.steps[first:end],
            times=self.times[first:end],
            devices=self.devices[first:end],
        )

    def payload(self, i: int) -> memoryview:
        """Record i's leaves, each padded to 8 bytes (a view of the ring)."""
        start = int(self.starts[i]) - self.position + self.header_bytes
        return self.view[start : int(self.ends[i]) - self.position]

    def record(self, i: int) -> Record:
        """Record i, its fields Python ints (step None where it has none)."""
        step = int(self.steps[i])
        return Record(
            int(self.starts[i]),
            int(self.ends[i]),
            int(self.sites[i]),
            int(self.seqs[i]),
            None if step == NO_STEP else step,
            int(self.times[i]),
            int(self.devices[i]),
            self.payload(i),
        )

    def records(self) -> list[Record]:
        return [self.record(i) for i in range(len(self))]

    def step_list(self) -> list[int | None]:
        """The steps as Python values, None where a record has none."""
        steps = self.steps
        if not len(steps):
            return []
        no_step = steps == NO_STEP
        if no_step.all():
            return [None] * len(steps)
        values: list[int | None] = steps.tolist()
        if no_step.any():
            values = [None if step == NO_STEP else step for step in values]
        return values


_NONE = RecordColumns.of_records(Records.empty())  # (nothing readable: the common answer)

# Fewer uniform records than this at the read position: read them one by one
# (`Ring.read_span`), which also checks and reports what is not a committed record.
_UNIFORM_FROM = 8


def read_columns(ring: Ring, position: int, max_records: int) -> tuple[memoryview, RecordColumns]:
    """Committed records from `position` on, as columns, with a view of the ring bytes
    from `position` on (`Ring.read_span`'s, read without a Python object per record):
    the leading records as long as the first, read from their headers at once; where
    those are few (records of other lengths between, abandoned ones), what
    `Ring.read_span` reads one by one."""
    view = ring.readable(position)
    if view is None:
        return memoryview(b""), _NONE
    uniform = ring.uniform_headers(view, position, max_records, _UNIFORM_FROM)
    if uniform is None:
        span, records = ring.read_span(position, max_records)
        return span, RecordColumns.of_records(records)
    headers, starts, length = uniform
    steps = headers["step"].astype(np.int64)
    step32 = (headers["flags"] & FLAG_STEP32) != 0
    if step32.any():  # committed by a CUDA stream: an int32 step, to sign-extend
        low = (steps & 0xFFFFFFFF).astype(np.uint32).view(np.int32).astype(np.int64)
        steps = np.where(step32, low, steps)
    columns = RecordColumns(
        view,
        position,
        ring.header_bytes,
        starts=starts,
        ends=starts + length,
        sites=headers["site"].astype(np.uint64),
        seqs=headers["seq"].astype(np.uint64),
        steps=steps,
        times=headers["time_ns"].astype(np.int64),
        devices=headers["device"].astype(np.int64),
    )
    return view, columns
