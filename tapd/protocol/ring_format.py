"""The shared-memory ring's file format, as Python reads it: the one Python copy of what
tapd/native/ring.h defines (docs/PROTOCOL.md, "Shared-memory ring"). A format that
emitters, the daemon and same-host subscribers share, so it lives with the protocol;
the native library only implements it.

Everything in Python that reads ring bytes itself takes its offsets, sizes and values
from here: the ring binding (tapd/native/ring.py), the checks of a ring file before it
is mapped (schema.py), the daemon's ring watch (tapd/daemon/ring_watch.py) and the
subscribers that read rings (tapd_client/shm.py). tests/test_ring_format.py checks that
this module and ring.h agree. Imports only numpy.
"""

from __future__ import annotations

import struct

import numpy as np

MAGIC = 0x31474E4952504154  # kMagic: "TAPRING1", little-endian
VERSION = 4  # kVersion: the format the native library maps
# The control page fields checked before mapping (CONTROL) lead it in every version
# since 2; which versions it can map exactly is the native library's to say.
MIN_CHECKED_VERSION = 2

# The control page: 4096 bytes (RingControl). In format 2 and 3 the records follow it
# (or one page where pages are larger).
CONTROL_BYTES = 4096
# Format 4: the header area, the control page then the site table, is HEADER_BYTES (or
# one page where pages are larger); the records follow it.
HEADER_BYTES = 65536  # kHeaderBytes
SITE_TABLE_OFFSET = 4096  # kSiteTableOffset
SITE_SLOTS = 3840  # kSiteSlots: sites with an id at or above it have no slot (always sent)
# SiteSlot: `every` written only by the daemon, `skipped` only by the emitter's writers,
# `relied_on` by the emitter (1: it must acknowledge a wake, setting it back to 0).
SITE_SLOT = np.dtype([("every", "<u4"), ("relied_on", "<u4"), ("skipped", "<u8")])
EVERY_ALL = 0  # kEveryAll: nobody has said: send every tap
EVERY_DORMANT = 0xFFFFFFFF  # kEveryDormant: no taker: copy nothing
# kEveryAlwaysBit: set in a writer's `every` (the handlers' attribute, the portable
# backend's argument) for a site marked `always`: its slot is not read, only its own K.
EVERY_ALWAYS_BIT = 1 << 63


def writer_every(every: int, always: bool) -> int:
    """What a writer is told of a site: its own `every` K, and whether it is `always`."""
    return every | (EVERY_ALWAYS_BIT if always else 0)


# RingControl's leading fields: magic, version, policy, capacity, writer_pid.
CONTROL = struct.Struct("<QIIQq")
WRITER_PID_OFFSET = 24  # offsetof(RingControl, writer_pid)
READER_PID_OFFSET = 280  # offsetof(RingControl, reader_pid)
READER_PID = struct.Struct("<q")
# Same-host subscribers read these to check a record they read was not released meanwhile.
COMMITTED_OFFSET = 128  # offsetof(RingControl, committed)
TAIL_OFFSET = 192  # offsetof(RingControl, tail)
POSITION = struct.Struct("<Q")

POLICIES = {"block": 0, "drop_newest": 1}  # kPolicyBlock, kPolicyDropNewest
# Which of its process's rings a native tap writes (the handler's `ring` attribute).
RINGS = {"daemon": 0, "local": 1}  # kRingDaemon, kRingLocal
NO_STEP = -(2**63)  # kNoStep: a record without a step

# Commit tag states: the low bits of a record's `commit` word (Tag() in ring.h).
TAG_RESERVED = 1
TAG_COMMITTED = 2
TAG_ABANDONED = 3
TAG_STATE_MASK = 7

# RecordHeader: one record, 8-byte aligned, followed by its leaves, each padded to 8.
RECORD_HEADER = np.dtype(
    [
        ("length", "<u4"),
        ("nleaves", "<u4"),
        ("site", "<u8"),
        ("seq", "<u8"),
        ("step", "<i8"),
        ("time_ns", "<i8"),
        ("device", "<i4"),
        ("flags", "<u4"),
        ("commit", "<u8"),
    ]
)
# The same fields, unpacked without numpy (the daemon's per-record path).
RECORD_HEADER_STRUCT = struct.Struct("<IIQQqqiIQ")

# Record header `flags` (kFlag*). A host commit clears them; a commit a CUDA stream
# writes cannot, so a reader sees them on such records.
FLAG_STEP32 = 1  # `step` holds an int32 in its low half: sign-extend it
FLAG_DEVICE_COMMIT = 2  # the tag is written by a device: poll for it, never sleep

# RingControl::held_reason (kHeld*): why the daemon holds the oldest record it has not
# released; the daemon writes it, a writer waiting for space says it. 0: not said.
HELD_REASONS = {
    "not_read": 1,
    "unacked": 2,
    "grace": 3,
    "queue_full": 4,
    "site_unknown": 5,
    "detached": 6,
    "nothing": 7,
}

# The `.sites` file beside a ring: entries, each a u32 length then that many bytes of
# msgpack (tapd/native/sites.py writes them, tapd/protocol/schema.py reads them).
SITE_ENTRY_LENGTH = struct.Struct("<I")


def header_bytes(version: int, page_size: int) -> int:
    """Where a ring file of format `version` has its first record (ring.cc)."""
    return max(page_size, HEADER_BYTES if version >= 4 else CONTROL_BYTES)


def commit_tag(position: int, nonce: int, state: int) -> int:
    """The commit word of the record at ring `position` in `state` (Tag() in ring.h)."""
    return ((position ^ nonce) & ~TAG_STATE_MASK) | state
