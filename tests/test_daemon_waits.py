"""No wait on a daemon without a word (issue 42): every wait on a daemon (a barrier, the
exit drain, a subscriber's connect, the CLI) says within seconds when no daemon answers
at its endpoint, naming the endpoint and what waits, and fails where nobody starts one
on demand (TAPD_AUTOSTART=0, as every test here has: conftest.py); a daemon that is
there but slow, or stopped and continued, is waited for (tapd/clients/liveness.py).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    APPS,
    PROCESS_TIMEOUT,
    Daemon,
    SubscriberProcess,
    tapd_cmd,
    wait_until,
)

WORD_WITHIN = 15.0  # s: a warning or an error comes within seconds (loaded CI: generous)
TAPS = 20


class WaitingEmitter:
    """tests/apps/daemon_wait_app.py, its stdout and stderr read as they come."""

    def __init__(self, endpoint: str, env: dict[str, str]) -> None:
        full_env = {**os.environ, "TAPD_ENDPOINT": endpoint, **env}
        self.process = subprocess.Popen(
            [sys.executable, str(APPS / "daemon_wait_app.py"), str(TAPS)],
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[dict[str, Any]] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, True), daemon=True),
            threading.Thread(target=self._read, args=(self.process.stderr, False), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Any, is_out: bool) -> None:
        for line in stream:
            if is_out and line.startswith("{"):
                self.out.append(json.loads(line))
            elif not is_out:
                self.err.append(line)

    def said(self, key: str) -> dict[str, Any] | None:
        return next((line for line in self.out if key in line), None)

    def wait_for(self, key: str, timeout: float = PROCESS_TIMEOUT) -> dict[str, Any]:
        found: dict[str, Any] = wait_until(
            lambda: self.said(key) or (self.process.poll() is not None and self.said(key)),
            f"the emitter to say {key!r}:\n{''.join(self.err)}",
            timeout,
        )
        return found

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def warning(self, *words: str) -> str | None:
        return next((line for line in self.err if all(w in line for w in words)), None)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=PROCESS_TIMEOUT)
        for reader in self._readers:
            reader.join(timeout=10)
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def start_emitter() -> Iterator[Callable[..., WaitingEmitter]]:
    started: list[WaitingEmitter] = []

    def start(endpoint: str, **env: str) -> WaitingEmitter:
        emitter = WaitingEmitter(endpoint, env)
        started.append(emitter)
        return emitter

    yield start
    for emitter in started:
        emitter.close()


@pytest.fixture
def stoppable(start_daemon: Callable[..., Daemon]) -> Iterator[Daemon]:
    """A daemon that a test may SIGSTOP: continued before it is stopped for good."""
    daemon = start_daemon()
    try:
        yield daemon
    finally:
        if daemon.process.poll() is None:
            daemon.process.send_signal(signal.SIGCONT)


def _snippet_env(runtime_dir: Path) -> dict[str, str]:
    """This user's default endpoint in `runtime_dir`, autostart off."""
    env = {k: v for k, v in os.environ.items() if k != "TAPD_ENDPOINT"}
    return {**env, "TAPD_RUNTIME_DIR": str(runtime_dir), "TAPD_AUTOSTART": "0"}


SNIPPET = """
import jax, jax.numpy as jnp, tapd
f = jax.jit(lambda x: tapd.tap(x, "loss") + 1)
f(jnp.float32(1)).block_until_ready()
tapd.barrier_wait()
"""


@pytest.mark.parametrize("left", ["nothing", "a dead daemon's socket"])
def test_no_daemon_with_autostart_off_fails_the_first_tap_at_once(
    backend: str, runtime_dir: Path, left: str
) -> None:
    """The issue's program: the tap fails at its call, naming the endpoint and
    TAPD_AUTOSTART, whether there is no socket or one a killed daemon left."""
    env = _snippet_env(runtime_dir)
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    if left != "nothing":
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tapd", "start"], env=env, stdout=subprocess.PIPE, text=True
        )
        assert daemon.stdout is not None
        assert daemon.stdout.readline().startswith("tapd ready:")
        daemon.kill()
        daemon.wait(timeout=PROCESS_TIMEOUT)
        daemon.stdout.close()
        assert (runtime_dir / "tapd.sock").exists()
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - started
    assert run.returncode != 0
    raised = [line for line in run.stderr.splitlines() if line.startswith("tapd.errors.")]
    assert raised and raised[-1].startswith("tapd.errors.TapDefinitionError:"), run.stderr
    last = raised[-1]
    assert endpoint in last and "TAPD_AUTOSTART=0" in last and "tapd start" in last
    if left != "nothing":
        assert "left by a daemon that is gone" in last
    assert took < 30, f"{took:.1f} s (JAX's import included)"


@pytest.mark.waits
def test_a_barrier_on_a_daemon_killed_warns_then_fails(
    backend: str,
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_emitter: Callable[..., WaitingEmitter],
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss", sleep_ms=300, window=1)  # (~6 s of taps)
    emitter = start_emitter(daemon.endpoint, TAPD_CONNECT_TIMEOUT="4", TAPD_EXIT_TIMEOUT="1")
    assert emitter.wait_for("ready")["ready"] == backend
    emitter.go()
    emitter.wait_for("tapped")
    wait_until(lambda: len(subscriber.records()) >= 2, "the barrier's taps being handled")
    daemon.process.kill()  # (during the barrier: its taps are not all handled yet)
    went = time.monotonic()
    assert emitter.said("barrier") is None and len(subscriber.records()) <= TAPS
    daemon.process.wait(timeout=PROCESS_TIMEOUT)
    wait_until(
        lambda: emitter.warning("barrier_wait waits for", daemon.endpoint, f"{TAPS} taps"),
        f"a warning:\n{''.join(emitter.err)}",
        WORD_WITHIN,
    )
    warned = time.monotonic() - went
    ended = emitter.wait_for("barrier", WORD_WITHIN + 4)
    failed = time.monotonic() - went
    assert ended["barrier"] == "DaemonUnreachable", ended
    message = ended["message"]
    assert daemon.endpoint in message and "TAPD_AUTOSTART=0" in message, message
    assert f"gives up on {TAPS} taps" in message, message
    warning = emitter.warning("barrier_wait waits for")
    assert warning is not None and "gone" in warning and "fails if none answers" in warning
    # It gave a daemon that might come back the connect timeout, from the first look.
    assert 4 <= ended["waited"] < 4 + WORD_WITHIN, ended
    assert warned < failed


@pytest.mark.waits
def test_a_barrier_on_a_stopped_daemon_warns_and_passes_once_it_continues(
    backend: str,
    stoppable: Daemon,
    start_subscriber: Callable[..., SubscriberProcess],
    start_emitter: Callable[..., WaitingEmitter],
) -> None:
    daemon = stoppable
    subscriber = start_subscriber(daemon, "loss")
    emitter = start_emitter(daemon.endpoint, TAPD_CONNECT_TIMEOUT="120")
    assert emitter.wait_for("ready")["ready"] == backend
    wait_until(lambda: len(subscriber.records()) == 1, "the first tap")
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        emitter.go()
        emitter.wait_for("tapped")
        pid = daemon.process.pid
        words = ("barrier_wait waits for", f"{TAPS} taps", daemon.endpoint, f"pid {pid}")
        warning = wait_until(
            lambda: emitter.warning(*words), f"a warning:\n{''.join(emitter.err)}", WORD_WITHIN
        )
        assert "is stopped" in warning, warning
        assert emitter.said("barrier") is None
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    ended = emitter.wait_for("barrier")
    assert ended["barrier"] == "passed", ended
    assert [r["step"] for r in subscriber.records()] == list(range(TAPS + 1))


@pytest.mark.waits
def test_a_subscriber_connecting_to_a_stopped_daemon_says_so_then_times_out(
    stoppable: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    from tapd_client import Subscriber

    sub = Subscriber(stoppable.endpoint)
    sub.add_handler("loss", lambda arg, meta: None)
    stoppable.process.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        with (
            caplog.at_level(logging.WARNING, logger="tapd.subscriber"),
            pytest.raises(TimeoutError, match="no tapd daemon answered"),
        ):
            sub.connect(timeout=4)
    finally:
        stoppable.process.send_signal(signal.SIGCONT)
        sub.close()
    assert time.monotonic() - started < 4 + WORD_WITHIN
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = [w for w in warnings if stoppable.endpoint in w and "is stopped" in w]
    assert said and "gives up in" in said[0], warnings


@pytest.mark.parametrize("command", [["status"], ["tail", "loss"]])
def test_cli_commands_with_no_daemon_say_so_within_seconds(
    runtime_dir: Path, command: list[str]
) -> None:
    env = _snippet_env(runtime_dir)
    started = time.monotonic()
    result = tapd_cmd(*command, env=env, timeout=PROCESS_TIMEOUT)
    assert time.monotonic() - started < WORD_WITHIN
    assert result.returncode == 3, result.stderr  # ExitCode.UNREACHABLE
    assert f"ipc://{runtime_dir}/tapd.sock" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_barrier_on_a_slow_daemon_waits_past_the_connect_timeout_without_a_word(
    backend: str,
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    start_emitter: Callable[..., WaitingEmitter],
) -> None:
    """Slow subscribers make a long barrier, not a failed one: the daemon answers."""
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss", sleep_ms=150, window=1)
    emitter = start_emitter(daemon.endpoint, TAPD_CONNECT_TIMEOUT="1")
    assert emitter.wait_for("ready")["ready"] == backend
    emitter.go()
    ended = emitter.wait_for("barrier")
    assert ended["barrier"] == "passed", ended
    assert ended["waited"] > 1.5, ended  # (20 taps at 150 ms: past the connect timeout)
    assert [r["step"] for r in subscriber.records()] == list(range(TAPS + 1))
    assert emitter.warning("no tapd daemon answers") is None, "".join(emitter.err)


class _Looks:
    """A stand-in for liveness.look and the clock: what each look finds, and when."""

    def __init__(self, states: list[str]) -> None:
        self.states = states
        self.now = 0.0

    def look(self, endpoint: str) -> Any:
        from tapd.clients.liveness import Sighting

        self.now += 1.0  # (a look that gets no answer takes its timeout)
        return Sighting(endpoint, self.states.pop(0), 4242)


@pytest.mark.fast
@pytest.mark.parametrize(
    ("state", "autostart", "fails"),
    [("gone", "0", True), ("stopped", "0", True), ("running", "0", False), ("gone", "1", False)],
)
def test_a_watch_warns_every_ten_seconds_and_fails_only_where_nobody_starts_a_daemon(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    state: str,
    autostart: str,
    fails: bool,
) -> None:
    from tapd.clients import liveness
    from tapd.errors import DaemonUnreachable
    from tapd.settings import default_endpoint

    monkeypatch.setenv("TAPD_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("TAPD_AUTOSTART", autostart)
    looks = _Looks([state] * 40)
    monkeypatch.setattr(liveness, "look", looks.look)
    endpoint = default_endpoint()
    log = logging.getLogger("tapd.test")
    watch = liveness.DaemonWatch(
        endpoint, waiting_for="the wait", log=log, fail_after=25.0, clock=lambda: looks.now
    )
    failed: DaemonUnreachable | None = None
    with caplog.at_level(logging.WARNING, logger="tapd.test"):
        while looks.now < 35 and failed is None:
            try:
                watch.check(lambda: "3 taps")
            except DaemonUnreachable as exc:
                failed = exc
            looks.now += 0.25
    warnings = [r.getMessage() for r in caplog.records]
    assert all("the wait waits for 3 taps" in w and endpoint in w for w in warnings), warnings
    if fails:
        assert failed is not None and 25 <= looks.now < 28
        assert "TAPD_AUTOSTART=0" in str(failed) and "gives up on 3 taps" in str(failed)
        assert len(warnings) == 3  # at its first look, 10 s and 20 s after
    else:
        assert failed is None
        assert len(warnings) == 4, warnings
