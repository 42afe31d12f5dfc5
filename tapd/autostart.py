"""Start this user's daemon when the first client needs it, as W&B's and Ray's clients do.

Only the default endpoint (the ipc socket in this user's private runtime directory) is
started on demand: a daemon at any other address was configured by someone (systemd,
Kubernetes, Slurm, a job script), who starts it. `TAPD_AUTOSTART=0` turns it off; a
missing daemon is then an error at once, not after a timeout.

Races need no lock of their own. Several processes that find no daemon may each launch
one; the daemon's endpoint lock lets one bind, the others exit with "already running",
and every caller waits for whichever daemon answers (or, if the winner died before it
served, launches one again).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tapd.clients import control, liveness
from tapd.errors import ALREADY_RUNNING, SERVING, DaemonUnreachable
from tapd.runtime import (
    default_endpoint,
    default_pidfile,
    ensure_private_dir,
    flock_holder,
    pid_alive,
    read_pidfile,
    runtime_dir,
)
from tapd.settings import AUTOSTART

logger = logging.getLogger(__name__)

READY_TIMEOUT = 15.0  # a cold daemon imports numpy and zmq; a loaded CI box is slow
_PROBE_TIMEOUT = 0.3  # how long a live socket may take to answer before we launch

# Run by a short-lived launcher, so that the daemon is nobody's child: a caller that
# goes on running is left no zombie to reap, and the daemon has a session of its own.
_LAUNCHER = """\
import subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                         stderr=sys.stderr, start_new_session=True)
print(child.pid)
"""


def log_path(pidfile: Path | None = None) -> Path:
    """Where a detached daemon writes its log: beside its pidfile."""
    return (pidfile or default_pidfile()).with_suffix(".log")


def launch_detached(argv: list[str], log: Path) -> int:
    """Start `argv` (a `tapd start` command line) in a session of its own, its output
    appended to `log`; return its pid. Does not wait for it to be ready."""
    ensure_private_dir(log.parent)
    with open(log, "ab") as log_file:
        launcher = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *argv],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            check=False,
        )
    try:
        return int(launcher.stdout)
    except ValueError:
        raise DaemonUnreachable(f"could not launch `{' '.join(argv)}`; see {log}") from None


def answers(endpoint: str, timeout: float) -> bool:
    try:
        control.stats(endpoint, timeout=timeout)
    except TimeoutError:
        return False
    return True


def ensure_daemon(
    endpoint: str, *, required: bool = True, timeout: float = READY_TIMEOUT
) -> int | None:
    """Make sure a daemon answers at `endpoint` before a client goes on.

    Returns the pid of the daemon this call launched (the last, if it had to launch one
    again), None if one already answered or the endpoint is not the default one (then the
    caller's own timeout applies). Raises DaemonUnreachable when the daemon it launched
    did not become ready (naming its log), and when autostart is off and there is no
    daemon (no socket file, or one left by a daemon that is gone), if the caller is
    `required` to have one now (a subscriber, an emitter's first tap for a daemon)."""
    if endpoint != default_endpoint():
        return None
    ensure_private_dir(runtime_dir())  # no squatter's socket is probed, nor started beside
    socket_path = Path(endpoint.removeprefix("ipc://"))
    if socket_path.exists() and answers(endpoint, _PROBE_TIMEOUT):
        return None
    if not AUTOSTART.value():
        if not required:
            return None
        if not socket_path.exists():
            missing = "no socket file"
        elif liveness.lock_state(endpoint)[0] == "gone":  # (it did not answer the probe)
            missing = "its socket file was left by a daemon that is gone: nobody holds its lock"
        else:
            return None  # a daemon there, stopped or slow: the caller's own wait decides
        raise DaemonUnreachable(
            f"no tapd daemon at {endpoint} ({missing}) and TAPD_AUTOSTART=0: "
            "start one with `tapd start --detach`, or unset TAPD_AUTOSTART"
        )
    log = log_path()
    pidfile = default_pidfile()
    argv = [sys.executable, "-m", "tapd", "start", "--pidfile", str(pidfile)]
    argv += ["--started-by", str(os.getpid())]
    pid = launch_detached(argv, log)
    logger.info("started a tapd daemon on demand (pid %d, log %s)", pid, log)
    relaunch = functools.partial(launch_detached, argv, log)
    return wait_ready(endpoint, pid, log, timeout, pidfile=pidfile, relaunch=relaunch)


def wait_ready(
    endpoint: str,
    pid: int,
    log: Path,
    timeout: float,
    *,
    pidfile: Path | None = None,
    relaunch: Callable[[], int] | None = None,
) -> int:
    """Wait until a daemon answers at `endpoint`: the one launched as `pid`, or another
    that won the endpoint lock (then `pid` exits "already running", which is fine).

    While a live daemon holds the lock (as /proc/locks or the `pidfile` it writes once it
    holds the lock say), it is waited for as long as `pid` would be. If ours lost the lock
    to a daemon that is gone too, `relaunch` (when given) starts another; any other exit
    of ours fails at once, with the last line it logged. Returns the pid last launched."""
    lock = Path(f"{endpoint.removeprefix('ipc://')}.lock")
    deadline = time.monotonic() + timeout
    ours_gone_at: float | None = None
    while time.monotonic() < deadline:
        if answers(endpoint, 0.2):
            return pid
        if ours_gone_at is None and not pid_alive(pid):
            ours_gone_at = time.monotonic()
        # The grace covers a winner between its imports and its lock.
        if ours_gone_at is None or time.monotonic() - ours_gone_at <= 3.0:
            continue
        if _lock_held_by_a_live_daemon(lock, pidfile):
            continue
        said, after = _last_words(log, pid)
        if relaunch is not None and ALREADY_RUNNING in said:
            pid, ours_gone_at = relaunch(), None
            logger.info("the tapd daemon that held the lock is gone: started pid %d", pid)
            continue
        how = "served, then exited" if SERVING in said else "exited without serving"
        raise DaemonUnreachable(
            f"the tapd daemon started on demand (pid {pid}) {how} {endpoint}: "
            f"{_joined(said, after)} (log: {log})"
        )
    raise DaemonUnreachable(
        f"no tapd daemon answered at {endpoint} within {timeout:g} s (the one started on "
        f"demand: pid {pid}, whose last line is: {_joined(*_last_words(log, pid))}); see {log}"
    )


def _lock_held_by_a_live_daemon(lock: Path, pidfile: Path | None) -> bool:
    holder = flock_holder(lock)
    if holder == 0:  # held by a process this pid namespace cannot see
        return True
    # The pidfile too, in case /proc/locks does not say (or names a pid we cannot see).
    written = read_pidfile(pidfile) if pidfile is not None else None
    return any(pid is not None and pid_alive(pid) for pid in (holder, written))


def _last_words(log: Path, pid: int) -> tuple[str, list[str]]:
    """What daemon `pid` said last, in the log it shares with the daemons started at once
    (each logged line names its pid: tapd/cli/logs.py): its last logged line, and the
    lines after it that name no pid, the first and last few of them (a crash's
    traceback, faulthandler's report, an assertion of libzmq's, whoever wrote them). The
    log's last line alone if no line names `pid`."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log", []
    ours = [index for index, line in enumerate(lines) if f"[{pid}] " in line]
    if not ours:
        return (lines or ["empty log"])[-1], []
    after = lines[ours[-1] + 1 :]
    unnamed = [line for line in after if line.strip() and _LOGGED.search(line) is None]
    if len(unnamed) > 2 * _UNNAMED_KEPT:  # a report's headline comes first, a traceback's last
        unnamed = [*unnamed[:_UNNAMED_KEPT], "...", *unnamed[-_UNNAMED_KEPT:]]
    return lines[ours[-1]], unnamed


def _joined(said: str, after: list[str]) -> str:
    return said if not after else f"{said}; then, in the log: " + " | ".join(after)


# A line the logging of tapd/cli/logs.py wrote: "... tapd.daemon[123] INFO ...".
_LOGGED = re.compile(r"\S\[\d+\] [A-Z]+ ")
_UNNAMED_KEPT = 4


__all__ = ["answers", "ensure_daemon", "launch_detached", "log_path"]
