"""An emitter's counts across a daemon restart (issue 10, item 7): every tap is counted
once, by the daemon that finished it, and the exit check does not cry wolf."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from conftest import APPS, Daemon, SubscriberProcess, wait_until


def test_delivered_counts_the_taps_of_both_daemons_and_exit_is_quiet(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    backend: str,
) -> None:
    first = start_daemon()
    subscriber = start_subscriber(first, "loss")
    env = {**os.environ, "TAPD_ENDPOINT": first.endpoint}
    emitter = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "paced", "60",
                                "20"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until(lambda: len(subscriber.records()) >= 20, "taps flowing to the first daemon")
        assert first.stop() == 0  # drains, tells its emitters their totals, exits
        second = start_daemon("--startup-grace", "3")
        out, err = emitter.communicate(timeout=120)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate(timeout=30)
    assert emitter.returncode == 0, err
    stats = __import__("json").loads(out.strip().splitlines()[-1])["stats"]
    wait_until(lambda: len(subscriber.records()) >= stats["delivered"], "the handled taps")
    handled = {r["seq"] for r in subscriber.records()}
    assert stats["delivered"] >= len(handled) > 20, (stats, len(handled))
    assert stats["delivered"] + stats["unrouted"] <= stats["sent"] + 64  # re-reads, at most
    if len(handled) == 60:
        assert "not every tap was delivered" not in err and "tapd at exit" not in err, err
    assert second.process.poll() is None
