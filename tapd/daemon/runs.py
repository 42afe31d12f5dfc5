"""Ring records as taps: a run of them as one unit (one record is a `tap` Message: its
site's, tapd/native/sites.py).

A native emitter in a loop writes record after record of the same tap site. Routing,
queueing and acknowledging each of those in Python is what limited small-tap
throughput, so the daemon takes consecutive small records of one site as a `TapRun`:
one unit for the router (one queue entry, one pending entry, one barrier step), its
records kept as columns, sent to a batching subscriber as a run in a `taps` message
(columnar where it takes that: docs/PROTOCOL.md, "taps") whose body is the records'
leaves, copied once, without the record headers between them where the records lie back
to back (else the ring span as it is). Subscribers that do not batch, and the
forwarder, get its taps one by one (`TapRun.taps`).
"""

from __future__ import annotations

import numpy as np

from tapd.channel import COPY_BELOW
from tapd.native.record_columns import RecordColumns
from tapd.native.ring import Records
from tapd.native.sites import Site
from tapd.protocol import Message
from tapd.protocol.batch import BatchRun


class TapRun:
    """Consecutive records of one site, all in `span` (the ring bytes from the first
    record's start to the last one's end): routed as one unit of `count` taps. Its
    records stay columns (`RecordColumns`): a subscriber that takes columnar runs is
    sent them as they are (`batch_piece`), and a `Record` is made only for the taps
    sent one by one (`taps`, `tap`)."""

    def __init__(
        self,
        site: Site,
        records: RecordColumns | Records,
        span: memoryview,
        header_bytes: int | None = None,
    ) -> None:
        if isinstance(records, Records):  # (read one by one: tests, the local path)
            records = RecordColumns.of_records(records)
        self.site = site
        self.records = records
        self.span = span
        self.count = len(records)
        self.consumer = site.consumer
        self.header = site.static  # what the router reads of a unit's header: its consumer
        leaves_at = records.header_bytes if header_bytes is None else header_bytes
        # Where each tap's leaves start in `span`.
        self.offsets: np.ndarray = records.starts - (int(records.starts[0]) - leaves_at)

    @property
    def last_time_ns(self) -> int:
        """When its last tap ran (the emitter's clock)."""
        return int(self.records.times[-1])

    def taps(self) -> list[Message]:
        return [self.site.message(record) for record in self.records.records()]

    def tap(self, i: int) -> Message:
        return self.site.message(self.records.record(i))

    def batch_piece(self, first_tid: int, emitter: str) -> BatchRun:
        records = self.records
        site = self.site
        # Copied once, never sent as ring memory: the frame may sit in a ZeroMQ queue
        # after its taps were counted lost and their ring space reused, or the ring
        # unmapped. The daemon's sockets copy frames under COPY_BELOW themselves.
        packed = self._packed()
        span = self.span
        body, offsets = packed or (span if len(span) < COPY_BELOW else bytes(span), self.offsets)
        return BatchRun(
            site.batch_static,
            body,
            offsets,
            first_tid,
            emitter,
            site,
            seqs=records.seqs,
            steps=records.steps,
            devices=records.devices,
            times=records.times,
            coords=None
            if site.shard is None
            else [site.coords(records.payload(i)) for i in range(self.count)],
        )

    def _packed(self) -> tuple[bytes, np.ndarray] | None:
        """The run's leaves without the record headers between them, copied into one
        body (offsets 0, extent, 2 extent, ...), where its records lie back to back:
        a small tap's record is mostly header (48 bytes before a scalar's 8), so the
        message, the socket and the subscriber carry a fraction of the span's bytes, and
        a batch's stacked leaves are contiguous. None where records do not lie back to
        back (an abandoned record between two), or hold no leaves: the span as it is."""
        records = self.records
        starts = records.starts
        length = int(records.ends[0] - starts[0])
        extent = length - records.header_bytes
        count = self.count
        if extent <= 0 or int(starts[-1] - starts[0]) != (count - 1) * length:
            return None
        grid = np.lib.stride_tricks.as_strided(
            np.frombuffer(self.span, np.uint8)[int(self.offsets[0]) :],
            shape=(count, extent),
            strides=(length, 1),
            writeable=False,
        )
        return grid.tobytes(), np.arange(count, dtype=np.int64) * extent
