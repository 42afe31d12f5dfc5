"""Logging of the `tapd` command: only the CLI configures it, never library code. So
the log level (`--log-level`, TAPD_LOG_LEVEL, the daemon's TOML) is checked here, where
it is set."""

from __future__ import annotations

import logging
import sys

from tapd.errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        # The pid, as syslog's `name[pid]`: daemons started on demand at once share one log.
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )


def set_log_level(level: str) -> None:
    if level.upper() not in LOG_LEVELS:
        levels = ", ".join(name.lower() for name in LOG_LEVELS)
        raise ConfigError(f"log level {level!r} is not one of {levels}")
    logging.getLogger("tapd").setLevel(level.upper())  # other libraries stay at WARNING
