"""The `spool` policy's on-disk log: a subscriber's taps that its full queue cannot take.

Under `--policy spool`, a subscriber whose queue is full does not slow the emitters and
loses nothing: the router appends each tap for it here instead (the unit's bytes copied
out of the ring or the socket's message, so that their ring space can be released), and
takes them back, in order, into the queue as the subscriber catches up
(docs/PROTOCOL.md, "Spool"). The log is bounded (`--spool-bytes`); when it is full, or
the disk is (ENOSPC and other write errors), the router falls back to
`--spool-fallback` (block or drop_newest) and counts what that does.

One directory per subscriber name under `--spool-dir`, holding segment files
(`<number>.seg`) of records:

    u32 length | u32 crc32 of the payload | payload: msgpack [emitter, nbytes, taps]
    taps: [[header bytes (msgpack, as on the wire), [leaf bytes, ...]], ...]

A segment whose every record was taken and acknowledged is deleted. A daemon that stops
(or is killed) leaves the segments in place; the next one, finding them, hands them to the
subscriber of that name when it says hello again, before anything newer. A record cut
short by a kill (its crc fails) ends its segment. Delivery across a restart is
at-least-once: records taken but not yet acknowledged are read again.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from tapd.errors import ProtocolError
from tapd.protocol import MAGIC, Message, decode
from tapd.protocol.wire import encode_header

logger = logging.getLogger("tapd.daemon")

_RECORD = struct.Struct("<II")  # length of the payload, its crc32
SEGMENT_BYTES = 16 << 20  # a new segment file past this size
_NAME_FILE = "subscriber"  # holds the subscriber's name, for people and for recovery


class SpoolFull(Exception):
    """The spool has no room for the record: its bound (`--spool-bytes`)."""


class SpoolError(Exception):
    """The disk refused the record (full, or another write error)."""


@dataclasses.dataclass
class SpoolEntry:
    """A record in the log: where it is, and what the router knows of it (`owner`: the
    emitter and unit index it belongs to, in this daemon's lifetime; None if it was
    found on disk at start)."""

    segment: int
    offset: int
    length: int
    nbytes: int  # its taps' array payload
    count: int  # its taps
    owner: Any = None


@dataclasses.dataclass
class Taken:
    """A record taken back from the log: its taps, and the segment to acknowledge."""

    taps: list[Message]
    emitter: str
    entry: SpoolEntry


class Spool:
    """The on-disk log of one subscriber's taps, at most `limit` bytes."""

    def __init__(self, root: Path, name: str, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.directory = root / hashlib.sha256(name.encode()).hexdigest()[:16]
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.directory / _NAME_FILE).write_text(name)
        self.entries: collections.deque[SpoolEntry] = collections.deque()  # not taken yet
        self.bytes = 0  # on disk, in all segments still there
        self.nbytes = 0  # array payload of the records not taken yet
        self.taps = 0  # taps in the records not taken yet
        self._sizes: dict[int, int] = {}  # segment -> bytes in it
        self._open: dict[int, int] = {}  # segment -> records not yet acknowledged
        # segment -> records acknowledged from its start (acks come in record order):
        # kept in `<segment>.acked` at close, so the next daemon skips them
        self._acked: dict[int, int] = {}
        self._write: Any = None  # the segment file appended to
        self._write_number = 0
        self._read: dict[int, Any] = {}  # segment -> file opened for reading
        self._recover()

    # ---- appending ----------------------------------------------------------------------

    def append(
        self, taps: Sequence[Message], emitter: str, nbytes: int, owner: Any = None
    ) -> SpoolEntry:
        """Write one unit's taps at the end; raises SpoolFull (the bound) or SpoolError
        (the disk), having written nothing."""
        payload = msgpack.packb(
            [emitter, nbytes, [[_header_bytes(t), [bytes(f) for f in t.frames]] for t in taps]],
            use_bin_type=True,
        )
        record = _RECORD.pack(len(payload), zlib.crc32(payload)) + payload
        if self.bytes + len(record) > self.limit:
            raise SpoolFull(
                f"the spool of {self.name!r} holds {self.bytes} bytes, its bound "
                f"is {self.limit} (--spool-bytes)"
            )
        if self._write is None or self._sizes[self._write_number] >= SEGMENT_BYTES:
            self._new_segment()
        number = self._write_number
        offset = self._sizes[number]
        try:
            self._write.write(record)
            self._write.flush()
        except OSError as exc:
            self._undo(number, offset)
            what = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
            raise SpoolError(f"cannot write to the spool at {self.directory}: {what}") from exc
        self._sizes[number] += len(record)
        self._open[number] += 1
        self.bytes += len(record)
        entry = SpoolEntry(number, offset, len(record), nbytes, len(taps), owner)
        self.entries.append(entry)
        self.nbytes += nbytes
        self.taps += len(taps)
        return entry

    def _new_segment(self) -> None:
        if self._write is not None:
            self._write.close()
            if not self._open.get(self._write_number):  # all its records handled
                self._forget(self._write_number, unlink=True)
        self._write_number = max(self._sizes, default=0) + 1
        path = self._segment(self._write_number)
        try:
            if not self.directory.is_dir():  # removed when it caught up
                self.directory.mkdir(mode=0o700, parents=True)
                (self.directory / _NAME_FILE).write_text(self.name)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            self._write = None
            raise SpoolError(f"cannot create {path}: {exc}") from exc
        self._write = os.fdopen(descriptor, "ab")
        self._sizes[self._write_number] = 0
        self._open[self._write_number] = 0
        self._acked[self._write_number] = 0

    def _undo(self, number: int, offset: int) -> None:
        """Cut a record that could not be written whole off the end of its segment."""
        try:
            self._write.close()
        except OSError:
            pass
        self._write = None
        try:
            os.truncate(self._segment(number), offset)
        except OSError:
            pass
        if offset == 0 and not self._open.get(number):
            self._forget(number, unlink=True)

    # ---- taking back --------------------------------------------------------------------

    def take(self) -> Taken | None:
        """The oldest record not yet taken, read back from disk; None if there is none.
        A record that cannot be read (the disk, or a corrupt file) is skipped, logged."""
        while self.entries:
            entry = self.entries.popleft()
            self.nbytes -= entry.nbytes
            self.taps -= entry.count
            try:
                return self._read_entry(entry)
            except (OSError, ValueError, ProtocolError) as exc:
                logger.error(
                    "spool of %r: a record of %d taps cannot be read back and is lost: %s",
                    self.name,
                    entry.count,
                    exc,
                )
                self.acknowledge(entry)
        return None

    def _read_entry(self, entry: SpoolEntry) -> Taken:
        handle = self._read.get(entry.segment)
        if handle is None:
            handle = self._read[entry.segment] = open(self._segment(entry.segment), "rb")  # noqa: SIM115
        handle.seek(entry.offset)
        raw = handle.read(entry.length)
        length, crc = _RECORD.unpack_from(raw)
        payload = raw[_RECORD.size :]
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise ValueError("crc mismatch")
        emitter, _, taps = msgpack.unpackb(payload, raw=False)
        messages = [decode([MAGIC, header, *leaves]) for header, leaves in taps]
        return Taken(messages, emitter, entry)

    def acknowledge(self, entry: SpoolEntry) -> None:
        """A taken record was handled (or given up): its segment may go."""
        number = entry.segment
        if number not in self._open:
            return
        self._open[number] -= 1
        self._acked[number] = self._acked.get(number, 0) + 1
        if self._open[number] == 0 and number != self._write_number:
            self._forget(number, unlink=True)
        elif not self.entries and not any(self._open.values()):
            self.remove()  # caught up: nothing on disk is needed any more

    @property
    def settled(self) -> bool:
        """Nothing on disk waits to be taken or acknowledged."""
        return not self.entries and not any(self._open.values())

    def _forget(self, number: int, unlink: bool = False) -> None:
        handle = self._read.pop(number, None)
        if handle is not None:
            handle.close()
        self.bytes -= self._sizes.pop(number, 0)
        self._open.pop(number, None)
        self._acked.pop(number, None)
        if unlink:
            self._segment(number).with_suffix(".acked").unlink(missing_ok=True)
            try:
                self._segment(number).unlink()
            except OSError as exc:
                logger.warning(
                    "spool of %r: cannot remove %s: %s", self.name, self._segment(number), exc
                )

    # ---- lifecycle ----------------------------------------------------------------------

    def _segment(self, number: int) -> Path:
        return self.directory / f"{number:08d}.seg"

    def _recover(self) -> None:
        """Index the records a previous daemon left (in segment order); a record cut
        short ends its segment."""
        for path in sorted(self.directory.glob("*.seg")):
            try:
                number = int(path.stem)
                data = path.read_bytes()
            except (ValueError, OSError) as exc:
                logger.error("spool of %r: ignoring %s: %s", self.name, path, exc)
                continue
            offset = 0
            entries = []
            try:  # records of it that the last daemon saw acknowledged
                skip = int(path.with_suffix(".acked").read_text())
            except (OSError, ValueError):
                skip = 0
            while offset + _RECORD.size <= len(data):
                length, crc = _RECORD.unpack_from(data, offset)
                payload = data[offset + _RECORD.size : offset + _RECORD.size + length]
                if len(payload) != length or zlib.crc32(payload) != crc:
                    logger.warning(
                        "spool of %r: %s ends in a record cut short (a daemon "
                        "killed while writing it)",
                        self.name,
                        path,
                    )
                    break
                try:
                    _, nbytes, taps = msgpack.unpackb(payload, raw=False)
                except (ValueError, msgpack.UnpackException) as exc:
                    logger.error("spool of %r: %s: unreadable record: %s", self.name, path, exc)
                    break
                if skip:
                    skip -= 1
                else:
                    entries.append(
                        SpoolEntry(number, offset, _RECORD.size + length, nbytes, len(taps))
                    )
                offset += _RECORD.size + length
            if not entries:
                path.unlink(missing_ok=True)
                path.with_suffix(".acked").unlink(missing_ok=True)
                continue
            self._sizes[number] = offset
            self._open[number] = len(entries)
            self.bytes += offset
            self.entries.extend(entries)
            self.nbytes += sum(e.nbytes for e in entries)
            self.taps += sum(e.count for e in entries)
        if self.entries:
            logger.info(
                "spool of %r: %d taps (%d bytes) left by an earlier daemon",
                self.name,
                self.taps,
                self.bytes,
            )

    def close(self) -> None:
        """Close the files, leaving what is not acknowledged for the next daemon."""
        for number, acked in self._acked.items():
            if acked and number in self._sizes:
                try:
                    self._segment(number).with_suffix(".acked").write_text(str(acked))
                except OSError:
                    pass  # the next daemon delivers those again: at least once
        if self._write is not None:
            self._write.close()
            self._write = None
        for handle in self._read.values():
            handle.close()
        self._read.clear()

    def remove(self) -> None:
        """Delete the log (its taps were counted lost, or all were delivered)."""
        self._acked.clear()
        self.close()
        for number in list(self._sizes):
            self._forget(number, unlink=True)
        self.entries.clear()
        self.nbytes = self.taps = 0
        (self.directory / _NAME_FILE).unlink(missing_ok=True)
        try:
            self.directory.rmdir()
        except OSError:
            pass


def find_spools(root: Path) -> dict[str, Path]:
    """Subscriber name -> spool directory, for the spools an earlier daemon left."""
    found = {}
    if root.is_dir():
        for directory in root.iterdir():
            name_file = directory / _NAME_FILE
            if name_file.is_file() and any(directory.glob("*.seg")):
                try:
                    found[name_file.read_text()] = directory
                except OSError:
                    continue
    return found


def _header_bytes(tap: Message) -> bytes:
    return encode_header(tap.header)
