"""The `.sites` file beside each ring: what is static about each tap site.

The emitter appends one entry per distinct tap site (consumer, tree, leaf dtypes and
shapes, static metadata, transforms, its `site` id) the first time it traces it; the
daemon reads entries as they appear to interpret ring records, which carry only the
site id (tapd/protocol/schema.py, `split_site_entries` and `check_site_entry`). The
framing is ring_format.SITE_ENTRY_LENGTH (docs/PROTOCOL.md, "Shared-memory ring").
"""

from __future__ import annotations

from typing import Any

import msgpack

from tapd.protocol.ring_format import SITE_ENTRY_LENGTH


def encode_entry(entry: dict[str, Any]) -> bytes:
    """One entry, framed for appending to a sites file."""
    packed: bytes = msgpack.packb(entry, use_bin_type=True)
    return SITE_ENTRY_LENGTH.pack(len(packed)) + packed
