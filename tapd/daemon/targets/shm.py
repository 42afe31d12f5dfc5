"""Same-host subscribers that read large ring taps where they already lie: in the
emitter's shared-memory ring (docs/PROTOCOL.md, "ring_tap").

A subscriber whose hello offers to read rings (`rings`: this boot of this host, its uid,
and the device and inode of the ring directory it sees beside its ipc socket) and whose
offer matches this daemon's gets a `ring_tap` for each tap of at least `SHM_MIN_BYTES`
read from a ring: the tap's header, the ring's file name and each leaf's ring position,
no bytes; or, where its offer says it reads them (`batch`), the descriptors of many such
taps in one `ring_taps` message (a row each, as in a `taps` message), so that the daemon
pays a message per batch rather than per tap. Everything else is as for any socket
subscriber (a mode of it, this subclass):
routing, window, queue bound, acknowledgements, and a dead subscriber's taps counted
lost. The ring space stays held as for every ring tap: released only once the unit is
finished (tapd/daemon/ledger.py, `advance`; tapd/daemon/ring_source.py, `release_delivered`),
so never before this subscriber acknowledged it or was counted gone.

Where it does not apply, the tap goes over the socket as before, decided per tap: small
taps (batched), taps that did not come from a ring (forwarded ones, a spool's copies),
and every tap of a worker pool's member. Under the spool and drop_newest policies, or
with TAPD_SHM_SUBSCRIBERS=0, the daemon makes no ring subscribers at all (`for_daemon`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Hashable
from typing import Any, Protocol

import numpy as np

from tapd.daemon.deliveries import Delivery, PeerKey
from tapd.daemon.runs import TapRun
from tapd.daemon.subscriptions import Hello
from tapd.daemon.targets.base import IN_FLIGHT_BYTES, Terms
from tapd.daemon.targets.socket import BATCH_BYTES, BATCH_HEADER_BYTES, SocketSubscriber
from tapd.native.sites import Site
from tapd.protocol import MAGIC, Message
from tapd.protocol.batch import RingPiece, encode_ring_batch
from tapd.protocol.message import encode_header
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd.runtime import boot_id
from tapd.settings import SHM_SUBSCRIBERS

# Smaller taps go to subscribers in batches (tapd/daemon/targets/socket.py): one message
# for many, where a descriptor each would cost more than their bytes.
SHM_MIN_BYTES = BATCH_BYTES
# The most ring bytes one `ring_taps` message describes (past its first unit): what
# the subscriber copies, into one buffer, before it acknowledges them. Fewer messages
# cost the daemon less; a larger buffer lives as long as any value of it a handler keeps.
RING_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_BATCH = DEFAULT_LIMITS.max_batch


class _Rings(Protocol):
    """What of tapd/daemon/rings.py's RingSet this module reads (by name: rings.py
    imports the router, which imports this)."""

    directory: Any
    sources: Any  # by emitter key: RingSource (its `ring`, `path` and `read_position`)


class RingReaders:
    """The daemon's side: whether a subscriber's offer holds, and where a tap lies."""

    def __init__(self, rings: _Rings) -> None:
        self._rings = rings

    @classmethod
    def for_daemon(cls, rings: _Rings, policy: str) -> RingReaders | None:
        """None where no subscriber reads rings: no ring directory (tcp only), a policy
        other than block (spool releases ring space once a tap is on disk; drop_newest
        keeps the socket path), or TAPD_SHM_SUBSCRIBERS=0."""
        if rings.directory is None or policy != "block" or not SHM_SUBSCRIBERS.value():
            return None
        return cls(rings)

    def identity(self) -> dict[str, Any] | None:
        """What a subscriber's `rings` offer must say, exactly."""
        boot = boot_id()
        try:
            info = os.stat(self._rings.directory)
        except (OSError, TypeError):
            return None
        if boot is None:
            return None
        return {"boot": boot, "uid": os.getuid(), "dir": [info.st_dev, info.st_ino]}

    def accepts(self, header: dict[str, Any]) -> bool:
        """Whether a subscriber's hello offers to read rings and runs where it can read
        this daemon's: same boot of the same host, same user, the same directory."""
        offer = header.get("rings")
        if not isinstance(offer, dict):
            return False
        mine = self.identity()
        return mine is not None and {k: offer.get(k) for k in mine} == mine

    def place(self, delivery: Delivery) -> tuple[str, list[int]] | None:
        """Where a subscriber reads `delivery`'s taps: the ring file's name and the ring
        position of each tap's leaves; None where it does not (taps smaller than
        SHM_MIN_BYTES, bytes that are copies or that do not lie in the emitter's ring)."""
        if delivery.copied or delivery.nbytes < SHM_MIN_BYTES * delivery.count:
            return None
        unit = delivery.tap
        if not isinstance(unit, TapRun):
            found = self.locate(delivery.emitter.key, unit)
            return None if found is None else (found[0], found[1][:1])
        source = self._rings.sources.get(delivery.emitter.key)
        if source is None or not source.ring.maps(unit.span.obj):
            return None  # not a view of this emitter's ring now (a replaced ring's, say)
        leaves = unit.offsets[0]  # (the span starts at the first record's header)
        return source.path.name, (unit.records.starts + int(leaves)).tolist()

    def locate(self, key: Hashable, tap: Message) -> tuple[str, list[int]] | None:
        """The ring file name and each leaf's ring position of `tap`, a tap of emitter
        `key`, if its frames view that emitter's ring; else None (socket path)."""
        source = self._rings.sources.get(key)
        if source is None or tap.site is None or not tap.frames:
            return None
        first = tap.frames[0]
        owner = first.obj if isinstance(first, memoryview) else None
        if not isinstance(owner, ctypes.Array) or not source.ring.maps(owner):
            return None  # not a view of this emitter's ring now (a replaced ring's, say)
        base, size = ctypes.addressof(owner), ctypes.sizeof(owner)
        capacity = size // 2  # (the record area, mapped twice: Ring.read_span)
        address = np.frombuffer(first, np.uint8).ctypes.data
        if not base <= address < base + size:
            return None
        # The record was read and is unreleased (its unit is pending), so it lies in
        # [read - capacity, read), `read` being where the daemon has read the ring to:
        # its offset in the ring gives its absolute position.
        read = source.read_position
        position = read - ((read - (address - base)) % capacity or capacity)
        positions = []
        for _, _, nbytes in tap.header["leaves"]:
            positions.append(position)
            position += (nbytes + 7) & ~7  # leaves are padded to 8 (ring.h)
        return source.path.name, positions


class ShmSubscriber(SocketSubscriber):
    """A socket subscriber that is sent descriptors for the large ring taps: several
    per `ring_taps` message where its offer says it takes them (`ring_batches`), else
    one `ring_tap` each."""

    def __init__(
        self,
        key: PeerKey,
        hello: Hello,
        terms: Terms,
        now: float,
        readers: RingReaders,
        ring_batches: bool = False,
    ) -> None:
        super().__init__(key, hello, terms, now)
        self.readers = readers
        self.ring_batches = ring_batches and self.batch

    def send_next(self) -> bool:
        """The next queued units that lie in their emitters' rings, described in one
        `ring_taps` message; anything else as a socket subscriber sends it."""
        queue = self.queue
        found = self.readers.place(queue[0]) if self.ring_batches else None
        if found is None:
            return super().send_next()
        # As many as a `taps` message would hold (half a window, so that the ack of one
        # overlaps work on the next), and RING_MESSAGE_BYTES of ring bytes: what the
        # subscriber reads for one message.
        limit = min(self.window - self.in_flight_taps, max(1, self.window // 2), MAX_BATCH)
        deliveries = [self.start_delivery()]
        pieces = [ring_piece(deliveries[0], *found)]
        taps, size = deliveries[0].count, deliveries[0].nbytes
        while (
            queue
            and taps + queue[0].count <= limit
            and size + queue[0].nbytes <= RING_MESSAGE_BYTES
            and self.in_flight_bytes + queue[0].nbytes <= IN_FLIGHT_BYTES
        ):
            found = self.readers.place(queue[0])
            if found is None:
                break
            deliveries.append(self.start_delivery())
            pieces.append(ring_piece(deliveries[-1], *found))
            taps += deliveries[-1].count
            size += deliveries[-1].nbytes
        frames = encode_ring_batch(pieces)
        if len(frames[1]) <= BATCH_HEADER_BYTES or len(pieces) == 1:
            return self.send(self.key, frames)
        # Many distinct, large headers (rare): one message could exceed what a subscriber
        # accepts; these go one tap each.
        return all(self._send_each(d) for d in deliveries)

    def _send_each(self, delivery: Delivery) -> bool:
        # (socket.py's, with the descriptor: kept here so that its file stays as it was)
        name = delivery.emitter_name
        key = delivery.emitter.key
        for i, tap in enumerate(delivery.taps()):
            header = {**tap.header, "tid": delivery.tid + i, "emitter": name}
            found = None
            if not delivery.copied and sum(len(f) for f in tap.frames) >= SHM_MIN_BYTES:
                found = self.readers.locate(key, tap)
            if found is None:
                frames = [MAGIC, encode_header(header), *tap.frames]
            else:
                header.update(kind="ring_tap", ring=found[0], positions=found[1])
                frames = [MAGIC, encode_header(header)]
            if not self.send(self.key, frames):
                return False
        return True


def ring_piece(delivery: Delivery, ring: str, positions: list[int]) -> RingPiece:
    """`delivery`'s taps as rows of a `ring_taps` message (tapd/protocol/batch.py)."""
    unit = delivery.tap
    name = delivery.emitter_name
    if isinstance(unit, TapRun):
        site, records = unit.site, unit.records
        coords = None
        if site.shard is not None:
            coords = [site.coords(records.payload(i)) for i in range(unit.count)]
        return RingPiece(
            site.batch_static,
            ring,
            positions,
            delivery.tid,
            name,
            site,
            records.seqs,
            records.steps,
            records.devices,
            records.times,
            coords,
        )
    header = unit.header
    tap_site = unit.site
    assert isinstance(tap_site, Site)  # (`place` found it in a ring)
    shard = header.get("shard")
    return RingPiece(
        tap_site.batch_static,
        ring,
        positions,
        delivery.tid,
        name,
        tap_site,
        [header["seq"]],
        [header["step"]],
        [header["device"]],
        [header["time"]],
        None if shard is None else [shard["coords"]],
    )


def subscriber_for(
    key: PeerKey,
    hello: Hello,
    header: dict[str, Any],
    terms: Terms,
    now: float,
    readers: RingReaders | None,
) -> SocketSubscriber:
    """The target a subscriber's hello makes: one that reads rings where its offer
    holds and it is no worker pool's member (a pool's taps go to any of its members,
    each over its socket), else a plain socket subscriber."""
    if readers is not None and hello.group is None and readers.accepts(header):
        batches = header["rings"].get("batch") is True  # it takes `ring_taps`
        return ShmSubscriber(key, hello, terms, now, readers, batches)
    return SocketSubscriber(key, hello, terms, now)
