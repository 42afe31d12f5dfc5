"""Emitter settings: defaults < `TAPD_*` environment variables < `tapd.configure(...)`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, Literal

from tapd.errors import ConfigError
from tapd.policies import POLICIES, Policy
from tapd.runtime import default_endpoint

Backend = Literal["auto", "native", "portable"]
BACKENDS: tuple[Backend, ...] = ("auto", "native", "portable")


@dataclasses.dataclass(frozen=True)
class EmitterSettings:
    endpoint: str = dataclasses.field(default_factory=default_endpoint)
    policy: Policy = "block"
    # native: XLA FFI handler into a shared-memory ring (CPU, daemon on this host);
    # portable: jax.debug.callback; auto: native where it can be used.
    backend: Backend = "auto"
    # The emitter's own buffer (or ring), in bytes of payload (host_callback's 256 MB).
    buffer_bytes: int = 256 * 10**6
    # How long interpreter exit waits for taps to be delivered.
    exit_timeout: float = 10.0
    # Under `block`, warn when one tap has waited this long for buffer space.
    block_warning_after: float = 5.0
    # Taps keep program order (an ordering token); False: lowered without one, order per
    # site rebuilt from seq (README, "Unordered taps"). `tap(..., ordered=)` overrides it.
    ordered: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.buffer_bytes <= 0:
            raise ConfigError(f"buffer_bytes must be positive, got {self.buffer_bytes}")
        if self.exit_timeout < 0:
            raise ConfigError(f"exit_timeout must be >= 0, got {self.exit_timeout}")


def _flag(raw: str) -> bool:
    """1/true/yes/on or 0/false/no/off."""
    word = raw.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "TAPD_ENDPOINT": ("endpoint", str),
    "TAPD_POLICY": ("policy", str),
    "TAPD_BACKEND": ("backend", str),
    "TAPD_BUFFER_BYTES": ("buffer_bytes", int),
    "TAPD_EXIT_TIMEOUT": ("exit_timeout", float),
    "TAPD_ORDERED": ("ordered", _flag),
}


def from_environment(**overrides: Any) -> EmitterSettings:
    values: dict[str, Any] = {}
    for variable, (field, convert) in _ENV.items():
        if (raw := os.environ.get(variable)) is not None:
            try:
                values[field] = convert(raw)
            except ValueError as exc:
                raise ConfigError(f"{variable}={raw!r} is not a valid {field}") from exc
    values.update({k: v for k, v in overrides.items() if v is not None})
    return EmitterSettings(**values)
