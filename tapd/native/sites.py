"""The `.sites` file beside each ring: what is static about each tap site.

The emitter appends one entry per distinct tap site (consumer, tree, leaf dtypes and
shapes, static metadata, transforms, its `site` id) the first time it traces it; the
daemon reads entries as they appear to interpret ring records, which carry only the
site id (tapd/protocol/schema.py, `split_site_entries` and `check_site_entry`). The
framing is ring_format.SITE_ENTRY_LENGTH (docs/PROTOCOL.md, "Shared-memory ring").

`Site` is one entry as a reader of the ring needs it for each record: the daemon (for
its emitters' rings) and an emitter's own receiver (its local ring,
tapd/emitter/local/path.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from tapd.protocol import Message
from tapd.protocol.ring_format import SITE_ENTRY_LENGTH

if TYPE_CHECKING:
    from tapd.native.ring import Record


def encode_entry(entry: dict[str, Any]) -> bytes:
    """One entry, framed for appending to a sites file."""
    packed: bytes = msgpack.packb(entry, use_bin_type=True)
    return SITE_ENTRY_LENGTH.pack(len(packed)) + packed


class Site:
    """One tap site of an emitter's sites file, as a ring's reader needs it for each record:
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
