"""The `.sites` file beside each ring: what is static about each tap site.

The emitter appends one entry per distinct tap site (consumer, tree, leaf dtypes and
shapes, static metadata, transforms, its `site` id) the first time it traces it; the
daemon reads entries as they appear to interpret ring records, which carry only the
site id. Each entry is a little-endian u32 length followed by that many bytes of
msgpack (docs/PROTOCOL.md, "Shared-memory ring").
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import msgpack

_LENGTH = struct.Struct("<I")


def encode_entry(entry: dict[str, Any]) -> bytes:
    """One entry, framed for appending to a sites file."""
    packed: bytes = msgpack.packb(entry, use_bin_type=True)
    return _LENGTH.pack(len(packed)) + packed


def read_sites(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Site entries appended to `path` after `offset`, and the new offset (whole entries
    only: a half-written one is read next time)."""
    with open(path, "rb") as sites:
        sites.seek(offset)
        data = sites.read()
    entries = []
    position = 0
    while position + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, position)
        if position + _LENGTH.size + length > len(data):
            break
        start = position + _LENGTH.size
        entries.append(msgpack.unpackb(data[start : start + length], raw=False))
        position = start + length
    return entries, offset + position
