"""The benchmark's child processes: one tapd daemon, subscriber sinks, other helpers
(`spawn`), and their cleanup.

Readiness is always observed, never slept for: the daemon's `tapd ready:` line on its
stdout, and the daemon's own list of subscribers (`control.stats`) for each sink (every
daemon's list, for a sink that follows several). Every process started here is stopped
by `Processes.stop_all()` with SIGTERM and a bounded wait (SIGKILL after it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tapd.clients import control

BENCH_DIR = Path(__file__).resolve().parent
READY_PREFIX = "tapd ready:"
STOP_TIMEOUT = 15.0


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `condition` every 20 ms until it is truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


class Sink:
    """A running `subscriber_sink.py` process and the file it writes its results to."""

    def __init__(self, process: subprocess.Popen[bytes], consumer: str, result: Path) -> None:
        self.process = process
        self.consumer = consumer
        self.result = result

    def results(self) -> dict[str, Any]:
        """What the sink wrote at exit (call after `Processes.stop`)."""
        return dict(json.loads(self.result.read_text()))


class Processes:
    """Starts the daemon and sinks in `workdir` and remembers them for cleanup."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'd.sock'}"
        self.daemon_log = workdir / "daemon.log"
        self._started: list[subprocess.Popen[bytes]] = []
        self._daemon: subprocess.Popen[bytes] | None = None

    # ---- daemon ---------------------------------------------------------------------

    def start_daemon(self, timeout: float = 30.0, flags: Sequence[str] = ()) -> list[str]:
        """Start `python -m tapd start [flags]` and return its endpoints once it says it
        is ready."""
        argv = [
            sys.executable, "-m", "tapd", "--log-level", "warning", "start",
            "--endpoint", self.endpoint, "--pidfile", str(self.workdir / "d.pid"), *flags,
        ]  # fmt: skip
        with open(self.daemon_log, "wb") as log:
            process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
        self._started.append(process)
        self._daemon = process
        line = read_line(process, timeout)
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"daemon did not become ready: {line!r}\n{self.daemon_log_text()}")
        return line.removeprefix(READY_PREFIX).split()

    def daemon_stats(self) -> dict[str, Any]:
        return control.stats(self.endpoint, timeout=5.0)

    def daemon_cpu_seconds(self) -> float:
        """User + system CPU seconds the daemon process has used so far."""
        assert self._daemon is not None
        with open(f"/proc/{self._daemon.pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
        return (utime + stime) / os.sysconf("SC_CLK_TCK")

    def daemon_log_text(self) -> str:
        return self.daemon_log.read_text(errors="replace") if self.daemon_log.exists() else ""

    # ---- subscribers ----------------------------------------------------------------

    def start_sink(
        self,
        consumer: str,
        *,
        sleep_ms: float = 0.0,
        latency: bool = False,
        tally: bool = False,
        window: int | None = None,
        endpoints: Sequence[str] = (),
        batch: bool = False,
    ) -> Sink:
        """Start a subscriber for `consumer` following this daemon, or every daemon in
        `endpoints`; return once each of them lists it."""
        follow = list(endpoints) or [self.endpoint]
        result = self.workdir / f"{consumer.replace('*', 'all')}.json"
        argv = [
            sys.executable, str(BENCH_DIR / "subscriber_sink.py"),
            *(arg for endpoint in follow for arg in ("--endpoint", endpoint)),
            "--consumer", consumer, "--result", str(result),
            "--sleep-ms", str(sleep_ms), *(["--window", str(window)] if window else []),
            *(["--latency"] if latency else []), *(["--tally"] if tally else []),
            *(["--batch"] if batch else []),
        ]  # fmt: skip
        process = subprocess.Popen(argv)
        self._started.append(process)
        wait_until(
            lambda: all(_subscribed(e, consumer) for e in follow) or process.poll() is not None,
            f"the subscriber for {consumer!r} to connect to {', '.join(follow)}",
        )
        if process.poll() is not None:
            raise RuntimeError(f"the subscriber for {consumer!r} exited with {process.returncode}")
        return Sink(process, consumer, result)

    # ---- other processes ------------------------------------------------------------

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start `argv` with pipes for stdin and (unbuffered) stdout, stderr to `log`;
        it is stopped with the rest."""
        with open(log, "wb") as stderr:
            process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                bufsize=0,
            )  # fmt: skip
        self._started.append(process)
        return process

    # ---- stopping -------------------------------------------------------------------

    def stop(self, process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait at most `timeout` s, then SIGKILL. Returns the exit status."""
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"warning: {process.args!r} ignored SIGTERM for {timeout} s; killing it")
            process.kill()
            code = process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:  # unflushed input to a process that has gone
                    pass
        if process in self._started:
            self._started.remove(process)
        return code

    def stop_all(self) -> None:
        """Stop the subscribers first (newest first), then the daemon."""
        for process in reversed(list(self._started)):
            if process is not self._daemon:
                self.stop(process)
        if self._daemon is not None and self._daemon in self._started:
            self.stop(self._daemon)


def _subscribed(endpoint: str, consumer: str) -> bool:
    """Whether the daemon at `endpoint` lists a subscriber for `consumer`."""
    subscribers = control.stats(endpoint, timeout=5.0)["subscribers"]
    return any(consumer in s["consumers"] for s in subscribers)


def read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The next line of the process's stdout, or '' if it exits or `timeout` passes.
    Past the first line, only for unbuffered stdout (`spawn`): a buffered reader can
    hold lines that select() no longer sees."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        return ""
    return process.stdout.readline().decode(errors="replace").strip()


def run_backend_child(script: str, backend: str, argv: Sequence[str]) -> dict[str, Any]:
    """Run `script --child ...argv` with TAPD_BACKEND=`backend` (each backend in a process
    of its own: the backend is chosen once per process); return the JSON object it prints
    last on stdout."""
    command = [sys.executable, script, "--child", *argv]
    env = {**os.environ, "TAPD_BACKEND": backend, "TAPD_AUTOSTART": "0"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{backend} run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def run_child(command: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """A bench's child process (one process at a time holds a TPU): its stderr's tail
    passed on, its result the last JSON line it printed; SystemExit where it failed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    sys.stderr.write(done.stderr[-4000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed: {done.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
