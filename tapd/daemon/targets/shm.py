"""Same-host subscribers that read large ring taps where they already lie: in the
emitter's shared-memory ring (docs/PROTOCOL.md, "ring_tap").

A subscriber whose hello offers to read rings (`rings`: this boot of this host, its uid,
and the device and inode of the ring directory it sees beside its ipc socket) and whose
offer matches this daemon's gets a `ring_tap` for each tap of at least `SHM_MIN_BYTES`
read from a ring: the tap's header, the ring's file name and each leaf's ring position,
no bytes. Everything else is as for any socket subscriber (a mode of it, this subclass):
routing, window, queue bound, acknowledgements, and a dead subscriber's taps counted
lost. The ring space stays held as for every ring tap: released only once the unit is
finished (tapd/daemon/ledger.py, `advance`; tapd/daemon/rings.py, `release_delivered`),
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
from tapd.daemon.subscriptions import Hello
from tapd.daemon.targets.base import Terms
from tapd.daemon.targets.socket import BATCH_BYTES, SocketSubscriber
from tapd.protocol import MAGIC, Message
from tapd.protocol.wire import encode_header
from tapd.runtime import boot_id
from tapd.settings import SHM_SUBSCRIBERS

# Smaller taps go to subscribers in batches (tapd/daemon/targets/socket.py): one message
# for many, where a descriptor each would cost more than their bytes.
SHM_MIN_BYTES = BATCH_BYTES


class _Rings(Protocol):
    """What of tapd/daemon/rings.py's RingSet this module reads (by name: rings.py
    imports the router, which imports this)."""

    directory: Any
    sources: Any


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
        counters = source.ring.counters()
        capacity = counters.capacity
        address = np.frombuffer(first, np.uint8).ctypes.data
        if size != 2 * capacity or not base <= address < base + size:
            return None
        # The record is unreleased (its unit is pending), so it lies in [tail, tail +
        # capacity): its offset in the ring gives its absolute position.
        tail = counters.tail
        position = tail + ((address - base) % capacity - tail) % capacity
        positions = []
        for _, _, nbytes in tap.header["leaves"]:
            positions.append(position)
            position += (nbytes + 7) & ~7  # leaves are padded to 8 (ring.h)
        return source.path.name, positions


class ShmSubscriber(SocketSubscriber):
    """A socket subscriber that is sent descriptors for the large ring taps."""

    def __init__(
        self, key: PeerKey, hello: Hello, terms: Terms, now: float, readers: RingReaders
    ) -> None:
        super().__init__(key, hello, terms, now)
        self.readers = readers

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
        return ShmSubscriber(key, hello, terms, now, readers)
    return SocketSubscriber(key, hello, terms, now)
