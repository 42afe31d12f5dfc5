"""`tapd top` against a real daemon with taps flowing: one frame (`--once`), and the live
view in a real terminal (tmux: capture-pane to read it, send-keys to sort and quit)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from conftest import APPS, Daemon, SubscriberProcess, stop_process, tapd_cmd, wait_until

CONSUMERS = "CONSUMERS (one row per subscriber, and per worker pool)\n"


@pytest.fixture
def flowing(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> Iterator[tuple[Daemon, subprocess.Popen[str]]]:
    """A daemon, a subscriber for "loss", and a JAX emitter tapping it every 20 ms."""
    daemon = start_daemon()
    start_subscriber(daemon, "loss")
    emitter = subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), "paced", "1000", "20"],
        env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint}, stdout=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    wait_until(lambda: sum(e["taps"] for e in daemon.stats()["emitters"]) >= 5, "taps flowing")
    yield daemon, emitter
    stop_process(emitter)


def test_once_shows_emitters_and_consumers(flowing: tuple[Daemon, subprocess.Popen[str]]) -> None:
    daemon, emitter = flowing
    result = tapd_cmd("top", "--once", "--interval", "0.5", "--endpoint", daemon.endpoint)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"tapd top - {daemon.endpoint}"), out
    assert re.search(r"received [\d,]+ taps \([\d.,]+/s", out), out
    emitters = out.split("EMITTERS\n")[1].split("\n\n")[0].splitlines()
    assert emitters[0].split()[:3] == ["name", "taps/s", "MB/s"]
    row = emitters[1].split()
    assert row[0].endswith(f":{emitter.pid}") and float(row[1]) > 5, out  # ~50 taps/s
    # the emitter's lag: the newest of its taps that a subscriber handled
    assert emitters[0].split()[-1] == "lag" and 0 <= float(row[8][:-1]) < 10, out
    consumers = out.split(CONSUMERS)[1].splitlines()
    row = consumers[1].split()
    assert row[0] == "loss" and float(row[2]) > 5, out
    handled = int(row[7].replace(",", ""))
    assert 5 <= handled <= daemon.stats()["subscribers"][0]["delivered"]
    # lag: the daemon's now minus meta.time of the last tap handled; a tap every 20 ms
    assert consumers[0].split()[-1] == "lag" and re.fullmatch(r"\d+\.\ds", row[10]), out
    assert 0 <= float(row[10][:-1]) < 10, out

    # Once the taps stop, the lag grows: the last tap handled was tapped before `stopped`,
    # and top's second sample comes at least --interval (0.5 s) after it.
    stop_process(emitter)
    stopped = time.time()
    result = tapd_cmd("top", "--once", "--interval", "0.5", "--endpoint", daemon.endpoint)
    row = result.stdout.split(CONSUMERS)[1].splitlines()[1].split()
    lag = float(row[10][:-1])
    assert 0.45 <= lag <= time.time() - stopped + 10, result.stdout  # (0.45: .1f rounding)


def test_unreachable_daemon(tmp_path: os.PathLike[str]) -> None:
    result = tapd_cmd("top", "--once", "--endpoint", f"ipc://{tmp_path}/none.sock")
    assert result.returncode == 3 and "no tapd daemon answered" in result.stderr


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_live_in_a_terminal(flowing: tuple[Daemon, subprocess.Popen[str]]) -> None:
    daemon, _ = flowing
    server = f"tapd-test-{uuid.uuid4().hex[:8]}"

    def tmux(*args: str) -> str:
        done = subprocess.run(["tmux", "-L", server, *args], capture_output=True, text=True,
                              timeout=10)  # fmt: skip
        return done.stdout

    command = f"{sys.executable} -m tapd top --interval 0.3 --endpoint {daemon.endpoint}"
    tmux("new-session", "-d", "-s", "top", "-x", "200", "-y", "40", command)
    try:
        screen = wait_until(
            lambda: (text := tmux("capture-pane", "-p", "-t", "top")) and "CONSUMERS" in text
            and re.search(r"^loss\s+\S+\s+[1-9]", text, re.M) and text,
            "a frame with the consumer's rate",
        )  # fmt: skip
        assert "sort: rate (s)" in screen
        assert re.search(r"^loss\s.*\s\d+\.\ds$", screen, re.M), screen  # the lag column
        tmux("send-keys", "-t", "top", "s")
        wait_until(lambda: "sort: name (s)" in tmux("capture-pane", "-p", "-t", "top"),
                   "the sort key to take")  # fmt: skip
        tmux("send-keys", "-t", "top", "q")
        wait_until(lambda: "top" not in tmux("list-sessions"), "q to quit tapd top")
    finally:
        tmux("kill-server")
