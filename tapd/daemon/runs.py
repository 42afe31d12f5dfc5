"""Ring records as taps: one record as a `tap` Message, or a run of them as one unit.

A native emitter in a loop writes record after record of the same tap site. Routing,
queueing and acknowledging each of those in Python is what limited small-tap
throughput, so the daemon takes consecutive small records of one site as a `TapRun`:
one unit for the router (one queue entry, one pending entry, one barrier step), sent to
a batching subscriber as a run in a `taps` message whose body is the ring span itself,
uncopied (docs/PROTOCOL.md, "taps"). Subscribers that do not batch, and the forwarder,
get its taps one by one (`TapRun.taps`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tapd.channel import COPY_BELOW
from tapd.native.ring import Record, Records
from tapd.protocol import Message
from tapd.protocol.batch import BatchRun


class Site:
    """One tap site of an emitter's sites file, as the daemon needs it for each record:
    the static header fields (with the emitter's identity), leaf sizes, shard layout."""

    def __init__(self, entry: dict[str, Any], identity: dict[str, Any]) -> None:
        self.shard: dict[str, Any] | None = entry.get("shard")
        # A sharded site's records carry one more leaf, last: the mesh coordinates.
        self.all_leaves = entry["leaves"]
        leaves = self.all_leaves[:-1] if self.shard is not None else self.all_leaves
        self.nbytes = sum(leaf[2] for leaf in leaves)
        self.leaf_bytes = [leaf[2] for leaf in self.all_leaves]  # a record's leaves
        self.coords_offset = sum((leaf[2] + 7) & ~7 for leaf in leaves)
        self.coords_count = self.all_leaves[-1][2] // 4 if self.shard is not None else 0
        self.consumer: str = entry["consumer"]
        # Its own sampling (`tap(..., every=K)`), and whether the daemon may make it
        # dormant or thin it (not `always`: id_tap's sites, an emitter with TAPD_DORMANT=0).
        every = entry.get("every", 1)
        self.every = every if type(every) is int and every >= 1 else 1
        self.always = entry.get("always") is True
        self.static = {
            "kind": "tap",
            "consumer": self.consumer,
            "transforms": entry["transforms"],
            "meta": entry["meta"],
            "tree": entry["tree"],
            "leaves": leaves,
            **identity,
        }
        if self.every != 1:  # (so that every daemon on its way thins by seq % (K * n))
            self.static["every"] = self.every

        # The static fields of a batch (protocol's statics): the layout without coords.
        self.batch_static = (
            self.static if self.shard is None else {**self.static, "shard": self.shard}
        )

    def coords(self, payload: memoryview) -> list[int]:
        array = np.frombuffer(payload, "<i4", self.coords_count, self.coords_offset)
        return [int(c) for c in array]

    def message(self, record: Record) -> Message:
        """One record as an ordinary tap message, its frames viewing the ring."""
        frames = []
        offset = 0
        for _, _, nbytes in self.static["leaves"]:
            frames.append(record.payload[offset : offset + nbytes])
            offset += (nbytes + 7) & ~7
        header = {
            **self.static,
            "seq": record.seq,
            "step": record.step,
            "device": record.device,
            "time": record.time_ns,
        }
        if self.shard is not None:
            header["shard"] = {**self.shard, "coords": self.coords(record.payload)}
        return Message(header, frames, site=self)


class TapRun:
    """Consecutive records of one site, all in `span` (the ring bytes from the first
    record's start to the last one's end): routed as one unit of `count` taps."""

    def __init__(self, site: Site, records: Records, span: memoryview, header_bytes: int) -> None:
        self.site = site
        self.records = records
        self.span = span
        self.count = len(records)
        self.consumer = site.consumer
        self.header = site.static  # what the router reads of a unit's header: its consumer
        start = records.starts[0] - header_bytes
        self.offsets = [position - start for position in records.starts]

    @property
    def last_time_ns(self) -> int:
        """When its last tap ran (the emitter's clock)."""
        return self.records.times[-1]

    def taps(self) -> list[Message]:
        return [self.site.message(record) for record in self.records]

    def tap(self, i: int) -> Message:
        return self.site.message(self.records[i])

    def batch_piece(self, first_tid: int, emitter: str) -> BatchRun:
        records = self.records
        site = self.site
        # Copied once, never sent as ring memory: the frame may sit in a ZeroMQ queue
        # after its taps were counted lost and their ring space reused, or the ring
        # unmapped. The daemon's sockets copy frames under COPY_BELOW themselves.
        span = self.span
        return BatchRun(
            site.batch_static,
            span if len(span) < COPY_BELOW else bytes(span),
            self.offsets,
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
