"""`tapd replay`: publish a recording through a daemon, as an emitter would.

The replayer is a remote emitter (the portable sender's path, docs/PROTOCOL.md): it says
`hello` as an emitter, sends each recorded tap as a `tap` message within the daemon's
credit window (tapd/protocol/link.py, the link the sender and forwarders share), and ends
with a `barrier`, whose `barrier_done` says how many taps subscribers handled. So
subscribers get replayed taps exactly as live ones, by the same routing and flow control.

Every field of a tap's meta travels unchanged (consumer, seq, step, device, process, host,
pid, time, transforms, shard, tree) but one: a daemon names a tap's emitter after the
peer that sent it, so `meta.emitter` is the replayer's "host:pid", and the recorded one
is in the static metadata, `meta.meta["recorded_emitter"]`, beside
`meta.meta["replayed"] = True`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import zmq

from tapd.clients import emitter_socket
from tapd.clients.emitter_socket import EmitterSocket
from tapd.consumers import matches_any
from tapd.errors import ProtocolError, TapdError
from tapd.protocol import encode
from tapd.tools.recording import RecordedTap, read_recording

logger = logging.getLogger("tapd.replay")


@dataclasses.dataclass
class ReplayResult:
    sent: int = 0
    bytes: int = 0
    delivered: int = 0  # the daemon's figures at the final barrier
    dropped: int = 0
    unrouted: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)  # handlers that raised
    seconds: float = 0.0


class StopFlag:
    """A stop request that a signal handler may set (`tapd replay`'s SIGINT): set() takes
    no lock, unlike threading.Event's, which a second signal landing inside the first
    handler's set() would wait on forever."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def replay(
    directory: str | Path,
    endpoint: str,
    *,
    speed: float | None = 1.0,
    names: Sequence[str] = (),
    barrier_timeout: float = 60.0,
    stop: StopFlag | threading.Event | None = None,
    progress: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Send the taps of the recording in `directory` (those matching `names`, if given)
    to the daemon at `endpoint`, `speed` times as fast as they were recorded (None: as
    fast as the daemon takes them); return once subscribers have handled them all.
    Raises TimeoutError if the daemon does not answer."""
    if speed is not None and speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    stop = stop or StopFlag()
    context: zmq.Context[Any] = zmq.Context.instance()
    sock = emitter_socket.connect(context, endpoint)
    result = ReplayResult()
    started = time.monotonic()
    identity = {"role": "emitter", "pid": os.getpid(), "host": socket.gethostname(), "process": 0}
    link = _Link(EmitterSocket(sock, identity, time.monotonic()), result)
    try:
        first: tuple[float, int] | None = None  # (monotonic, recorded time ns)
        for tap in read_recording(directory):
            if stop.is_set():
                break
            if names and not matches_any(names, tap.header["consumer"]):
                continue
            if speed is not None:
                first = first or (time.monotonic(), tap.header["time"])
                due = first[0] + (tap.header["time"] - first[1]) / 1e9 / speed
                while not stop.is_set() and (wait := due - time.monotonic()) > 0:
                    link.service(min(wait, 0.1))
            frames, nbytes = _encode(tap)
            link.wait_for_room(nbytes, stop)
            if stop.is_set():
                break
            link.connection.send(frames, nbytes)
            result.sent += 1
            result.bytes += nbytes
            if progress is not None:
                progress(result)
        link.barrier(barrier_timeout)
    finally:
        link.connection.bye()
        sock.close(linger=1000)
        result.seconds = time.monotonic() - started
    return result


# A recorded tap's fields that are sent as they were recorded (meta is amended).
_REPLAYED_FIELDS = (
    "consumer",
    "seq",
    "step",
    "device",
    "process",
    "host",
    "pid",
    "time",
    "transforms",
    "tree",
)


def _encode(tap: RecordedTap) -> tuple[list[Any], int]:
    header = tap.header
    fields = {name: header[name] for name in _REPLAYED_FIELDS}
    fields["meta"] = {**header["meta"], "replayed": True, "recorded_emitter": header.get("emitter")}
    if header.get("shard") is not None:
        fields["shard"] = header["shard"]
    return encode("tap", fields, tap.arrays), sum(a.nbytes for a in tap.arrays)


class _Link:
    """The replayer's connection (tapd/clients/emitter_socket.py) and what it waits for:
    credit, the daemon's hello answered, handlers' errors, the final barrier."""

    def __init__(self, connection: EmitterSocket, result: ReplayResult) -> None:
        self.connection = connection
        self.result = result
        self.barrier_reply: dict[str, Any] | None = None

    def wait_for_room(self, nbytes: int, stop: StopFlag | threading.Event) -> None:
        waited = time.monotonic()
        while not self.connection.may_send(nbytes) and not stop.is_set():
            self.service(0.1)
            if time.monotonic() - waited > 10 and self.connection.link.daemon is None:
                raise TimeoutError("no tapd daemon answered the replayer's hello in 10 s")

    def service(self, timeout: float) -> None:
        """Wait up to `timeout` s for the daemon; take what it says."""
        if self.connection.sock.poll(int(timeout * 1000)):
            for message, _ in self.connection.receive(time.monotonic(), _malformed):
                header = message.header
                if header["kind"] == "error":
                    text = f"{header['consumer']}#{header['seq']}: {header['error']}"
                    logger.error("a tap function raised in %s: %s", header["subscriber"], text)
                    self.result.errors.append(text)
                elif header["kind"] == "barrier_done":
                    self.barrier_reply = header
        self.connection.tick(time.monotonic(), waiting=True)

    def barrier(self, timeout: float) -> None:
        self.connection.send_barrier(0)
        deadline = time.monotonic() + timeout
        while self.barrier_reply is None:
            if time.monotonic() > deadline:
                raise TapdError(
                    f"replay: the daemon did not confirm the replayed taps within {timeout} s "
                    "(are its subscribers keeping up?)"
                )
            self.service(0.1)
        reply = self.barrier_reply
        self.result.delivered = reply["delivered"]
        self.result.dropped = reply["dropped"]
        self.result.unrouted = reply["unrouted"]


def _malformed(exc: ProtocolError) -> None:
    logger.error("ignoring a malformed message from the daemon: %s", exc)
