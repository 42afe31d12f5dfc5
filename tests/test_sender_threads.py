"""The emitter's sender takes taps from many threads at once (as XLA calls callbacks)
and delivers every one, in order per (device, consumer), through a real daemon."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

from conftest import Daemon, SubscriberProcess
from tapd.emitter.sender import Sender, TapSite
from tapd.emitter.settings import EmitterSettings

THREADS = 8
TAPS_PER_THREAD = 200


def test_concurrent_submitters_lose_nothing_and_keep_per_device_order(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "x")
    # A small buffer makes the submitters block on each other and on the network.
    sender = Sender(EmitterSettings(endpoint=daemon.endpoint, buffer_bytes=4096))
    site = TapSite("x", {"tree": ["*"], "meta": {}, "transforms": []})
    start = threading.Barrier(THREADS)

    def submit_all(device: int) -> None:
        start.wait()
        for i in range(TAPS_PER_THREAD):
            assert sender.submit(site, [np.full(16, i, np.int32)], step=i, device=device)

    threads = [threading.Thread(target=submit_all, args=(d,)) for d in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    reply = sender.barrier(timeout=60)
    sender.close(timeout=5)

    assert reply["delivered"] == THREADS * TAPS_PER_THREAD
    records = subscriber.records()
    assert len(records) == THREADS * TAPS_PER_THREAD
    for device in range(THREADS):
        mine = [r for r in records if r["device"] == device]
        assert [r["seq"] for r in mine] == list(range(TAPS_PER_THREAD))
        assert [r["value"][0] for r in mine] == list(range(TAPS_PER_THREAD))
