"""The subscriber's connection to one daemon: its socket, its delivery ids and its acks.

A subscriber given several endpoints (one daemon per host of a multi-host job) keeps one
`DaemonLink` per daemon. Acks carry the delivery id up to which taps were handled and
the text of each handler exception, so that the emitter's `barrier_wait()` raises it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import zmq

from tapd.errors import ProtocolError
from tapd.protocol import Message, decode, encode
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd_client.shm import RingReader, ring_offer

logger = logging.getLogger("tapd.subscriber")

# After a hello, rehellos are not answered for this long: they are the daemon's answers
# to messages sent before it (e.g. the acks and heartbeats of a subscriber whose daemon
# restarted), and each answered with a hello made a storm of them.
_REHELLO_QUIET = 1.0
ERROR_CHARS = 4000  # of an error's text sent back (the protocol allows 8192)
MAX_BATCH = DEFAULT_LIMITS.max_batch  # taps a message may hold: a bad run names no more


class DaemonLink:
    """The connection to one daemon: its socket and its delivery ids and acks.

    Nothing here ever blocks on the daemon: the socket sends only to a connected daemon
    (ZMQ_IMMEDIATE) and never waits for room, so that a daemon that is gone, or slow,
    cannot make the subscriber deaf to stop() and SIGTERM. What could not be sent is
    sent later (acks and errors are kept until they go; a hello is retried)."""

    def __init__(
        self, endpoint: str, sock: zmq.Socket[Any], rings: RingReader | None = None
    ) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.rings = rings  # where it may read ring taps (tapd_client/shm.py), if anywhere
        self.welcomed = False
        self.last_tid = -1
        self.acked_tid = -1
        self.errors: list[dict[str, Any]] = []
        self.last_sent = 0.0
        self.hello_sent = -_REHELLO_QUIET  # when the last hello went out
        self.hello_due: dict[str, Any] | None = None  # a hello still to send

    def send(self, frames: list[Any]) -> bool:
        """Send now, or not at all (False): never wait for the daemon."""
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.last_sent = time.monotonic()
        return True

    def hello(self, fields: dict[str, Any]) -> None:
        self.last_tid = self.acked_tid = -1  # delivery ids are per daemon incarnation
        self.errors = []
        offer = ring_offer(self.rings.directory) if self.rings is not None else None
        self.hello_due = fields if offer is None else {**fields, "rings": offer}
        self.send_hello()

    def send_hello(self) -> None:
        if self.hello_due is not None and self.send(encode("hello", self.hello_due)):
            self.hello_due = None
            self.hello_sent = time.monotonic()

    def rehello_wanted(self) -> bool:
        """A rehello deserves a hello only if none went out just before it."""
        return time.monotonic() - self.hello_sent >= _REHELLO_QUIET

    def receive(self) -> Message | None:
        try:
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return decode(frames)
        except ProtocolError as exc:
            self._refuse(frames, exc)
            return None

    def _refuse(self, frames: list[Any], exc: ProtocolError) -> None:
        """A message from the daemon that does not decode. If it carries taps (their
        delivery ids are readable), acknowledge them with the reason as their error, so
        that the emitter's barrier_wait raises instead of waiting for them for ever."""
        tids = _delivery_ids(frames)
        tids = [t for t in tids if t > self.last_tid]
        logger.error(
            "refused a malformed message from the daemon at %s (%d taps, "
            "acknowledged as failed): %s",
            self.endpoint,
            len(tids),
            exc,
        )
        for tid in tids:
            self.fail(tid, f"the subscriber could not decode this tap: {exc}")
        if tids:
            self.last_tid = max(tids)

    def fail(self, tid: int, text: str) -> None:
        """Tap `tid` failed: `text` goes back with the ack (cut to what is sent). Only
        the newest error keeps the lines after its first (a traceback: barrier_wait shows
        the last failure's), so that an ack stays small however many taps fail."""
        if self.errors:
            self.errors[-1]["error"] = self.errors[-1]["error"].partition("\n")[0]
        self.errors.append({"tid": tid, "error": text[:ERROR_CHARS]})

    def ack(self) -> None:
        fields = {"upto": self.last_tid, "errors": self.errors}
        if self.last_tid > self.acked_tid and self.send(encode("ack", fields)):
            self.acked_tid = self.last_tid
            self.errors = []

    def keep_alive(self, heartbeat: float) -> None:
        self.send_hello()
        if self.rings is not None:
            self.rings.tidy()
        if time.monotonic() - self.last_sent > heartbeat:
            self.send(encode("heartbeat", {}))

    def close(self) -> None:
        self.ack()
        self.send(encode("bye", {}))
        self.sock.close(linger=1000)
        if self.rings is not None:
            self.rings.close()


def _delivery_ids(frames: list[Any]) -> list[int]:
    """The delivery ids a message that failed to decode names, read as leniently as
    msgpack allows: a `tap`'s `tid`, a `taps` batch's rows' tids or its columnar runs'."""
    if len(frames) < 2:
        return []
    raw = getattr(frames[1], "buffer", frames[1])
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:  # (msgpack raises several unrelated types)
        return []
    if not isinstance(header, dict):
        return []
    if header.get("kind") in ("tap", "ring_tap"):
        tid = header.get("tid")
        return [tid] if type(tid) is int else []
    tids: set[int] = set()
    if header.get("kind") in ("taps", "ring_taps") and isinstance(header.get("taps"), list):
        rows = header["taps"]
        tids.update(r[1] for r in rows if isinstance(r, list) and len(r) > 1 and type(r[1]) is int)
    if header.get("kind") == "taps" and isinstance(header.get("runs"), list):
        for run in header["runs"]:  # columnar runs: [static, body, first tid, count, ...]
            if isinstance(run, list) and len(run) > 3 and type(run[2]) is type(run[3]) is int:
                tids.update(range(run[2], run[2] + min(max(run[3], 0), MAX_BATCH)))
    return sorted(tids)
