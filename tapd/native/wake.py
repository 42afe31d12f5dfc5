"""The wake socket of a ring's reader: after a commit, a writer that finds the reader
asleep (ring.h, `reader_sleeping`) sends a datagram to `wake.sock` in the ring's
directory (ring.cc, Wake)."""

from __future__ import annotations

import socket
from pathlib import Path

WAKE_SOCKET = "wake.sock"  # the native library sends to it from the ring's directory


class WakeSocket:
    """The datagram socket writers wake a ring's reader through (`wake.sock` in the ring's
    directory): the daemon, or a process's own receiver (its local ring), which can then
    sleep instead of polling."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / WAKE_SOCKET
        self.path.unlink(missing_ok=True)  # a dead reader's
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._wake.bind(str(self.path))
        self._wake.setblocking(False)

    def fileno(self) -> int:
        return self._wake.fileno()

    def drain(self) -> None:
        """Read every wake-up sent so far (one is as good as many)."""
        try:
            while self._wake.recv(64):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        self._wake.close()
        self.path.unlink(missing_ok=True)
