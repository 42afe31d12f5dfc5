"""Whether a daemon is there, for a client that waits on one: so that no wait on a daemon
that is gone, or stopped, is a silent one.

`look` asks the daemon itself (a `stats` request on its control socket, answered within
a second) and, for an `ipc://` endpoint, the process that holds the endpoint's lock
(every daemon holds `<socket>.lock` while it serves, and takes it before it binds):
whether that process exists, and whether it is stopped (SIGSTOP, Ctrl-Z, a debugger).
A socket file whose lock nobody holds was left by a daemon that is gone.

`DaemonWatch` does it for one wait (a barrier, the exit drain, a subscriber's connect):
from its first second on, once a second. A daemon that answers is waited for however
long it takes (its subscribers may be slow), with a warning after 30 s and every minute
after that. One that does not answer is named at once, with what the wait is for, and
again every 10 s. Where nobody will start a daemon on demand (`TAPD_AUTOSTART=0`, or an
endpoint other than this user's default one: `starts_on_demand`), a watch given
`fail_after` raises DaemonUnreachable once no daemon has answered for that long, unless
the daemon's process is there and running (a daemon too busy to answer is slow, not
gone). Where one would be started on demand, the wait goes on, warning: the next tapd
client that starts one (or a `tapd start`) serves it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tapd.clients import control
from tapd.errors import DaemonUnreachable
from tapd.runtime import flock_holder
from tapd.settings import AUTOSTART, default_endpoint

PING_TIMEOUT = 1.0  # s a live daemon gets to answer a look
FIRST_LOOK_AFTER = 1.0  # s into a wait: most waits are over long before
LOOK_EVERY = 1.0  # s between looks
SILENT_WARNING_EVERY = 10.0  # s between warnings about a daemon that does not answer
SLOW_WARNING_AFTER = 30.0  # s into a wait on a daemon that answers: first warning
SLOW_WARNING_EVERY = 60.0


@dataclasses.dataclass(frozen=True)
class Sighting:
    """What one look found. `state`: "answers"; "running" (its process is there and
    runs, but it did not answer); "stopped"; "gone" (no daemon process: no socket file,
    or one whose lock nobody holds); "silent" (no answer, and nothing more is known: a
    tcp:// endpoint, a lock this process cannot read)."""

    endpoint: str
    state: str
    pid: int | None = None
    detail: str = ""  # how it is known, where that helps

    @property
    def answered(self) -> bool:
        return self.state == "answers"

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid else "its pid not known here"
        if self.state == "answers":
            return f"the daemon answers ({pid})"
        if self.state == "running":
            return f"its process ({pid}) runs but did not answer within {PING_TIMEOUT:g} s"
        if self.state == "stopped":
            return f"its process ({pid}) is stopped (SIGSTOP, Ctrl-Z or a debugger?)"
        if self.state == "gone":
            return self.detail or "no daemon process serves it (killed, crashed or never started)"
        return f"nothing answered within {PING_TIMEOUT:g} s"


def look(endpoint: str, timeout: float = PING_TIMEOUT) -> Sighting:
    """Ask the daemon at `endpoint` (up to `timeout` s), and where that gets no answer,
    the process holding its lock."""
    if endpoint.startswith("ipc://"):
        path = Path(endpoint.removeprefix("ipc://"))
        if not path.exists():  # (connecting would only wait for one to bind)
            return Sighting(endpoint, "gone", detail="there is no socket file")
    try:
        reply = control.stats(endpoint, timeout=timeout)
    except TimeoutError:
        pass
    else:
        pid = reply.get("pid")
        return Sighting(endpoint, "answers", pid if isinstance(pid, int) else None)
    if not endpoint.startswith("ipc://"):
        return Sighting(endpoint, "silent")
    state, pid = lock_state(endpoint)
    if state == "gone":
        return Sighting(endpoint, state, detail="its socket file was left by a daemon that is gone")
    return Sighting(endpoint, state, pid)


def lock_state(endpoint: str) -> tuple[str, int | None]:
    """The state of the process holding an ipc:// endpoint's lock ("gone" if none does,
    "silent" if that is not known here) and its pid."""
    lock = Path(f"{endpoint.removeprefix('ipc://')}.lock")
    if not endpoint.startswith("ipc://") or not lock.exists():
        return "silent", None  # (a daemon that takes no lock: not one of ours)
    if not os.access("/proc/locks", os.R_OK):
        return "silent", None  # (a kernel that does not say)
    holder = flock_holder(lock)
    if holder is None:
        return "gone", None
    if holder == 0:  # held by a process of another pid namespace
        return "silent", None
    return process_state(holder), holder


def process_state(pid: int) -> str:
    """What /proc says of process `pid`: "running", "stopped" or "gone" (none, or a
    zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    try:
        code = stat.rsplit(")", 1)[1].split()[0]
    except IndexError:
        return "running"
    if code in ("Z", "X", "x"):
        return "gone"
    if code in ("T", "t"):
        return "stopped"
    return "running"


def starts_on_demand(endpoint: str) -> bool:
    """Whether a tapd client that finds no daemon at `endpoint` starts one: only at
    this user's default endpoint, and unless `TAPD_AUTOSTART=0`."""
    return bool(AUTOSTART.value()) and endpoint == default_endpoint()


def nobody_starts_why(endpoint: str) -> str:
    """Why no daemon will be started on demand at `endpoint` (for messages)."""
    if not AUTOSTART.value():
        return "TAPD_AUTOSTART=0, so none is started on demand"
    return "none is started on demand at an endpoint other than this user's default one"


class DaemonWatch:
    """One wait on the daemon at `endpoint`: call `check` often while it lasts (it looks
    only when a look is due). `waiting_for` names the wait in messages ("barrier_wait");
    `pending()` says what waits ("20 taps"). With `fail_after`, `check` raises
    DaemonUnreachable once no daemon has answered for that long where nobody starts one
    on demand (see the module docstring); `what_then` ends that error's message.
    `deadline`: when the wait times out by itself (its warnings say so)."""

    def __init__(
        self,
        endpoint: str,
        *,
        waiting_for: str,
        log: logging.Logger,
        fail_after: float | None = None,
        what_then: str = "",
        deadline: float | None = None,
        first_look_after: float = FIRST_LOOK_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.waiting_for = waiting_for
        self.log = log
        self.fail_after = fail_after if not starts_on_demand(endpoint) else None
        self.what_then = what_then
        self.deadline = deadline  # (on `clock`) when the wait gives up by itself, if it does
        self._clock = clock
        self._started = clock()
        self._next_look = self._started + first_look_after
        self._silent_since: float | None = None
        self._next_warning = 0.0
        self.last: Sighting | None = None

    def check(self, pending: Callable[[], str]) -> None:
        now = self._clock()
        if now < self._next_look:
            return
        sighting = self.last = look(self.endpoint)
        self._next_look = self._clock() + LOOK_EVERY
        if sighting.answered:
            self._answered(now, sighting, pending)
        else:
            self._silent(now, sighting, pending)

    def _answered(self, now: float, sighting: Sighting, pending: Callable[[], str]) -> None:
        if self._silent_since is not None:
            self._silent_since = None
            self.log.warning(
                "tapd: the daemon at %s answers again (pid %s); %s goes on waiting for %s",
                self.endpoint,
                sighting.pid,
                self.waiting_for,
                pending(),
            )
            self._next_warning = now + SLOW_WARNING_EVERY
            return
        waited = now - self._started
        if waited >= SLOW_WARNING_AFTER and now >= self._next_warning:
            self._next_warning = now + SLOW_WARNING_EVERY
            self.log.warning(
                "tapd: %s has waited %.0f s for %s; the daemon at %s answers (pid %s): its "
                "subscribers have not handled them yet (`tapd status` says who is behind)",
                self.waiting_for,
                waited,
                pending(),
                self.endpoint,
                sighting.pid,
            )

    def _silent(self, now: float, sighting: Sighting, pending: Callable[[], str]) -> None:
        if self._silent_since is None:
            self._silent_since = now
            self._next_warning = now
        silent = self._clock() - self._silent_since
        fails = self.fail_after is not None and sighting.state != "running"
        if fails and self.fail_after is not None and silent >= self.fail_after:
            raise DaemonUnreachable(
                f"no tapd daemon has answered at {self.endpoint} for {silent:.0f} s "
                f"({sighting.describe()}), and {nobody_starts_why(self.endpoint)}: "
                f"{self.waiting_for} gives up on {pending()}{self.what_then} "
                "(start one with `tapd start --detach`; TAPD_CONNECT_TIMEOUT sets how long "
                "a wait gives a daemon that does not answer)"
            )
        if now < self._next_warning:
            return
        self._next_warning = now + SILENT_WARNING_EVERY
        if self.fail_after is None:
            then = "it goes on waiting"
            if self.deadline is not None:
                then = f"it gives up in {max(0.0, self.deadline - now):.0f} s"
        elif fails:
            then = f"it fails if none answers within {self.fail_after:g} s"
        else:
            then = "it goes on waiting while that process runs"
        self.log.warning(
            "tapd: %s waits for %s, but no tapd daemon answers at %s: %s; %s",
            self.waiting_for,
            pending(),
            self.endpoint,
            sighting.describe(),
            then,
        )


__all__ = ["DaemonWatch", "Sighting", "lock_state", "look", "process_state", "starts_on_demand"]
