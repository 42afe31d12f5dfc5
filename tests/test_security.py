"""CurveZMQ on tcp endpoints: keys required, allowed peers served, others refused and
counted; and the ipc side's private directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import APPS, Daemon, SubscriberProcess, keygen, run_emitter, tapd_cmd, wait_until
from tapd.cli.exit_codes import ExitCode


def test_keygen_writes_a_public_key_and_a_private_key_pair(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "daemon")
    assert "public-key" in public.read_text() and "secret-key" not in public.read_text()
    assert "secret-key" in secret.read_text()
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    again = tapd_cmd("keygen", "daemon", "--dir", str(tmp_path))
    assert again.returncode == ExitCode.CONFIG and "not overwriting" in again.stderr


def test_tcp_without_keys_is_refused_unless_insecure(runtime_dir: Path) -> None:
    result = tapd_cmd("start", "--endpoint", f"ipc://{runtime_dir}/t.sock",
                      "--tcp", "tcp://127.0.0.1:0")  # fmt: skip
    assert result.returncode == ExitCode.CONFIG
    assert "needs CurveZMQ" in result.stderr and "--insecure" in result.stderr


def test_allowed_key_is_served_and_an_unknown_key_refused_logged_and_counted(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    tmp_path: Path,
) -> None:
    _, daemon_secret = keygen(tmp_path / "daemon", "daemon")
    allowed = tmp_path / "allowed"
    friend_public, friend_secret = keygen(tmp_path / "friend", "friend")
    allowed.mkdir()
    (allowed / "friend.key").write_text(friend_public.read_text())
    _, stranger_secret = keygen(tmp_path / "stranger", "stranger")
    daemon = start_daemon("--tcp", "tcp://127.0.0.1:0", "--curve-secret-key",
                          str(daemon_secret), "--curve-allowed", str(allowed))  # fmt: skip
    remote = daemon.endpoints[1]
    server_key = str(tmp_path / "daemon" / "daemon.key")

    friend = start_subscriber(daemon, "loss", endpoint=remote,
                              env={"TAPD_CURVE_SERVER_KEY": server_key,
                                   "TAPD_CURVE_SECRET": str(friend_secret)})  # fmt: skip
    stranger = subprocess.Popen(
        [sys.executable, str(APPS / "subscriber_app.py"), "--endpoint", remote,
         "--record", str(tmp_path / "stranger.jsonl"), "loss"],
        env={**os.environ, "TAPD_CURVE_SERVER_KEY": server_key,
             "TAPD_CURVE_SECRET": str(stranger_secret)},
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_until(lambda: daemon.counters().get("auth_refused", 0) >= 1, "a refusal")
        run_emitter(daemon.endpoint, "steps", "3")
        assert [r["value"] for r in friend.records()] == [0.0, 1.0, 2.0]
        assert daemon.subscriber_count() == 1  # the stranger never got in
        assert "not in the allowed keys" in daemon.log()
    finally:
        stranger.kill()
        stranger.communicate(timeout=30)
    assert not (tmp_path / "stranger.jsonl").read_text()  # it received nothing


def test_clients_with_no_key_or_the_wrong_server_key_are_counted_as_refused(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """Issue 10, item 14: CURVE refuses these before ZAP is asked; they count too."""
    import zmq

    _, daemon_secret = keygen(tmp_path / "daemon", "daemon")
    friend_public, friend_secret = keygen(tmp_path / "friend", "friend")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "friend.key").write_text(friend_public.read_text())
    wrong_public, _ = keygen(tmp_path / "wrong", "wrong")
    daemon = start_daemon("--tcp", "tcp://127.0.0.1:0", "--curve-secret-key",
                          str(daemon_secret), "--curve-allowed", str(allowed))  # fmt: skip
    remote = daemon.endpoints[1]
    context = zmq.Context()
    try:
        plain = context.socket(zmq.DEALER)  # no key at all
        plain.connect(remote)
        plain.send(b"hello?")
        wait_until(lambda: daemon.counters().get("auth_refused", 0) >= 1, "the keyless client")
        from tapd.security import ClientKeys

        keys = ClientKeys.from_files(wrong_public, friend_secret)  # an allowed key, wrong server
        mistaken = context.socket(zmq.DEALER)
        keys.apply(mistaken)
        mistaken.connect(remote)
        mistaken.send(b"hello?")
        wait_until(lambda: daemon.counters().get("auth_refused", 0) >= 2, "the wrong server key")
    finally:
        context.destroy(linger=0)

    # The daemon counts a refusal, then logs it: wait for the line, never race it. The
    # keyless client is named by what libzmq saw first: the mechanism mismatch, or (when
    # the client saw it first and hung up) a failed write.
    def logged() -> bool:
        log = daemon.log()
        keyless = "no key" in log or "hung up during the handshake (a client with no key" in log
        return keyless and "wrong server key" in log

    wait_until(logged, "both refusals in the daemon's log")
    assert daemon.subscriber_count() == 0
