"""A ring file's control page and records, checked as input: the daemon and same-host
subscribers map rings an emitter wrote, so what they hold is read like any message
(docs/PROTOCOL.md, "Shared-memory ring"). Their layout is tapd/protocol/ring_format.py's; a
violation raises `ProtocolError` (`bad_ring`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tapd.errors import ProtocolError
from tapd.protocol import ring_format
from tapd.runtime import PID_MAX

_CONTROL = ring_format.CONTROL  # magic, version, policy, capacity, writer pid


@dataclasses.dataclass(frozen=True)
class RingControl:
    version: int
    policy: int
    capacity: int
    writer_pid: int


def check_ring_control(page: bytes | memoryview, file_size: int, page_size: int) -> RingControl:
    """The first bytes of a ring file, checked before the file is mapped: the magic and
    version, a capacity that is a positive multiple of the page size and agrees with the
    file's size, a policy and a writer pid in range. Raises ProtocolError (`bad_ring`)."""
    if len(page) < _CONTROL.size:
        raise ProtocolError("bad_ring", f"ring control page of {len(page)} bytes is truncated")
    magic, version, policy, capacity, writer_pid = _CONTROL.unpack_from(page, 0)
    control_bytes = ring_format.header_bytes(version, page_size)
    if magic != ring_format.MAGIC or version < ring_format.MIN_CHECKED_VERSION:
        raise ProtocolError("bad_ring", f"not a tapd ring (magic {magic:#x}, version {version})")
    if capacity <= 0 or capacity % page_size or capacity > 1 << 40:
        raise ProtocolError(
            "bad_ring",
            f"ring capacity {capacity} is not a positive multiple of the page size {page_size}",
        )
    if file_size != control_bytes + capacity:
        raise ProtocolError(
            "bad_ring", f"ring file of {file_size} bytes does not hold its {capacity}-byte capacity"
        )
    if policy not in ring_format.POLICIES.values():
        raise ProtocolError("bad_ring", f"ring policy {policy} is unknown")
    if not 0 < writer_pid <= PID_MAX:
        raise ProtocolError("bad_ring", f"ring writer pid {writer_pid} is out of range")
    return RingControl(version, policy, capacity, writer_pid)


def check_record(payload_bytes: int, leaf_bytes: Sequence[int]) -> None:
    """A ring record's payload holds exactly its site's leaves, each padded to 8 bytes."""
    expected = sum((n + 7) & ~7 for n in leaf_bytes)
    if payload_bytes != expected:
        raise ProtocolError(
            "bad_ring",
            f"record of {payload_bytes} payload bytes for a site whose leaves take {expected}",
        )
