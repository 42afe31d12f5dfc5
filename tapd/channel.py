"""tapd's ZeroMQ sockets, each held by one thread, passing whole messages only.

libzmq aborts the process (`!_more`, fq.cpp) when the rest of a multipart message it
began to hand out is not there, and two threads on one socket do exactly that; a
message sent by halves (an exception between its frames) is worse still: its first
frames are glued to the next message sent on the socket, for whichever peer that is.
So neither the daemon nor an emitter's socket (tapd/clients/emitter_socket.py) calls a
socket's send or recv (tests/test_channels.py checks): each holds its socket in a
`Channel`, which

- belongs to the thread that made it: a call from any other raises `WrongThread`;
- sends all of a message or none of it: every frame is made a buffer before the first
  goes out, so a frame that cannot be sent (a view of ring memory released since) fails
  the whole message;
- receives whole messages (`recv_multipart`), never frame by frame.

The daemon's channels copy frames under `COPY_BELOW` (one memcpy into the message)
rather than hand them to ZeroMQ uncopied: each uncopied frame costs a wake-up of
pyzmq's garbage-collector thread, which takes the GIL from the daemon's loop to free it
(bench/RESULTS.md §17). Larger frames go uncopied, and so must stay valid until sent.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import zmq

COPY_BELOW = 256 * 1024  # bytes: the daemon's sockets copy smaller frames
# Flags as plain ints: pyzmq's `send_multipart` and `recv_multipart` combine its Flag
# enums frame by frame (`SNDMORE | flags`, `getsockopt(RCVMORE)`), Python-level enum
# arithmetic that cost a daemon forwarding a few thousand small messages a second about
# as much CPU as the sends themselves (cProfile with a CPU clock).
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)


class WrongThread(RuntimeError):
    """A socket was used from a thread other than its owner's."""


class Channel:
    def __init__(self, sock: zmq.Socket[Any], name: str, *, copy_below: int | None = None) -> None:
        self.socket = sock  # (for polling and socket options; never send or recv on it)
        self.name = name
        self._owner = threading.get_ident()
        if copy_below is not None:  # (else pyzmq's default, 64 KiB)
            sock.copy_threshold = copy_below

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThread(
                f"tapd's {self.name} socket is owned by thread {self._owner}, "
                f"not {threading.get_ident()}: ZeroMQ sockets are not thread-safe"
            )

    def send(self, frames: Sequence[Any], *, flags: int = 0, copy: bool = True) -> None:
        """Send `frames` as one message; raises before any frame goes out if one cannot
        be sent (TypeError, ValueError), or the ZMQError of the first frame."""
        self._check_thread()
        # (memoryview() of a released view raises here, before any frame goes out)
        whole = [f if isinstance(f, (bytes, zmq.Frame)) else memoryview(f) for f in frames]
        send = self.socket.send
        last = int(flags)
        more = last | _SNDMORE
        for frame in whole[:-1]:
            send(frame, more, copy=copy)
        send(whole[-1], last, copy=copy)

    def recv(self) -> list[zmq.Frame] | None:
        """The next whole message (frames not copied), or None if none is waiting."""
        self._check_thread()
        recv = self.socket.recv
        try:
            frame = recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return None
        message = [frame]
        while frame.more:  # (the rest of a message is there once its first frame is)
            frame = recv(_NOBLOCK, copy=False)
            message.append(frame)
        return message

    def close(self, linger: int) -> None:
        self._check_thread()
        self.socket.close(linger=linger)
