"""Reading taps' bytes from the emitter's shared-memory ring (a `ring_tap` or a
`ring_taps` from the daemon: tapd/daemon/targets/shm.py), the subscriber's side.

A subscriber of an ipc:// daemon offers it, in its hello, to read rings (`ring_offer`):
this boot of this host, its uid, and which directory it sees the daemon's rings in. A
daemon whose own say the same sends large ring taps as descriptors: the ring file's
name and each leaf's ring position (`ring_tap`), or many taps' in one message
(`ring_taps`: rows as a `taps` message's, each with a ring position, read here a span
of neighbouring taps of one site at a time: `read_spans`). Here they are read:

- Only files in the ring directory this subscriber derives from its own endpoint
  (tapd.runtime.ring_dir_for), checked as every tapd directory is (ours, 0700, not a
  link), by a name that must be a ring file's (`<pid>-<hex>.ring`: no '/', no '..'),
  opened without following links, a regular file of ours whose control page is a
  ring's; mapped read-only (PROT_READ). Nothing the daemon sends can name another file.
- The bytes named must lie in the ring's unreleased records, before and after they are
  read: had the ring space been released meanwhile (the daemon gave this subscriber up
  as silent, say), the bytes may be a later tap's, and the tap is refused (its error
  goes back with the ack) rather than handed over wrong.
- By default each leaf is copied into the subscriber's own memory before the handler
  runs: what a handler keeps never changes when the ring laps. With
  `Subscriber(views=True)` the leaves view the ring itself (read-only), valid only
  during the handler's call: the daemon may release the space, and the emitter rewrite
  it, as soon as the tap is acknowledged. For handlers that only reduce or copy.
  A leaf that wraps round the ring's end is copied either way (the writer maps the
  record area twice to make it contiguous; one mapping here keeps this simple).

Imports neither JAX nor tapd's native library: the ring is read with mmap and numpy,
its layout from tapd/protocol/ring_format.py.
"""

from __future__ import annotations

import collections
import mmap
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tapd.errors import ConfigError, ProtocolError, TapdError
from tapd.protocol import Message
from tapd.protocol.batch import RingSpan, SiteRun
from tapd.protocol.ring_checks import check_ring_control
from tapd.protocol.ring_format import COMMITTED_OFFSET, TAIL_OFFSET, header_bytes
from tapd.protocol.schema import RING_NAME, check_shard, leaf_sizes
from tapd.runtime import boot_id, ensure_private_dir, ring_dir_for
from tapd.settings import SHM_SUBSCRIBERS

# Rings mapped at once; the least recently read is unmapped first, and mapping it again
# costs a MAP_POPULATE of the whole ring. 64 covers a host of 8 GPUs with several
# processes each; a mapping costs an fd and its page tables (~0.5 MiB for 256 MB).
_MAPS_KEPT = 64
_TIDY_EVERY = 1.0  # seconds between looks for rings whose files are gone


class RingReadError(TapdError):
    """A `ring_tap` this subscriber refuses to read: the ring it names, or where in it."""


def ring_directory(endpoint: str, enabled: bool | None = None) -> Path | None:
    """Where a subscriber of `endpoint` may read rings: the ring directory of an ipc://
    daemon (None for tcp://, or when turned off: `enabled`, else TAPD_SHM_SUBSCRIBERS)."""
    if not (SHM_SUBSCRIBERS.value() if enabled is None else enabled):
        return None
    return ring_dir_for(endpoint)


def ring_offer(directory: Path | None) -> dict[str, Any] | None:
    """The hello's `rings` field: None if there is nothing to offer (no directory yet,
    one that fails tapd's checks, no boot id)."""
    boot = boot_id()
    if directory is None or boot is None or not directory.is_dir():
        return None
    try:
        ensure_private_dir(directory)
        info = os.stat(directory)
    except (ConfigError, OSError):
        return None
    # `batch`: it reads `ring_taps` messages (several taps described in each) too
    return {"boot": boot, "uid": os.getuid(), "dir": [info.st_dev, info.st_ino], "batch": True}


class _MappedRing:
    """One ring file, mapped read-only: its record area and its positions."""

    def __init__(self, directory: Path, name: str) -> None:
        ensure_private_dir(directory)  # (ConfigError if it is not ours and private)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        dir_fd = os.open(directory, flags | os.O_DIRECTORY)
        try:
            self.fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise RingReadError(f"cannot open ring {directory / name}: {exc.strerror}") from exc
        finally:
            os.close(dir_fd)
        try:
            info = os.fstat(self.fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise RingReadError(f"ring {directory / name} is not a regular file of ours")
            try:
                control = check_ring_control(os.pread(self.fd, 64, 0), info.st_size, mmap.PAGESIZE)
            except ProtocolError as exc:
                raise RingReadError(f"ring {directory / name}: {exc.detail}") from exc
            # MAP_POPULATE: its pages mapped now, not faulted in one by one per tap
            mapping = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.map = mmap.mmap(self.fd, info.st_size, mapping, mmap.PROT_READ)
        except BaseException:
            os.close(self.fd)
            raise
        self.name = name
        self.capacity = control.capacity
        self.start = header_bytes(control.version, mmap.PAGESIZE)  # the record area (ring.cc)
        self.view = memoryview(self.map)  # read-only, as mapped
        self._tail = np.frombuffer(self.map, "<u8", 1, TAIL_OFFSET)  # aligned 8-byte loads
        self._committed = np.frombuffer(self.map, "<u8", 1, COMMITTED_OFFSET)

    def tail(self) -> int:
        return int(self._tail[0])

    def committed(self) -> int:
        return int(self._committed[0])

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0

    def leaf(self, position: int, nbytes: int, copy: bool) -> memoryview | bytes:
        """`nbytes` at ring `position`: a view, or a copy (always if it wraps)."""
        offset = position % self.capacity
        first = min(nbytes, self.capacity - offset)
        head = self.view[self.start + offset : self.start + offset + first]
        if first == nbytes:
            return bytes(head) if copy else head
        return b"".join((head, self.view[self.start : self.start + nbytes - first]))

    def pieces(self, span: RingSpan) -> list[memoryview]:
        """Views of the bytes of `span` (positions [start, end)): one, or two where it
        wraps round the ring's end; refused unless they lie in the ring's unreleased
        records. (`torn` says whether they were released once read.)"""
        start, nbytes = span.start, span.end - span.start
        tail, committed = self.tail(), self.committed()
        if start < tail or span.end > committed or nbytes > self.capacity:
            raise RingReadError(
                f"ring_taps names bytes [{start}, {span.end}) of ring {self.name}, "
                f"outside its unreleased records [{tail}, {committed})"
            )
        offset = start % self.capacity
        first = min(nbytes, self.capacity - offset)
        head = self.view[self.start + offset : self.start + offset + first]
        if first == nbytes:
            return [head]
        return [head, self.view[self.start : self.start + nbytes - first]]

    def close(self) -> None:
        self._tail = self._committed = np.empty(0, "<u8")
        try:
            self.view.release()
            self.map.close()
        except BufferError:  # a handler kept a view (views=True): unmapped with the last
            pass
        os.close(self.fd)


def released_while_read(ring: str) -> str:
    return (
        f"the space of this tap in ring {ring} was released while it was read "
        "(the daemon gave this subscriber up?): its bytes may be a later tap's"
    )


class RingReader:
    """The rings of one daemon that a subscriber reads, mapped as they are named."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._maps: collections.OrderedDict[str, _MappedRing] = collections.OrderedDict()
        self._tidied = time.monotonic()

    def read(self, header: dict[str, Any], *, views: bool) -> tuple[Message, Callable[[], None]]:
        """The tap a `ring_tap` describes, as a `tap` Message, and a check that its bytes
        were not released meanwhile (run here; with views, run it again once the
        handler returned). Raises RingReadError if it cannot be read as described."""
        name = header["ring"]
        if RING_NAME.fullmatch(name) is None:
            raise RingReadError(
                f"the daemon named ring {name!r:.80}, which is not a ring file name "
                "('<pid>-<hex>.ring' in the ring directory); refused"
            )
        try:
            sizes = leaf_sizes(header)
            if header.get("shard") is not None:
                check_shard(header["shard"], header["leaves"])
        except ProtocolError as exc:
            raise RingReadError(f"ring_tap with bad leaves: {exc}") from exc
        positions: list[int] = header["positions"]
        if len(positions) != len(sizes):
            raise RingReadError(
                f"ring_tap gives {len(positions)} positions for {len(sizes)} leaves"
            )
        ring = self._ring(name)
        first = min(positions, default=0)
        tail, committed = ring.tail(), ring.committed()
        for position, nbytes in zip(positions, sizes, strict=True):
            if position < tail or position + nbytes > committed or nbytes > ring.capacity:
                raise RingReadError(
                    f"ring_tap names bytes [{position}, {position + nbytes}) of ring {name}, "
                    f"outside its unreleased records [{tail}, {committed})"
                )
        frames = [ring.leaf(p, n, not views) for p, n in zip(positions, sizes, strict=True)]

        def intact() -> None:
            if ring.tail() > first:
                raise RingReadError(released_while_read(name))

        intact()  # (the copies: read before any later tap could be written there)
        fields = {k: v for k, v in header.items() if k not in ("ring", "positions")}
        fields["kind"] = "tap"
        return Message(fields, frames), intact

    def read_spans(
        self, spans: Sequence[RingSpan], *, views: bool
    ) -> list[SiteRun | RingReadError]:
        """The taps of a `ring_taps` message's spans (decode checked them): per span, a
        SiteRun whose body holds its bytes, or why they could not be read. The bodies
        are copies, all in one buffer (one allocation per message, which the allocator
        reuses from one message to the next); with views, views of the ring where a
        span does not wrap, valid until the daemon releases them (`torn` says)."""
        out: list[SiteRun | RingReadError] = []
        found: list[tuple[int, RingSpan, list[memoryview]]] = []  # (index in out, ...)
        for span in spans:
            try:
                pieces = self._ring(span.ring).pieces(span)
            except RingReadError as exc:
                out.append(exc)
                continue
            except ConfigError as exc:  # (the ring directory is not ours and private)
                out.append(RingReadError(str(exc)))
                continue
            if views and len(pieces) == 1:
                out.append(span.run(pieces[0]))
                continue
            found.append((len(out), span, pieces))
            out.append(RingReadError("(not read)"))
        if not found:
            return out
        copy = memoryview(b"".join(piece for _, _, pieces in found for piece in pieces))
        offset = 0
        for index, span, _ in found:
            size = span.end - span.start
            out[index] = (
                RingReadError(released_while_read(span.ring))
                if self.torn(span)
                else span.run(copy[offset : offset + size])
            )
            offset += size
        return out

    def torn(self, span: RingSpan) -> bool:
        """Whether `span`'s ring space was released since it was read (views: the bytes
        a handler read may be a later tap's)."""
        ring = self._maps.get(span.ring)
        return ring is None or ring.tail() > span.start

    def _ring(self, name: str) -> _MappedRing:
        ring = self._maps.get(name)
        if ring is not None:
            self._maps.move_to_end(name)
            return ring
        self.forget_unlinked()
        try:
            ring = self._maps[name] = _MappedRing(self.directory, name)
        except (OSError, ValueError) as exc:  # (RingReadError and ConfigError pass)
            raise RingReadError(f"cannot map ring {self.directory / name}: {exc}") from exc
        while len(self._maps) > _MAPS_KEPT:
            self._maps.popitem(last=False)[1].close()
        return ring

    def tidy(self) -> None:
        """Now and then (the subscriber's loop calls it): a finished emitter's ring,
        removed by the daemon, is unmapped, so that its shared memory is freed."""
        if self._maps and time.monotonic() - self._tidied >= _TIDY_EVERY:
            self._tidied = time.monotonic()
            self.forget_unlinked()

    def forget_unlinked(self) -> None:
        """Unmap the rings whose files are gone (their emitters finished)."""
        for name, ring in list(self._maps.items()):
            if ring.unlinked():
                del self._maps[name]
                ring.close()

    def close(self) -> None:
        for ring in self._maps.values():
            ring.close()
        self._maps.clear()
