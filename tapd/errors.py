"""The exceptions tapd raises, all in one place.

    TapdError                      base of everything below
    ├── ProtocolError              a message broke the wire protocol (has `.reason`)
    ├── ConfigError                a setting was missing or malformed
    ├── TapDefinitionError         a tap site cannot be served (raised at trace time)
    ├── BarrierTimeout             also a TimeoutError: `barrier_wait` gave up
    ├── DaemonAlreadyRunning       also an OSError: another daemon holds this endpoint
    ├── DaemonUnreachable          also a ConnectionError: no daemon, and none could be started
    └── CallbackException          a tap function or handler raised (surfaces at the barrier);
                                   `TapFunctionException` is the same class, as in host_callback

Lower-layer errors are re-raised from these with `from exc`, and messages name the
offending value. `failure_text` writes what a subscriber reports of a handler that
raised, which `CallbackException` reads back.
"""

from __future__ import annotations

import traceback

__all__ = [
    "BarrierTimeout",
    "CallbackException",
    "ConfigError",
    "DaemonAlreadyRunning",
    "DaemonUnreachable",
    "ProtocolError",
    "TapDefinitionError",
    "TapFunctionException",
    "TapdError",
    "failure_text",
]


class TapdError(Exception):
    """Base class of every error tapd raises."""


class ProtocolError(TapdError):
    """A message violated the wire protocol. `reason` is a short code used in counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class ConfigError(TapdError):
    """A configuration value is missing or malformed."""


class TapDefinitionError(TapdError, TypeError):
    """A tap cannot be built as written (an object dtype, metadata that cannot travel, a
    daemon that is not there to feed an in-process tap function...)."""


class BarrierTimeout(TapdError, TimeoutError):
    """`barrier_wait` ran out of time; the message says what was outstanding."""


class DaemonAlreadyRunning(TapdError, OSError):
    """Another tapd daemon serves (or holds the lock of) the endpoint a daemon was to
    bind; `tapd start` exits with ExitCode.ALREADY_RUNNING."""


# How DaemonAlreadyRunning's message starts: autostart finds it in a lost daemon's log.
ALREADY_RUNNING = "another tapd daemon is already running"
# What a daemon logs once it serves (bound, its ring directory claimed: tapd/daemon/
# server.py): autostart tells by it a daemon that served and then died from one that
# never served.
SERVING = "serving on"


class DaemonUnreachable(TapdError, ConnectionError):
    """No daemon answers at the endpoint a client needs, and none was started for it
    (autostart is off, or the daemon it started did not become ready: the message says
    which, and where its log is); also what a barrier (or the exit drain) raises once its
    daemon has not answered for TAPD_CONNECT_TIMEOUT s where none is started on demand."""


class CallbackException(TapdError):
    """One or more tap functions (or subscriber handlers) raised; `barrier_wait` raises
    this. Its message reads as host_callback's did: "There were exceptions during
    callback processing. Last one was: " and the last failure's exception as
    `traceback.format_exception` formats it (ending in e.g. `ValueError: message`), then
    tapd's list of every failure, one line each. `errors` is that list ("consumer#seq:
    what raised"). Where the last tap function ran in this process, the exception is
    chained to what it raised. host_callback's name; `TapFunctionException` is an alias,
    as it was there."""

    def __init__(self, errors: list[str]) -> None:
        """`errors`: one text per failure, as reported: a first line naming the tap and
        what raised, then the formatted exception where the reporter sent it
        (`failure_text`)."""
        lines = [text.partition("\n")[0] for text in errors]
        shown = "\n  ".join(lines[:10])
        more = f"\n  ... and {len(lines) - 10} more" if len(lines) > 10 else ""
        first_line, _, formatted = errors[-1].partition("\n") if errors else ("none", "", "")
        super().__init__(
            "There were exceptions during callback processing. Last one was: "
            f"{formatted.rstrip() or first_line}\n\n"
            f"{len(lines)} tap function call(s) raised:\n  {shown}{more}"
        )
        self.errors = lines
        self.texts = list(errors)  # (whole, as given: to merge two barriers' failures)


TapFunctionException = CallbackException  # host_callback's alias of the same class


_CUT = "[... the traceback's first lines were cut ...]\n"


def failure_text(name: str, exc: BaseException, limit: int = 4000) -> str:
    """How a handler that raised is reported (an `ack`'s error, docs/PROTOCOL.md): one
    line, "<name> raised <exception's repr>", then the exception as
    `traceback.format_exception` formats it, as host_callback reported it. At most `limit`
    characters: a long traceback loses its first lines, never its last (the exception's
    type and message)."""
    summary = f"{name} raised {exc!r}".replace("\n", " ")[: limit // 4]
    formatted = "".join(traceback.format_exception(exc))
    room = limit - len(summary) - 1
    if len(formatted) > room:
        tail = formatted[len(formatted) - room + len(_CUT) :]
        frame = tail.find("\n  File ")  # start at a frame, else at a whole line
        newline = frame if frame >= 0 else tail.find("\n")
        if 0 <= newline < len(tail) - 1:
            tail = tail[newline + 1 :]
        formatted = _CUT + tail
    return f"{summary}\n{formatted}"
