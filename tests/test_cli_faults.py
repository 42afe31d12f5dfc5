"""The `tapd` command under faults (issue 10): a pidfile that names someone else, two
daemons at once, a tcp endpoint without keys, --detach after global options, the TOML
log level, and shared memory left by killed jobs. Each is tested in-process (`main`)
and through a subprocess."""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, tapd_cmd, wait_until
from tapd import config as config_module
from tapd.cli.exit_codes import ExitCode
from tapd.cli.main import main
from tapd.daemon import server
from tapd.native.wake import WAKE_SOCKET
from tapd.runtime import make_first_file, mark_ring_dir, ring_dir_for, runtime_dir_of_rings
from tapd.tools.replay import StopFlag
from tapd_client import Subscriber


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process, as a pid reused after the daemon's kill -9 would be."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def test_stop_never_signals_a_pid_the_daemon_does_not_confirm(
    runtime_dir: Path, bystander: subprocess.Popen[bytes]
) -> None:
    pidfile = runtime_dir / "tapd.pid"
    pidfile.write_text(f"{bystander.pid}\n")
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    args = ["stop", "--endpoint", endpoint, "--pidfile", str(pidfile), "--timeout", "1"]
    assert main(args) == ExitCode.UNREACHABLE
    result = tapd_cmd(*args)
    assert result.returncode == ExitCode.UNREACHABLE, result.stderr
    assert "not signalling" in result.stderr
    time.sleep(0.2)
    assert bystander.poll() is None, "tapd stop killed an unrelated process"


def test_stop_signals_the_daemon_that_answers_not_the_pid_in_the_file(
    start_daemon: Callable[..., Daemon], runtime_dir: Path, bystander: subprocess.Popen[bytes]
) -> None:
    daemon = start_daemon()
    pidfile = runtime_dir / "tapd.sock.pid"
    pidfile.write_text(f"{bystander.pid}\n")  # stale: the daemon's pid was reused
    result = tapd_cmd("stop", "--endpoint", daemon.endpoint, "--pidfile", str(pidfile))
    assert result.returncode == ExitCode.OK, result.stderr
    assert daemon.process.wait(timeout=30) == 0
    assert bystander.poll() is None


def test_a_second_daemon_on_the_same_endpoint_is_refused_even_without_its_socket(
    start_daemon: Callable[..., Daemon], runtime_dir: Path
) -> None:
    first = start_daemon()
    (runtime_dir / "tapd.sock").unlink()  # as if the two had raced past the socket check
    second = tapd_cmd("start", "--endpoint", first.endpoint, "--pidfile",
                      str(runtime_dir / "second.pid"), timeout=30)  # fmt: skip
    assert second.returncode == ExitCode.ALREADY_RUNNING, second.stderr
    assert "already running" in second.stderr
    assert first.process.poll() is None


def test_a_daemon_refused_as_second_leaves_the_first_ones_ring_directory_alone(
    start_daemon: Callable[..., Daemon], runtime_dir: Path
) -> None:
    # Eight callers autostarting at once launch up to eight daemons; those that lose the
    # lock once tidied the ring directory as they closed, under the winner (a CI failure:
    # the winner's marker write found its directory gone).
    first = start_daemon()
    rings = ring_dir_for(first.endpoint)
    assert rings is not None
    # Ready means its ring directory is claimed (marked) and its wake socket open.
    assert runtime_dir_of_rings(rings) == runtime_dir.resolve()
    assert (rings / WAKE_SOCKET).exists()
    before = sorted(entry.name for entry in rings.iterdir())
    for number in range(3):
        second = tapd_cmd("start", "--endpoint", first.endpoint, "--pidfile",
                          str(runtime_dir / f"second{number}.pid"), timeout=30)  # fmt: skip
        assert second.returncode == ExitCode.ALREADY_RUNNING, second.stderr
    assert sorted(entry.name for entry in rings.iterdir()) == before
    assert runtime_dir_of_rings(rings) == runtime_dir.resolve()
    assert first.process.poll() is None
    assert first.stop() == 0
    assert not rings.exists(), "the daemon that served tidies its ring directory at stop"


def test_a_daemon_refused_as_second_leaves_the_first_ones_spool_alone(
    start_daemon: Callable[..., Daemon], runtime_dir: Path
) -> None:
    # The first daemon's spool as it is just after it began a segment: empty. A daemon
    # that read it as an earlier daemon's leftovers removed that file under the first.
    spool_dir = runtime_dir / "spool"
    first = start_daemon("--policy", "spool", "--spool-dir", str(spool_dir))
    spool = spool_dir / hashlib.sha256(b"loss").hexdigest()[:16]  # (tapd/daemon/spool.py)
    spool.mkdir(mode=0o700, parents=True)
    (spool / "subscriber").write_text("loss")
    (spool / "00000001.seg").touch()
    second = tapd_cmd("start", "--endpoint", first.endpoint, "--policy", "spool",
                      "--spool-dir", str(spool_dir), "--pidfile",
                      str(runtime_dir / "second.pid"), timeout=30)  # fmt: skip
    assert second.returncode == ExitCode.ALREADY_RUNNING, second.stderr
    assert sorted(entry.name for entry in spool.iterdir()) == ["00000001.seg", "subscriber"]
    assert first.process.poll() is None


def test_a_ring_directory_removed_before_its_first_file_is_made_again(tmp_path: Path) -> None:
    # Whoever leaves a shared ring directory removes it if it looks empty; it does, from
    # an emitter's (or a daemon's) mkdir to its first file.
    directory = tmp_path / "rings"
    calls = []

    def make() -> Path:
        calls.append(directory.is_dir())
        if len(calls) == 1:
            directory.rmdir()  # another emitter's exit, at that moment
        first = directory / "first"
        first.touch(exist_ok=False)
        return first

    assert make_first_file(directory, make).exists()
    assert calls == [True, True]
    assert directory.stat().st_mode & 0o777 == 0o700

    def fails() -> None:
        (directory / "missing" / "file").touch()  # not the directory's vanishing: raised

    with pytest.raises(FileNotFoundError):
        make_first_file(directory, fails)


def _returns_when_reentered_at_every_line(stop: Callable[[], None], wait: float = 10) -> bool:
    """Call `stop` as a signal handler, with a second call of it landing at each line it
    runs: Python runs a pending signal's handler between any two bytecodes, inside an
    earlier handler too (Ctrl-C twice, a supervisor's repeated SIGTERM). True if it
    returned; False if it hung, as one that takes a lock does (threading.Event.set)."""

    def run() -> None:
        nested = False

        def second_signal(frame: Any, event: str, arg: Any) -> Any:
            nonlocal nested
            if event == "line" and not nested:
                nested = True
                try:
                    stop()
                finally:
                    nested = False
            return second_signal

        sys.settrace(second_signal)  # (this thread only)
        try:
            stop()
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=wait)
    return not thread.is_alive()


def test_the_stop_handlers_survive_a_second_signal_inside_the_first(runtime_dir: Path) -> None:
    # The daemon's once set a threading.Event: a second SIGTERM landing inside that set()
    # waited for the lock the first held, forever (a test saw it as "ignored SIGTERM").
    config = config_module.load({"endpoint": f"ipc://{runtime_dir}/tapd.sock"}, None, {})
    daemon = server.Daemon(config)
    try:
        assert _returns_when_reentered_at_every_line(daemon.request_stop)
    finally:
        daemon.close()
    subscriber = Subscriber(f"ipc://{runtime_dir}/tapd.sock")
    assert _returns_when_reentered_at_every_line(subscriber.stop)  # `tapd tail`, `subscribe`
    assert _returns_when_reentered_at_every_line(StopFlag().set)  # `tapd replay`
    # The check itself: a handler that takes a lock is caught.
    assert not _returns_when_reentered_at_every_line(threading.Event().set, wait=1)


def test_sigusr1_writes_the_daemons_stacks_to_its_log_and_it_goes_on(
    start_daemon: Callable[..., Daemon],
) -> None:
    daemon = start_daemon()
    daemon.process.send_signal(signal.SIGUSR1)
    wait_until(lambda: "in serve" in daemon.log(), "the daemon's stacks in its log")
    # (the thread the kernel hands the signal to is marked "Current thread": the main
    # one, or a thread of zmq's, which has no Python stack; the main one's is there)
    assert "Current thread" in daemon.log() or "Thread 0x" in daemon.log()
    assert "counters" in daemon.stats()  # it answers
    assert daemon.process.poll() is None
    assert daemon.stop() == 0


def _signal_burst(pid: int, count: int = 400) -> None:
    """Stop signals as fast as one process sends them, as an impatient Ctrl-C or a
    supervisor's repeated SIGTERM does."""
    for number in range(count):
        os.kill(pid, signal.SIGTERM if number % 2 else signal.SIGINT)


# How a process may end after a burst: stopped (0), or, with its work done, by a late
# one of the burst's signals: Python's finalization gives them their default action
# back, as a second Ctrl-C's "quit now" expects.
BURST_ENDINGS = (0, -signal.SIGINT, -signal.SIGTERM)


def test_a_burst_of_stop_signals_stops_the_daemon(start_daemon: Callable[..., Daemon]) -> None:
    for _ in range(3):
        daemon = start_daemon()
        _signal_burst(daemon.process.pid)
        assert daemon.process.wait(timeout=20) in BURST_ENDINGS, daemon.log()
        assert "tapd daemon stopped" in daemon.log()  # (by its drain, not by a signal)


def test_a_burst_of_stop_signals_stops_a_subscriber(
    start_daemon: Callable[..., Daemon], runtime_dir: Path
) -> None:
    # What it shows: the process exits under the burst, promptly and without a traceback.
    # It cannot tell the handler's stop from a death by a late signal (both may end it);
    # the handler itself is checked above, re-entered at every line.
    daemon = start_daemon()
    for _ in range(3):
        tail = subprocess.Popen(
            [sys.executable, "-m", "tapd", "tail", "--endpoint", daemon.endpoint, "loss"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert tail.stdout is not None
            assert tail.stdout.readline().startswith("subscribed to")
            _signal_burst(tail.pid)
            assert tail.wait(timeout=20) in BURST_ENDINGS
        finally:
            tail.kill()
            _, stderr = tail.communicate()
        # No KeyboardInterrupt (or other error) raised out of its loop on the way out.
        assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_tcp_endpoint_without_keys_is_the_same_configuration_error_as_tcp(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    args = ["start", "--pidfile", str(runtime_dir / "p.pid")]
    if how == "flag":
        args += ["--endpoint", "tcp://127.0.0.1:0"]
    else:
        monkeypatch.setenv("TAPD_ENDPOINT", "tcp://127.0.0.1:0")
    assert main(args) == ExitCode.CONFIG
    result = tapd_cmd(*args, timeout=30)
    assert result.returncode == ExitCode.CONFIG
    assert "needs CurveZMQ" in result.stderr and "--insecure" in result.stderr
    assert "Traceback" not in result.stderr


def test_detach_after_a_global_option_in_process_and_in_a_subprocess(runtime_dir: Path) -> None:
    for number, run in enumerate(("in-process", "subprocess")):
        endpoint = f"ipc://{runtime_dir}/d{number}.sock"
        pidfile = runtime_dir / f"d{number}.pid"
        args = ["--log-level", "debug", "start", "--detach", "--endpoint", endpoint,
                "--pidfile", str(pidfile), "--startup-grace", "0"]  # fmt: skip
        if run == "in-process":
            assert main(args) == ExitCode.OK
        else:
            result = tapd_cmd(*args)
            assert result.returncode == ExitCode.OK, result.stderr
        try:
            assert tapd_cmd("check", "--endpoint", endpoint).returncode == ExitCode.OK
            log = pidfile.with_suffix(".log").read_text()
            assert " DEBUG " in log, log  # the child got --log-level too
        finally:
            assert (
                tapd_cmd("stop", "--endpoint", endpoint, "--pidfile", str(pidfile)).returncode == 0
            )


def test_the_toml_log_level_is_used(start_daemon: Callable[..., Daemon], tmp_path: Path) -> None:
    toml = tmp_path / "tapd.toml"
    toml.write_text('[daemon]\nlog_level = "debug"\n')
    daemon = start_daemon("--config", str(toml))
    wait_until(lambda: " DEBUG " in daemon.log(), "a DEBUG line in the daemon's log")
    toml.write_text('[daemon]\nlog_level = "loud"\n')
    assert main(["start", "--config", str(toml)]) == ExitCode.CONFIG


# ---- shared memory left by killed jobs ----------------------------------------------------


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def fake_ring(directory: Path, writer: int) -> Path:
    """A ring file as the native library lays it out (control page, one page of records),
    written here so that the test needs no native library."""
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / f"{writer}-abcd.ring"
    page = os.sysconf("SC_PAGE_SIZE")
    control = struct.pack("<QIIQq", 0x31474E4952504154, 3, 0, page, writer)
    path.write_bytes(control.ljust(max(page, 4096), b"\0") + bytes(page))
    (directory / f"{writer}-abcd.sites").write_bytes(b"")
    return path


def shm_dir_for(runtime: Path) -> Path:
    directory = ring_dir_for(f"ipc://{runtime}/tapd.sock")
    assert directory is not None and directory.parent == Path("/dev/shm")
    return directory


@pytest.fixture
def stale_rings(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """The rings of a killed job whose runtime dir is gone, and of one whose is not."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm")
    gone, kept = tmp_path / "job-gone", tmp_path / "job-alive"
    kept.mkdir()
    made = [shm_dir_for(gone), shm_dir_for(kept)]
    for directory, runtime in zip(made, (gone, kept), strict=True):
        fake_ring(directory, dead_pid())
        mark_ring_dir(directory, f"ipc://{runtime}/tapd.sock")
    yield made[0], made[1]
    for directory in made:
        for entry in directory.glob("*"):
            entry.unlink()
        if directory.exists():
            directory.rmdir()


@pytest.mark.alone  # leaves a dead job's rings for a clean to find
def test_tapd_clean_removes_rings_whose_writer_and_runtime_dir_are_gone(
    stale_rings: tuple[Path, Path],
) -> None:
    gone, kept = stale_rings
    assert main(["clean", "--dry-run"]) == ExitCode.OK
    assert gone.exists()
    result = tapd_cmd("clean")
    assert result.returncode == ExitCode.OK, result.stderr
    assert str(gone) in result.stdout
    assert not gone.exists() and kept.exists()


@pytest.mark.alone  # leaves a dead job's rings for a clean to find
def test_a_daemon_start_removes_rings_whose_writer_and_runtime_dir_are_gone(
    start_daemon: Callable[..., Daemon], stale_rings: tuple[Path, Path]
) -> None:
    gone, kept = stale_rings
    daemon = start_daemon()
    wait_until(lambda: not gone.exists(), "the stale rings' removal")
    assert kept.exists()
    assert daemon.process.poll() is None


@pytest.mark.alone  # leaves a dead job's rings for a clean to find
def test_the_slurm_node_step_removes_its_runtime_dir_and_rings_after_sigterm(
    tmp_path: Path, stale_rings: tuple[Path, Path]
) -> None:
    """The per-node daemon step of deploy/slurm/tapd-job.sbatch, run as Slurm runs it
    and stopped as a time limit stops it: the daemon drains and exits, then the job's
    runtime dir and the rings nobody can drain any more are gone."""
    script = (Path(__file__).parent.parent / "deploy/slurm/tapd-job.sbatch").read_text()
    node_daemon = script.split("node_daemon='", 1)[1].split("'", 1)[0]
    runtime = tmp_path / "job"
    env = {**os.environ, "TAPD_RUNTIME_DIR": str(runtime),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    step = subprocess.Popen(["bash", "-c", node_daemon, "tapd-node", "--startup-grace", "0"],
                            env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert step.stdout is not None
        assert step.stdout.readline().startswith("tapd ready:")
        own_rings = shm_dir_for(runtime)
        wait_until(own_rings.exists, "the daemon's ring directory")
        os.killpg(step.pid, signal.SIGTERM)  # as srun signals a task: all its processes
        assert step.wait(timeout=60) in (0, 128 + signal.SIGTERM)
    finally:
        if step.poll() is None:
            step.kill()
        step.communicate(timeout=30)
    gone, kept = stale_rings
    assert not runtime.exists()
    assert not own_rings.exists() and not gone.exists() and kept.exists()


def test_sigterm_to_a_detached_daemon_leaves_no_lock_holder(runtime_dir: Path) -> None:
    endpoint = f"ipc://{runtime_dir}/x.sock"
    pidfile = runtime_dir / "x.pid"
    assert (
        tapd_cmd("start", "--detach", "--endpoint", endpoint, "--pidfile", str(pidfile)).returncode
        == 0
    )
    pid = int(pidfile.read_text())
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not Path(f"/proc/{pid}").exists(), "the daemon to exit")
    again = tapd_cmd("start", "--detach", "--endpoint", endpoint, "--pidfile", str(pidfile))
    assert again.returncode == 0, again.stderr
    assert tapd_cmd("stop", "--endpoint", endpoint, "--pidfile", str(pidfile)).returncode == 0


def test_one_ring_is_drained_by_one_daemon_at_most(tmp_path: Path) -> None:
    """Issue 10, item 10, for rings: daemons sharing a ring directory (two endpoints in
    one runtime dir) never both drain a ring; the ring's lock says who does."""
    from tapd.daemon.ring_watch import RingBusy, lock_ring_file

    ring = fake_ring(tmp_path / "rings", dead_pid())
    first = lock_ring_file(ring)
    try:
        with pytest.raises(RingBusy, match="another tapd daemon"):
            lock_ring_file(ring)
    finally:
        os.close(first)
    os.close(lock_ring_file(ring))  # free again once the first let go
