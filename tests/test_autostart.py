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
from tapd.autostart import READY_TIMEOUT, launch_detached, wait_ready
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


# The first tap for another process: id_print's printer is importable, so its taps go
# through the daemon (a subscriber may take them; else this process prints them). Taps of
# closures and tapd.debug never leave the process and start no daemon (test_local_path.py).
FIRST_TAP = """
import os
import jax, jax.numpy as jnp
import tapd as hcb
@jax.jit
def f(x):
    return hcb.id_print(x * 2, what="first")
f(jnp.int32(21)); hcb.barrier_wait()
import json
from tapd.clients import control
from tapd.runtime import default_endpoint
print("status", json.dumps(control.stats(default_endpoint())))  # (still its client)
print("pid", os.getpid())
import time
print("left_at", time.monotonic())  # (CLOCK_MONOTONIC: one clock for every process)
"""


@pytest.mark.waits
def test_first_tap_starts_a_daemon_that_leaves_when_idle(
    home: dict[str, str], runtime_dir: Path, backend: str
) -> None:
    # The daemon's status is asked by the emitter itself, before it leaves: a `tapd
    # status` started after it (a cold Python, seconds on a loaded box) raced the idle exit.
    env = {**home, "TAPD_BACKEND": backend, "TAPD_IDLE_EXIT": "6"}
    run = subprocess.run(
        [PY, "-c", FIRST_TAP], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "what: first\n42\n" in run.stdout
    emitter_pid = int(run.stdout.split("pid ")[-1].split("\n")[0])
    # Its last client left after this line (its bye comes at exit): the idle exit is
    # timed from no earlier than here (less the daemon's poll, <= 0.5 s).
    left_at = float(run.stdout.split("left_at ")[-1])
    pids = _daemon_pids(runtime_dir)
    assert len(pids) == 1, pids
    status = json.loads(run.stdout.split("status ")[1].split("\n")[0])
    assert status["pid"] == pids[0]
    assert status["started"] == {"on_demand": True, "by": emitter_pid, "idle_exit": 6.0}
    # No emitter and no subscriber: it drains and leaves after --idle-exit seconds.
    wait_until(lambda: not pid_alive(pids[0]), "the on-demand daemon to exit when idle", 30)
    # (Not from this process's return: its teardown after the bye, JAX's included, can
    # take seconds on a loaded box, and the idle time runs from the bye.)
    assert time.monotonic() - left_at >= 5.0
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


def _exited_pid() -> int:
    """The pid of a process that has come and gone: ours, after it lost the lock."""
    done = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(done.stdout)


@pytest.mark.waits
@pytest.mark.parametrize("winner", ["holds the lock", "wrote the pidfile"])
def test_a_caller_whose_daemon_lost_the_lock_waits_for_the_winner(
    runtime_dir: Path, winner: str
) -> None:
    """Ours exited "already running": while the winner lives (its lock in /proc/locks, or
    its pid in the pidfile it writes once it holds the lock, where /proc/locks does not
    say), the caller waits for it to the end of its timeout (a loaded box's winner may
    take seconds to serve), and starts no other."""
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    lock, pidfile, log = (runtime_dir / name for name in ("tapd.sock.lock", "tapd.pid", "tapd.log"))
    ours = _exited_pid()
    log.write_text(f"tapd.cli[{ours}] ERROR another tapd daemon is already running\n")
    holder = subprocess.Popen([PY, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    relaunched: list[int] = []

    def relaunch() -> int:
        relaunched.append(1)
        return ours

    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        if winner == "holds the lock":
            assert flock_holder(lock) == holder.pid
        else:
            pidfile.write_text(f"{holder.pid}\n")
            endpoint = f"ipc://{runtime_dir}/elsewhere"  # its lock: as if /proc/locks did not say
        started = time.monotonic()
        with pytest.raises(DaemonUnreachable) as raised:
            wait_ready(endpoint, ours, log, 6.0, pidfile=pidfile, relaunch=relaunch)
    finally:
        holder.kill()
        holder.communicate()
    assert "no tapd daemon answered" in str(raised.value)
    assert time.monotonic() - started >= 6.0
    assert not relaunched


def test_a_caller_whose_daemon_lost_to_a_daemon_now_gone_starts_another(
    home: dict[str, str], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ours exited "already running", and the winner exited before it served: nobody
    holds the lock, so the caller starts a daemon again, and that one serves."""
    monkeypatch.setenv("TAPD_RUNTIME_DIR", str(runtime_dir))
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    (runtime_dir / "tapd.sock.lock").touch()
    log, pidfile = runtime_dir / "tapd.log", runtime_dir / "tapd.pid"
    ours = _exited_pid()
    log.write_text(f"tapd.cli[{ours}] ERROR another tapd daemon is already running for it\n")
    argv = [PY, "-m", "tapd", "start", "--pidfile", str(pidfile), "--started-by", str(os.getpid())]
    relaunched: list[int] = []

    def relaunch() -> int:
        relaunched.append(launch_detached(argv, log))
        return relaunched[-1]

    served_by = wait_ready(endpoint, ours, log, 30.0, pidfile=pidfile, relaunch=relaunch)
    assert len(relaunched) == 1 and served_by == relaunched[0]
    assert _status(home)["pid"] == relaunched[0]


@pytest.mark.waits
@pytest.mark.parametrize("relaunch", [None, "given"])
@pytest.mark.parametrize("last_words", ["already running", "cannot bind"])
def test_a_caller_whose_daemon_exited_with_no_winner_fails(
    runtime_dir: Path, relaunch: str | None, last_words: str
) -> None:
    """Nobody holds the lock and ours has exited. A daemon that failed (or lost the lock,
    with no relaunch at hand) fails the caller within seconds; one that lost the lock is
    started again, here in vain, to the end of the timeout. Either way the error names
    our daemon's last line (not another daemon's, in the log they share) and the log."""
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    (runtime_dir / "tapd.sock.lock").touch()
    assert flock_holder(runtime_dir / "tapd.sock.lock") is None
    log = runtime_dir / "tapd.log"
    ours = _exited_pid()
    said = {
        "already running": "another tapd daemon is already running for it",
        "cannot bind": "cannot bind it: Permission denied",
    }[last_words]
    log.write_text(
        f"tapd.cli[{ours}] ERROR {said}\ntapd.daemon[{ours + 1}] INFO another daemon's line\n"
    )
    relaunched: list[int] = []

    def relaunch_in_vain() -> int:
        relaunched.append(ours)
        return ours  # a daemon that exits "already running" again

    started = time.monotonic()
    with pytest.raises(DaemonUnreachable) as raised:
        wait_ready(endpoint, ours, log, 9.0, relaunch=relaunch_in_vain if relaunch else None)
    waited = time.monotonic() - started
    assert said in str(raised.value) and str(log) in str(raised.value)
    if relaunch and last_words == "already running":
        assert "no tapd daemon answered" in str(raised.value) and waited >= 9.0
        assert len(relaunched) >= 1
    else:
        assert f"(pid {ours}) exited without serving" in str(raised.value)
        assert waited < 9.0 and not relaunched


@pytest.mark.waits
def test_a_daemon_that_served_and_then_crashed_is_reported_with_its_last_words(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that crashes in native code after it served (a fault in libzmq, say) logs
    no line of its own at the end, only faulthandler's report: the caller's error says it
    served, then exited, and quotes the report, not only the daemon's last line."""
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    log = runtime_dir / "tapd.log"
    argv = [PY, "-m", "tapd", "--log-level", "info", "start", "--endpoint", endpoint]
    monkeypatch.setenv("TAPD_RUNTIME_DIR", str(runtime_dir))  # (its rings and pidfile)
    pid = launch_detached(argv, log)  # as autostart launches one
    try:
        assert wait_ready(endpoint, pid, log, READY_TIMEOUT) == pid
        os.kill(pid, signal.SIGSEGV)
        wait_until(lambda: not pid_alive(pid), "the daemon to crash")
        with pytest.raises(DaemonUnreachable) as raised:
            wait_ready(endpoint, pid, log, READY_TIMEOUT)
    finally:
        _stop(pid)
    said = str(raised.value)
    assert f"(pid {pid}) served, then exited" in said, said
    assert "serving on" in said and "Segmentation fault" in said, said


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
    # The whole interpreter (JAX import included) ran, and no wait for a daemon.
    assert time.monotonic() - started < READY_TIMEOUT
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
