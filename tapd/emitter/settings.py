"""Emitter settings: defaults < `TAPD_*` environment variables < `tapd.configure(...)`.

The fields (name, type, default, variable, help) are declared in
`tapd.settings.EmitterFields`; this module checks them together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

from tapd.errors import ConfigError
from tapd.settings import EMITTER_SETTINGS, Backend, EmitterFields
from tapd.settings.setting import check_choices, read_environment

__all__ = ["BACKENDS", "Backend", "EmitterSettings", "from_environment"]

BACKENDS: tuple[Backend, ...] = get_args(Backend)


@dataclasses.dataclass(frozen=True)
class EmitterSettings(EmitterFields):
    def __post_init__(self) -> None:
        check_choices(self)
        if self.buffer_bytes <= 0:
            raise ConfigError(f"buffer_bytes must be positive, got {self.buffer_bytes}")
        if self.exit_timeout < 0:
            raise ConfigError(f"exit_timeout must be >= 0, got {self.exit_timeout}")
        if self.gather_taps <= 0 or self.gather_bytes <= 0 or self.gather_log_bytes <= 0:
            raise ConfigError(
                "gather_taps, gather_bytes and gather_log_bytes must be positive, got "
                f"{self.gather_taps}, {self.gather_bytes} and {self.gather_log_bytes}"
            )
        if self.gather_latency < 0:
            raise ConfigError(f"gather_latency must be >= 0, got {self.gather_latency}")
        if self.cell_timeout < 0:
            raise ConfigError(f"cell_timeout must be >= 0, got {self.cell_timeout}")


def from_environment(**overrides: Any) -> EmitterSettings:
    """The settings `overrides` give (None: not given), else their variables, else defaults."""
    given = {name: value for name, value in overrides.items() if value is not None}
    unset = [s for s in EMITTER_SETTINGS if s.name not in given]
    return EmitterSettings(**read_environment(unset), **given)
