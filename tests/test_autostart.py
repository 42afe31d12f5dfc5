"""The first client on the default endpoint starts the daemon (issue 19, part 1).

Each test has a private runtime directory (`TAPD_RUNTIME_DIR`), so the default endpoint
is its own; every daemon a test starts on demand is stopped by pid at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import native_unavailable, tapd_cmd, wait_until
from tapd.autostart import wait_ready
from tapd.errors import DaemonUnreachable
from tapd.runtime import flock_holder, pid_alive

PY = sys.executable


@pytest.fixture
def home(runtime_dir: Path) -> Iterator[dict[str, str]]:
    """An environment whose default endpoint lives in `runtime_dir`, nothing else set."""
    # (TAPD_AUTOSTART unset: autostart is the default.)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPD_")}
    env.update(TAPD_RUNTIME_DIR=str(runtime_dir))
    yield env
    for pid in _daemon_pids(runtime_dir):
        _stop(pid)


def _daemon_pids(runtime_dir: Path) -> list[int]:
    """Every process whose command line is a `tapd start` in this runtime directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = f"TAPD_RUNTIME_DIR={runtime_dir}".encode() in environ
        if ours and b"start" in cmdline and b"tapd" in cmdline:
            pids.append(int(entry.name))
    return pids


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def _status(env: dict[str, str]) -> dict[str, object]:
    result = tapd_cmd("status", "--json", env=env)
    assert result.returncode == 0, result.stderr
    status: dict[str, object] = json.loads(result.stdout)
    return status


FIRST_TAP = """
import os
import jax, jax.numpy as jnp
import tapd as hcb
seen = []
@jax.jit
def f(x):
    return hcb.id_tap(lambda arg, transforms: seen.append(int(arg)), x * 2)
f(jnp.int32(21)); hcb.barrier_wait()
print("seen", seen, "pid", os.getpid())
"""


def test_first_tap_starts_a_daemon_that_leaves_when_idle(
    home: dict[str, str], runtime_dir: Path, backend: str
) -> None:
    env = {**home, "TAPD_BACKEND": backend, "TAPD_IDLE_EXIT": "2"}
    run = subprocess.run(
        [PY, "-c", FIRST_TAP], env=env, capture_output=True, text=True, timeout=120
    )
    last_client_gone = time.monotonic()
    assert run.returncode == 0, run.stderr
    assert "seen [42]" in run.stdout
    emitter_pid = int(run.stdout.split("pid")[-1])
    pids = _daemon_pids(runtime_dir)
    assert len(pids) == 1, pids
    status = _status(env)  # (a client too, for a moment)
    assert status["pid"] == pids[0]
    assert status["started"] == {"on_demand": True, "by": emitter_pid, "idle_exit": 2.0}
    # No emitter and no subscriber: it drains and leaves after --idle-exit seconds.
    wait_until(lambda: not pid_alive(pids[0]), "the on-demand daemon to exit when idle", 30)
    assert time.monotonic() - last_client_gone >= 1.5  # (idle from its bye, just before)
    assert not (runtime_dir / "tapd.sock").exists()


def test_eight_processes_that_start_at_once_share_one_daemon(
    home: dict[str, str], runtime_dir: Path
) -> None:
    probe = (
        "from tapd.autostart import ensure_daemon; from tapd.runtime import "
        "default_endpoint; from tapd.clients import control; ensure_daemon(default_endpoint()); "
        "print(control.stats(default_endpoint())['pid'])"
    )
    processes = [
        subprocess.Popen(
            [PY, "-c", probe], env=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(8)
    ]
    results = [(process, *process.communicate(timeout=120)) for process in processes]
    answers = set()
    for process, out, err in results:
        assert process.returncode == 0, err
        answers.add(int(out.strip()))
    assert len(answers) == 1, answers
    (daemon,) = answers
    wait_until(lambda: _daemon_pids(runtime_dir) == [daemon], "only one daemon to stay", 30)


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("winner", ["alive", "none"])
def test_a_caller_whose_daemon_lost_the_lock_waits_for_the_winner(
    runtime_dir: Path, winner: str
) -> None:
    """Ours exited "already running": while the lock's holder lives, the caller waits for
    it (on a loaded box a winner may take seconds to serve), to the end of its timeout;
    with nobody holding the lock it fails within a few seconds, naming our log."""
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    lock = runtime_dir / "tapd.sock.lock"
    log = runtime_dir / "tapd.log"
    log.write_text("tapd.cli ERROR another tapd daemon is already running\n")
    ours = subprocess.run(
        [PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    holder = None
    if winner == "alive":
        holder = subprocess.Popen(
            [PY, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True
        )
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert flock_holder(lock) == holder.pid
    else:
        lock.touch()
        assert flock_holder(lock) is None
    started = time.monotonic()
    try:
        with pytest.raises(DaemonUnreachable) as raised:
            wait_ready(endpoint, int(ours.stdout), log, timeout=6.0)
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate()
    waited = time.monotonic() - started
    if winner == "alive":
        assert "no tapd daemon answered" in str(raised.value) and waited >= 6.0
    else:
        assert "exited without serving" in str(raised.value) and "already running" in str(
            raised.value
        )
        assert waited < 6.0


def test_a_stale_pidfile_and_a_dead_socket_are_no_obstacle(
    home: dict[str, str], runtime_dir: Path
) -> None:
    dead = subprocess.run(
        [PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    (runtime_dir / "tapd.pid").write_text(dead.stdout)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(runtime_dir / "tapd.sock"))  # bound, then closed: nobody listens
    stale.close()
    probe = (
        "from tapd_client import Subscriber\nsub = Subscriber()\n"
        "sub.add_handler('x', lambda arg, meta: None)\nwith sub: print('connected')"
    )
    run = subprocess.run([PY, "-c", probe], env=home, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "connected" in run.stdout
    assert len(_daemon_pids(runtime_dir)) == 1


def test_tail_starts_the_daemon_too(home: dict[str, str], runtime_dir: Path) -> None:
    tail = subprocess.Popen(
        [PY, "-m", "tapd", "tail", "anything"],
        env=home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        status = wait_until(lambda: _try_status(home), "the daemon tail started", 30)
        assert status["started"]["on_demand"] is True
        wait_until(lambda: _try_status(home)["subscribers"], "tail to subscribe", 30)
    finally:
        tail.send_signal(signal.SIGINT)
        tail.communicate(timeout=30)


def _try_status(env: dict[str, str]) -> dict[str, object] | None:
    result = tapd_cmd("status", "--json", env=env)
    return json.loads(result.stdout) if result.returncode == 0 else None


@pytest.mark.parametrize("client", ["emitter", "subscriber"])
def test_autostart_off_fails_at_once_with_a_clear_message(
    home: dict[str, str], runtime_dir: Path, client: str
) -> None:
    env = {**home, "TAPD_AUTOSTART": "0"}
    if client == "emitter":
        if native_unavailable() is None:
            env["TAPD_BACKEND"] = "native"
        code = FIRST_TAP
    else:
        code = (
            "from tapd_client import Subscriber\nsub = Subscriber()\n"
            "sub.add_handler('x', lambda arg, meta: None)\nsub.connect()"
        )
    started = time.monotonic()
    run = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "TAPD_AUTOSTART=0" in run.stderr and "tapd start" in run.stderr
    # The whole interpreter (JAX import included) ran; the wait itself was not 10 s.
    assert time.monotonic() - started < 10
    assert _daemon_pids(runtime_dir) == []


def test_a_daemon_started_by_hand_never_idles_out(home: dict[str, str], runtime_dir: Path) -> None:
    started = tapd_cmd("start", "--detach", env=home)
    assert started.returncode == 0, started.stderr
    status = _status(home)
    # No idle limit at all (an on-demand daemon's is 600 s unless set): it never leaves
    # by itself, and a client that comes and goes does not change that.
    assert status["started"] == {"on_demand": False, "by": None, "idle_exit": None}
    probe = (
        "from tapd_client import Subscriber\nsub = Subscriber()\n"
        "sub.add_handler('x', lambda arg, meta: None)\nwith sub: pass"
    )
    subprocess.run([PY, "-c", probe], env=home, check=True, timeout=60)
    assert _status(home)["pid"] == status["pid"]


def test_no_autostart_for_an_endpoint_someone_configured(
    home: dict[str, str], runtime_dir: Path
) -> None:
    other = runtime_dir / "elsewhere.sock"
    code = (
        f"from tapd_client import Subscriber\nsub = Subscriber('ipc://{other}')\n"
        "sub.add_handler('x', lambda arg, meta: None)\nsub.connect(timeout=0.5)"
    )
    run = subprocess.run([PY, "-c", code], env=home, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "TimeoutError" in run.stderr and str(other) in run.stderr  # waited, started none
    assert _daemon_pids(runtime_dir) == []
