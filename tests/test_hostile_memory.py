"""The daemon's memory under hostile peers (issue 18, part 5; docs/PROMISES.md, "Daemon
memory"): oversized messages are refused without being held more than once, and a long
run of malformed frames from rogue emitters and subscribers, over new and reused
connections, leaves its memory and its per-peer tables where they were."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from test_hostile_input import TAP_FIELDS, Probe, a_normal_tap_arrives

from conftest import Daemon, wait_until
from tapd.protocol import MAGIC, encode

MiB = 1 << 20
BAD_TAP = [MAGIC, msgpack.packb({**TAP_FIELDS, "kind": "tap", "leaves": [["float32", [1], 4]]}),
           b"xx"]  # fmt: skip
EMITTER_HELLO = encode("hello", {"role": "emitter", "host": "h", "pid": 1, "process": 0})
SUBSCRIBER_HELLO = encode("hello", {"role": "subscriber", "consumers": ["x"], "window": 1})


def status_kib(daemon: Daemon, field: str) -> int:
    text = Path(f"/proc/{daemon.process.pid}/status").read_text()
    return int(text.split(f"{field}:")[1].split()[0])


def reset_peak(daemon: Daemon) -> None:
    """VmHWM starts again from the current RSS (proc(5), clear_refs)."""
    Path(f"/proc/{daemon.process.pid}/clear_refs").write_text("5")


def normal_tap_arrives(
    daemon: Daemon, raw_peer: Callable[[str], zmq.Socket[bytes]], value: float
) -> None:
    watcher = Probe(daemon.endpoint)
    try:
        a_normal_tap_arrives(daemon, raw_peer, watcher, value)
    finally:
        watcher.close()


def rejected(daemon: Daemon) -> int:
    return sum(v for k, v in daemon.counters().items() if k.startswith("rejected_"))


def test_oversized_messages_are_refused_counted_and_held_at_most_once(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
) -> None:
    limit = 32 * MiB
    daemon = start_daemon("--max-message-bytes", str(limit))
    blob = bytes(24 * MiB)  # within the largest frame, beyond what its place allows
    kinds: dict[str, tuple[list[bytes], str]] = {
        "magic": ([blob, BAD_TAP[1], b"xxxx"], "rejected_bad_magic"),
        "header": ([MAGIC, blob], "rejected_too_large"),
        "array": ([MAGIC, BAD_TAP[1], blob], "rejected_bad_frames"),
        "extra frame": ([*SUBSCRIBER_HELLO, blob], "rejected_bad_frames"),
    }
    start_kib = status_kib(daemon, "VmRSS")
    reset_peak(daemon)
    for name, (message, counter) in kinds.items():
        before = daemon.counters().get(counter, 0)
        sock = raw_peer(daemon.endpoint)
        for _ in range(3):
            sock.send_multipart(message, copy=False)
        wait_until(lambda: daemon.counters().get(counter, 0) >= before + 3,  # noqa: B023
                   f"three oversized {name} messages counted in {counter}")  # fmt: skip
    peak_mib = (status_kib(daemon, "VmHWM") - start_kib) / 1024
    # All twelve at once would be 288 MiB; each is held once, a few at a time at most.
    assert peak_mib < 4 * 24, f"the daemon's peak RSS grew by {peak_mib:.0f} MiB"

    # A frame larger than any a real peer sends: libzmq closes the connection unread.
    reset_peak(daemon)
    before = rejected(daemon)
    sock = raw_peer(daemon.endpoint)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    huge = bytes(2 * limit)
    for _ in range(3):
        sock.send_multipart([MAGIC, BAD_TAP[1], huge], copy=False)
    for _ in range(3):
        assert monitor.poll(20_000), "the daemon did not close the connection"
        monitor.recv_multipart()
    sock.disable_monitor()
    monitor.close(linger=0)
    peak_mib = (status_kib(daemon, "VmHWM") - start_kib) / 1024
    assert peak_mib < 2 * limit / MiB, f"the daemon's peak RSS grew by {peak_mib:.0f} MiB"
    assert rejected(daemon) == before  # (refused by libzmq: never seen, so not counted)
    normal_tap_arrives(daemon, raw_peer, 3.0)


class Rogues:
    """Malformed frames from a rogue emitter and a rogue subscriber that never read
    what the daemon answers, and from peers that connect, say hello, send one bad tap
    and hang up (each connection a new identity)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.context = zmq.Context()

    def reused(self, frames: int) -> None:
        emitter, subscriber = self._socket(), self._socket()
        emitter.send_multipart(EMITTER_HELLO)
        subscriber.send_multipart(SUBSCRIBER_HELLO)
        for i in range(frames // 2):
            emitter.send_multipart(BAD_TAP)
            subscriber.send_multipart([MAGIC, b"\xc1"] if i % 2 else [b"junk"])
        self.closing = [emitter, subscriber]

    def new(self, connections: int, rejected: Callable[[], int]) -> None:
        counted = rejected()
        for start in range(0, connections, 100):
            batch = [self._socket() for _ in range(min(100, connections - start))]
            for i, sock in enumerate(batch):
                sock.send_multipart(EMITTER_HELLO)
                sock.send_multipart(BAD_TAP)
                if i % 2:  # and a subscriber too, on the same connection
                    sock.send_multipart(SUBSCRIBER_HELLO)
            counted += len(batch)
            wait_until(lambda: rejected() >= counted, "the rogues' bad taps counted")  # noqa: B023
            for sock in batch:
                sock.close(linger=0)

    def _socket(self) -> zmq.Socket[bytes]:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)  # never blocks: the daemon decides what it reads
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def close(self) -> None:
        for sock in getattr(self, "closing", []):
            sock.close(linger=0)
        self.context.term()


def tables(daemon: Daemon) -> dict[str, Any]:
    stats = daemon.stats()
    return {"emitters": len(stats["emitters"]), "subscribers": len(stats["subscribers"]),
            "reply_budgets": stats["bounds"]["reply_budgets"]}  # fmt: skip


def hostile_run(daemon: Daemon, frames: int, connections: int) -> None:
    rogues = Rogues(daemon.endpoint)
    try:
        rogues.new(connections, lambda: rejected(daemon))
        before = rejected(daemon)
        rogues.reused(frames)
        wait_until(lambda: rejected(daemon) >= before + frames, f"{frames} bad frames counted",
                   timeout=120)  # fmt: skip
    finally:
        rogues.close()
    # The tables empty again: hung-up emitters are found by the daemon's probe, the
    # subscribers time out (1 s here), and their reply budgets go with them.
    wait_until(lambda: tables(daemon) == {"emitters": 0, "subscribers": 0, "reply_budgets": 0},
               f"the per-peer tables to empty (now {tables(daemon)})", timeout=30)  # fmt: skip


@pytest.mark.timeout(300)
def test_a_long_hostile_run_leaves_memory_and_peer_tables_where_they_were(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
) -> None:
    daemon = start_daemon("--subscriber-timeout", "1")
    hostile_run(daemon, frames=10_000, connections=200)  # the allocator's pools, warmed
    start_mib = status_kib(daemon, "VmRSS") / 1024
    reset_peak(daemon)
    started = time.monotonic()
    hostile_run(daemon, frames=100_000, connections=1000)
    # Unbounded, libzmq queued the unread frames and every answer to the rogues that
    # never read them: +60 MiB at the peak here, and for as long as they stay connected.
    peak = status_kib(daemon, "VmHWM") / 1024 - start_mib
    assert peak < 24, f"the peak RSS grew by {peak:.0f} MiB ({start_mib:.0f} MiB before)"
    grown = status_kib(daemon, "VmRSS") / 1024 - start_mib
    assert grown < 16, f"RSS grew by {grown:.0f} MiB over the run ({start_mib:.0f} MiB before)"
    counters = daemon.counters()
    assert counters["taps_refused"] >= 1000 + 50_000
    assert counters["refusals_unreported"] > 0  # the rogue emitter had its share of errors
    assert daemon.stats()["bounds"]["departed_emitters"] >= 1000
    normal_tap_arrives(daemon, raw_peer, 4.0)
    assert time.monotonic() - started < 120


def test_taps_of_ever_new_names_leave_no_table_behind(
    start_daemon: Callable[..., Daemon], raw_peer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    """Valid taps, each of a consumer name never seen before (no subscriber wants them):
    what the router memoizes per name stays bounded."""
    daemon = start_daemon()
    emitter = raw_peer(daemon.endpoint)
    emitter.setsockopt(zmq.SNDHWM, 0)
    emitter.send_multipart(EMITTER_HELLO)
    arrays = [np.zeros(1, np.float32)]

    def send(first: int, count: int) -> None:
        for i in range(first, first + count):
            name = f"n{i:06d}" + "x" * 200
            emitter.send_multipart(encode("tap", {**TAP_FIELDS, "consumer": name}, arrays))
        wait_until(lambda: daemon.counters().get("taps_unrouted", 0) >= first + count,
                   f"{first + count} taps unrouted", timeout=60)  # fmt: skip

    send(0, 5000)  # the allocator's pools, warmed
    start_mib = status_kib(daemon, "VmRSS") / 1024
    send(5000, 50_000)
    grown = status_kib(daemon, "VmRSS") / 1024 - start_mib
    # One memo entry per name, unbounded: +21 MiB here.
    assert grown < 10, f"RSS grew by {grown:.0f} MiB over 50,000 names"
