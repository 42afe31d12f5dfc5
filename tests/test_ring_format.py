"""tapd/protocol/ring_format.py (the ring format as Python reads it) agrees with ring.h,
where the format is defined: its constants, and the offsets of the fields Python reads,
worked out from the struct declarations. And with the native library itself: the file
of a ring it made holds what ring_format says, where it says."""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path

import numpy as np
import pytest

from tapd.native import library
from tapd.native.ring import Ring
from tapd.protocol import ring_format

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

RING_H = Path(__file__).parent.parent / "tapd" / "native" / "ring.h"
SIZES = {"uint64_t": 8, "int64_t": 8, "uint32_t": 4, "int32_t": 4}
FIELD = re.compile(r"^\s*(?:alignas\((\d+)\)\s+)?(?:std::atomic<(\w+)>|(\w+))\s+(\w+)\s*[;{=]")


def header_text() -> str:
    # Comments dropped: a commented-out line must not count as the format.
    return re.sub(r"//[^\n]*", "", RING_H.read_text())


def constant(name: str) -> str:
    match = re.search(rf"constexpr\s+\w+\s+{name}\s*=\s*([^;]+);", header_text())
    assert match, f"ring.h defines no constant {name}"
    return match.group(1).strip()


def integer(name: str) -> int:
    value = constant(name)
    limits = {"INT64_MIN": -(2**63)}
    if value in limits:
        return limits[value]
    return int(value.rstrip("ULul"), 0)


def layout(struct: str) -> dict[str, tuple[int, int, bool]]:
    """A struct's fixed-size fields as (offset, size, signed), by C's layout rules (each
    field at its alignment, or its alignas), from its declaration in ring.h."""
    match = re.search(rf"struct {struct} \{{(.*?)\n\}};", header_text(), re.S)
    assert match, f"ring.h declares no struct {struct}"
    fields: dict[str, tuple[int, int, bool]] = {}
    offset = 0
    for line in match.group(1).splitlines():
        field = FIELD.match(line)
        if field is None or (field.group(2) or field.group(3)) not in SIZES:
            continue
        kind = field.group(2) or field.group(3)
        size = SIZES[kind]
        align = max(size, int(field.group(1) or 0))
        offset = -(-offset // align) * align
        fields[field.group(4)] = (offset, size, not kind.startswith("u"))
        offset += size
    return fields


def asserted(expression: str) -> int:
    """The value ring.h's static_assert states for `expression` (e.g. an offsetof)."""
    pattern = re.escape(expression) + r"\s*==\s*(\d+)"
    match = re.search(pattern, header_text())
    assert match, f"ring.h asserts nothing about {expression}"
    return int(match.group(1))


def test_the_constants_are_ring_h_s() -> None:
    assert integer("kMagic") == ring_format.MAGIC
    assert integer("kVersion") == ring_format.VERSION
    assert integer("kNoStep") == ring_format.NO_STEP
    assert {
        "block": integer("kPolicyBlock"),
        "drop_newest": integer("kPolicyDropNewest"),
    } == ring_format.POLICIES
    assert integer("kTagReserved") == ring_format.TAG_RESERVED
    assert integer("kTagCommitted") == ring_format.TAG_COMMITTED
    assert integer("kTagAbandoned") == ring_format.TAG_ABANDONED
    assert "& ~uint64_t{7}) | state" in header_text()  # Tag(): the low 3 bits are the state
    assert ring_format.TAG_STATE_MASK == 7
    assert integer("kFlagStep32") == ring_format.FLAG_STEP32
    assert integer("kFlagDeviceCommit") == ring_format.FLAG_DEVICE_COMMIT
    for reason, code in ring_format.HELD_REASONS.items():
        camel = "".join(word.title() for word in reason.split("_"))
        assert integer(f"kHeld{camel}") == code, reason
    assert ring_format.commit_tag(0x1238, 0xFF, ring_format.TAG_COMMITTED) == (
        (0x1238 ^ 0xFF) & ~7 | 2
    )


def test_the_site_table_is_ring_h_s() -> None:
    assert integer("kHeaderBytes") == ring_format.HEADER_BYTES
    assert integer("kSiteTableOffset") == ring_format.SITE_TABLE_OFFSET
    assert integer("kSiteSlots") == ring_format.SITE_SLOTS
    assert integer("kEveryAll") == ring_format.EVERY_ALL
    assert integer("kEveryDormant") == ring_format.EVERY_DORMANT
    assert integer("kEveryAlwaysBit") == ring_format.EVERY_ALWAYS_BIT == 2**63
    assert ring_format.writer_every(5, True) == 2**63 + 5
    assert ring_format.writer_every(5, False) == 5
    assert ring_format.SITE_TABLE_OFFSET == ring_format.CONTROL_BYTES
    # As many slots as fit between the control page and the records.
    slot = ring_format.SITE_SLOT
    room = ring_format.HEADER_BYTES - ring_format.SITE_TABLE_OFFSET
    assert ring_format.SITE_SLOTS == room // slot.itemsize == room / slot.itemsize
    assert "kSiteSlots * sizeof(SiteSlot) == kHeaderBytes - kSiteTableOffset" in header_text()
    fields = layout("SiteSlot")
    assert list(slot.names or ()) == list(fields)
    for name, (offset, size, signed) in fields.items():
        field, field_offset = slot.fields[name][:2]  # type: ignore[index]
        assert (field_offset, field.itemsize, field.kind == "i") == (offset, size, signed), name
    assert slot.itemsize == asserted("sizeof(SiteSlot)")
    # The total `skipped` sits in the control page too.
    assert "skipped" in layout("RingControl")
    assert ring_format.header_bytes(4, 4096) == ring_format.HEADER_BYTES
    assert ring_format.header_bytes(3, 4096) == ring_format.CONTROL_BYTES
    assert ring_format.header_bytes(4, 1 << 17) == 1 << 17


def test_the_control_page_fields_python_reads_are_where_ring_h_puts_them() -> None:
    control = layout("RingControl")
    leading = ["magic", "version", "policy", "capacity", "writer_pid"]
    assert list(control)[:5] == leading
    # CONTROL unpacks exactly those, in order, each of its size and signedness.
    codes = ring_format.CONTROL.format.lstrip("<")
    assert len(codes) == len(leading)
    offset = 0
    for name, code in zip(leading, codes, strict=True):
        size = np.dtype("<" + code).itemsize
        signed = code.islower()
        assert control[name] == (offset, size, signed), name
        offset += size
    assert ring_format.CONTROL.size == offset
    assert control["writer_pid"][0] == ring_format.WRITER_PID_OFFSET
    assert control["writer_pid"][0] == asserted("offsetof(RingControl, writer_pid)")
    reader = control["reader_pid"]
    assert reader == (ring_format.READER_PID_OFFSET, ring_format.READER_PID.size, True)
    assert reader[0] == asserted("offsetof(RingControl, reader_pid)")
    assert ring_format.READER_PID.format == "<q"


def test_the_record_header_is_ring_h_s() -> None:
    header = layout("RecordHeader")
    dtype = ring_format.RECORD_HEADER
    assert list(dtype.names or ()) == list(header)
    for name, (offset, size, signed) in header.items():
        field, field_offset = dtype.fields[name][:2]  # type: ignore[index]
        assert (field_offset, field.itemsize, field.kind == "i") == (offset, size, signed), name
    assert dtype.itemsize == asserted("sizeof(RecordHeader)")
    assert header["step"][0] == asserted("offsetof(RecordHeader, step)")
    assert header["commit"][0] == asserted("offsetof(RecordHeader, commit)")
    # The struct the daemon unpacks headers with reads the same fields.
    assert ring_format.RECORD_HEADER_STRUCT.size == dtype.itemsize
    record = np.zeros(1, dtype)
    for number, name in enumerate(dtype.names or ()):
        record[name] = number + 1
    unpacked = ring_format.RECORD_HEADER_STRUCT.unpack(record.tobytes())
    assert list(unpacked) == [n + 1 for n, _ in enumerate(dtype.names or ())]


def test_the_sites_framing_is_a_little_endian_u32_length() -> None:
    assert ring_format.SITE_ENTRY_LENGTH.format == "<I"


@pytest.mark.skipif(library.load() is None, reason="tapd's native library is unavailable")
def test_a_ring_the_library_makes_holds_what_ring_format_says(tmp_path: Path) -> None:
    ring = Ring.create(tmp_path / "1-ab.ring", mmap.PAGESIZE, "drop_newest")
    try:
        assert ring.header_bytes == ring_format.RECORD_HEADER.itemsize
        ring.set_reader(4321)
        data = (tmp_path / "1-ab.ring").read_bytes()
        control_bytes = ring_format.header_bytes(ring_format.VERSION, mmap.PAGESIZE)
        magic, version, policy, capacity, writer = ring_format.CONTROL.unpack_from(data)
        assert (magic, version, policy) == (
            ring_format.MAGIC,
            ring_format.VERSION,
            ring_format.POLICIES["drop_newest"],
        )
        assert (capacity, writer) == (mmap.PAGESIZE, os.getpid())
        assert len(data) == control_bytes + capacity
        (reader,) = ring_format.READER_PID.unpack_from(data, ring_format.READER_PID_OFFSET)
        assert reader == 4321
        assert ring.write(7, b"x" * 8, step=None)
        data = (tmp_path / "1-ab.ring").read_bytes()
        record = np.frombuffer(data, ring_format.RECORD_HEADER, 1, control_bytes)[0]
        assert (record["site"], record["step"]) == (7, ring_format.NO_STEP)
        # The site table, where ring_format says: the daemon's `every`, the writers'
        # `skipped`.
        ring.set_site_every(3, ring_format.EVERY_DORMANT)
        ring.set_site_every(ring_format.SITE_SLOTS - 1, 5)
        assert not ring.write(3, b"y" * 8)
        data = (tmp_path / "1-ab.ring").read_bytes()
        table = np.frombuffer(
            data, ring_format.SITE_SLOT, ring_format.SITE_SLOTS, ring_format.SITE_TABLE_OFFSET
        )
        assert table["every"][3] == ring_format.EVERY_DORMANT
        assert table["every"][ring_format.SITE_SLOTS - 1] == 5
        assert table["skipped"][3] == 1
        assert int(table["skipped"].sum()) == 1 == ring.counters().skipped
        assert ring.skipped_by_site() == {3: 1}
    finally:
        ring.close()
