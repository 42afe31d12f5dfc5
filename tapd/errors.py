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
offending value.
"""

from __future__ import annotations

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


class DaemonUnreachable(TapdError, ConnectionError):
    """No daemon answers at the endpoint a client needs, and none was started for it
    (autostart is off, or the daemon it started did not become ready: the message says
    which, and where its log is)."""


class CallbackException(TapdError):
    """One or more tap functions (or subscriber handlers) raised; `barrier_wait` raises
    this. `errors` lists them as "consumer#seq: what raised". host_callback's name;
    `TapFunctionException` is an alias, as it was there."""

    def __init__(self, errors: list[str]) -> None:
        shown = "\n  ".join(errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        # host_callback's first words, which code and tests matched on; then tapd's list.
        last = errors[-1] if errors else "none"
        super().__init__(
            "There were exceptions during callback processing. Last one was: "
            f"{last}\n{len(errors)} tap function call(s) raised:\n  {shown}{more}"
        )
        self.errors = errors


TapFunctionException = CallbackException  # host_callback's alias of the same class
