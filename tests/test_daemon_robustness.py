"""Bad input to a real daemon: rejected, counted by reason, and nothing else lost."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable

import msgpack
import numpy as np
import zmq

from conftest import APPS, Daemon, SubscriberProcess, run_emitter, wait_until
from tapd.protocol import MAGIC, encode

TAP_FIELDS = {
    "consumer": "loss", "seq": 0, "step": None, "device": None, "process": 0, "host": "h",
    "pid": 1, "time": 0, "transforms": [], "meta": {}, "tree": ["*"],
}  # fmt: skip


def test_malformed_frames_are_rejected_counted_and_the_daemon_serves_on(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
) -> None:
    daemon = start_daemon("--max-message-bytes", "1000")
    subscriber = start_subscriber(daemon, "loss")
    good = encode("tap", TAP_FIELDS, [np.zeros(4, np.float32)])
    oversized = encode("tap", TAP_FIELDS, [np.zeros(1000, np.float32)])
    truncated = [*good[:2], bytes(good[2])[:7]]
    wrong_version = [b"TAPD\x09", *good[1:]]
    not_msgpack = [MAGIC, b"\xc1\xc1\xc1"]
    unknown_kind = [MAGIC, msgpack.packb({"kind": "launch_missiles"})]
    sock = raw_peer(daemon.endpoint)
    for frames in (
        [b"garbage"],
        [b"garbage", b"more"],
        truncated,
        wrong_version,
        not_msgpack,
        unknown_kind,
        oversized,
    ):
        sock.send_multipart(frames)

    expected = {
        "rejected_bad_frames": 2,
        "rejected_bad_magic": 1,
        "rejected_bad_version": 1,
        "rejected_bad_header": 2,
        "rejected_too_large": 1,
    }
    wait_until(
        lambda: all(daemon.counters().get(k) == v for k, v in expected.items()),
        f"the daemon to count {expected}",
    )
    assert daemon.process.poll() is None
    # Real taps still flow, from a real JAX process.
    result = run_emitter(daemon.endpoint, "steps", "5")
    assert result["stats"]["delivered"] == 5
    assert [r["value"] for r in subscriber.records()] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_portable_emitter_killed_without_a_bye_is_forgotten(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss")
    env = {**os.environ, "TAPD_ENDPOINT": daemon.endpoint, "TAPD_BACKEND": "portable"}
    emitter = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "taps_then_hang",
                                "5"], env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert emitter.stdout is not None
        assert emitter.stdout.readline().strip() == "TAPPED"
        wait_until(lambda: len(subscriber.records()) == 5, "the 5 taps to be handled")
        assert [e["name"] for e in daemon.stats()["emitters"]] == [
            f"{socket.gethostname()}:{emitter.pid}"
        ]
    finally:
        emitter.kill()
        emitter.communicate(timeout=30)  # reaps it and closes its stdout
    wait_until(lambda: daemon.stats()["emitters"] == [], "the daemon to forget the dead emitter")
