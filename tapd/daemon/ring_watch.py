"""Watching the ring files of this host: the lock by which one daemon alone drains a
ring, the wake socket through which writers wake an idle daemon, and the sweep of ring
directories that no one can drain any more.

A ring file is checked before it is mapped (a regular file of ours, not a link, whose
control page is sound: tapd/protocol/ring_checks.py, check_ring_control). Its liveness is
read from its control page: the writer's pid, and the reader's (the daemon that drains
it; tapd/protocol/ring_format.py gives the offsets).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import stat
import struct
from pathlib import Path

from tapd.errors import ProtocolError
from tapd.native.ring import RingError
from tapd.native.wake import WAKE_SOCKET, WakeSocket
from tapd.protocol.ring_checks import check_ring_control
from tapd.protocol.ring_format import READER_PID, READER_PID_OFFSET
from tapd.runtime import (
    SHM_DIR,
    local_ring_dir_pid,
    pid_alive,
    ring_dir_prefix,
    runtime_dir_of_rings,
)

logger = logging.getLogger("tapd.daemon")

__all__ = ["WAKE_SOCKET", "RingBusy", "WakeSocket", "lock_ring_file", "sweep_stale_rings"]

# struct flock (x86-64 and aarch64 Linux): l_type, l_whence, l_start, l_len, l_pid.
_WRITE_LOCK = struct.pack("hhxxxxqqixxxx", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)


class RingBusy(RingError):
    """Another daemon drains this ring (it holds the ring file's lock)."""


def lock_ring_file(path: Path) -> int:
    """Check a ring file before it is mapped (a regular file of ours, not a link, whose
    control page is sound: tapd/protocol/ring_checks.py, check_ring_control) and take its
    lock, so that no two daemons drain one ring. Returns the locked descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RingError(f"cannot open ring {path}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise RingError(f"ring {path} is not a regular file of ours")
        try:
            check_ring_control(os.pread(fd, 64, 0), info.st_size, mmap.PAGESIZE)
        except ProtocolError as exc:
            raise RingError(f"ring {path}: {exc.detail}") from exc
        try:
            # An open-file-description lock: the writer holds a flock on the file (its
            # liveness, ring.h), which on Linux never conflicts with this one.
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WRITE_LOCK)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise RingError(f"cannot lock ring {path}: {exc.strerror}") from exc
            raise RingBusy(f"ring {path} is drained by another tapd daemon") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_stale_rings(*, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the ring directories in /dev/shm whose runtime directory is gone (a killed
    job's, say) and whose rings no live process writes or reads: nobody can drain them
    any more, and shared memory is never freed by itself. Returns each directory
    removed (or that would be, with `dry_run`) and the bytes it held."""
    removed: list[tuple[Path, int]] = []
    if not SHM_DIR.is_dir():
        return removed
    for directory in sorted(SHM_DIR.glob(f"{ring_dir_prefix()}*")):
        writer = local_ring_dir_pid(directory.name)
        if writer is not None:  # a process's local ring: only its wake socket is left
            if not pid_alive(writer) and directory.lstat().st_uid == os.getuid():
                if not dry_run:
                    shutil.rmtree(directory, ignore_errors=True)
                removed.append((directory, 0))
            continue
        runtime = runtime_dir_of_rings(directory)
        try:
            info = directory.lstat()
        except OSError:
            continue
        if (
            runtime is None
            or runtime.exists()
            or not stat.S_ISDIR(info.st_mode)
            or info.st_uid != os.getuid()
        ):
            continue
        held = _stale_bytes(directory)
        if held is None:
            continue
        if not dry_run:
            for entry in directory.iterdir():
                entry.unlink(missing_ok=True)
            try:
                directory.rmdir()
            except OSError:
                continue
            logger.warning(
                "removed the rings of %s (%d bytes): its runtime directory %s is "
                "gone and no process uses them",
                directory,
                held,
                runtime,
            )
        removed.append((directory, held))
    return removed


def _stale_bytes(directory: Path) -> int | None:
    """The bytes of the files in `directory` if no live process writes or reads any of
    its rings, else None."""
    held = 0
    locks = []
    try:
        for entry in directory.iterdir():
            info = entry.lstat()
            held += info.st_size
            if entry.suffix != ".ring" or not stat.S_ISREG(info.st_mode):
                continue
            try:
                fd = lock_ring_file(entry)
            except RingBusy:
                return None  # a daemon drains it
            except RingError:
                continue  # not a ring we can read: nobody else can either
            locks.append(fd)
            page = os.pread(fd, READER_PID_OFFSET + READER_PID.size, 0)
            writer = check_ring_control(page, info.st_size, mmap.PAGESIZE).writer_pid
            (reader,) = READER_PID.unpack_from(page, READER_PID_OFFSET)
            if pid_alive(writer) or (reader != os.getpid() and pid_alive(reader)):
                return None
    except OSError:
        return None
    finally:
        for fd in locks:
            os.close(fd)
    return held
