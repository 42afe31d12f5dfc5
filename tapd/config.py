"""The daemon's configuration: one frozen `Config`, whose fields (name, type, default,
variable, flag, help) are declared in `tapd.settings.DaemonFields`.

Precedence: defaults < TOML file (`--config` or `$TAPD_CONFIG`) < `TAPD_*` environment
variables < command-line flags. Only the CLI builds one from all four (`load`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tapd.errors import ConfigError
from tapd.runtime import check_ipc_endpoint, default_pidfile
from tapd.settings import CONFIG, DAEMON_SETTINGS, DaemonFields
from tapd.settings.setting import Setting, check_choices, read_environment


@dataclasses.dataclass(frozen=True)
class Config(DaemonFields):
    """The daemon's settings, checked together."""

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("queue_bytes", "emitter_window_bytes", "max_message_bytes", "spool_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("subscriber_timeout", "drain_timeout", "startup_grace", "wake_ack_timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.coalesce <= 1:
            raise ConfigError(f"coalesce must be between 0 and 1 second, got {self.coalesce}")
        if self.idle_exit is not None and self.idle_exit <= 0:
            raise ConfigError(f"idle_exit must be positive, got {self.idle_exit}")
        if not self.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ConfigError(f"endpoint {self.endpoint!r} must start with ipc:// or tcp://")
        check_ipc_endpoint(self.endpoint)
        if self.tcp is not None and not self.tcp.startswith("tcp://"):
            raise ConfigError(f"--tcp {self.tcp!r} must be a tcp:// endpoint")
        curve = (self.curve_secret_key, self.curve_allowed)
        listened = [("--tcp", self.tcp), ("--endpoint", self.endpoint)]
        for option, endpoint in listened:
            if endpoint and endpoint.startswith("tcp://") and not self.insecure and None in curve:
                raise ConfigError(
                    f"{option} {endpoint} leaves this host, so it needs CurveZMQ: give "
                    "--curve-secret-key (this daemon's NAME.key_secret, from `tapd keygen`) "
                    "and --curve-allowed (a directory of the NAME.key files of peers to "
                    "admit), or pass --insecure to accept anyone who can reach the port"
                )
        if self.forward is not None:
            self._check_forward(self.forward)
        if self.metrics is not None:
            metrics_address(self.metrics)

    @property
    def idle_limit(self) -> float | None:
        """Seconds without clients after which the daemon stops, or None: never. Only a
        daemon started on demand has one unless asked (systemd's, Slurm's never idle)."""
        if self.idle_exit is not None:
            return self.idle_exit
        return ON_DEMAND_IDLE_EXIT if self.started_by is not None else None

    def how_started(self) -> dict[str, Any]:
        """For `tapd status`: on demand (and by which pid) or not, and the idle limit."""
        by = self.started_by
        return {"on_demand": by is not None, "by": by, "idle_exit": self.idle_limit}

    def _check_forward(self, forward: str) -> None:
        if forward.startswith("ipc://"):
            if not forward.removeprefix("ipc://"):
                raise ConfigError(f"--forward {forward!r} names no socket path")
            check_ipc_endpoint(forward)
        elif forward.startswith("tcp://"):
            match = _TCP_ENDPOINT.fullmatch(forward)
            if match is None or not 0 < int(match["port"]) < 65536:
                raise ConfigError(
                    f"--forward {forward!r} is not a tcp://HOST:PORT endpoint "
                    "(a host name or address, and a port from 1 to 65535)"
                )
        else:
            raise ConfigError(
                f"--forward {forward!r} is not an endpoint: give the upstream daemon's "
                "ipc://PATH or tcp://HOST:PORT"
            )
        if forward in (self.endpoint, self.tcp):
            raise ConfigError(f"--forward {forward} is this daemon's own endpoint")
        keys = (self.forward_server_key, self.curve_secret_key)
        if forward.startswith("tcp://") and not self.insecure and None in keys:
            raise ConfigError(
                f"--forward {forward} leaves this host, so it needs CurveZMQ: give "
                "--forward-server-key (the upstream daemon's public NAME.key) and "
                "--curve-secret-key (this daemon's NAME.key_secret, from `tapd keygen`; "
                "the upstream admits it by its NAME.key in its --curve-allowed directory), "
                "or pass --insecure to forward unauthenticated and unencrypted"
            )


ON_DEMAND_IDLE_EXIT = 600.0

_TCP_ENDPOINT = re.compile(r"tcp://(?:\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]+):(?P<port>[0-9]+)")


_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:/\[\]\s]*):(?P<port>[0-9]+)")


def metrics_address(text: str) -> tuple[str, int]:
    """`--metrics HOST:PORT` as (host, port); an empty host is every interface."""
    match = _HOST_PORT.fullmatch(text)
    if match is None or not 0 <= int(match["port"]) < 65536:
        raise ConfigError(
            f"--metrics {text!r} is not HOST:PORT (e.g. 127.0.0.1:9100, or :9100 for every "
            "interface; port 0 picks a free one)"
        )
    return match["host"].strip("[]") or "0.0.0.0", int(match["port"])


_BY_NAME = {setting.name: setting for setting in DAEMON_SETTINGS}


def _from_toml(setting: Setting, key: str, raw: Any, path: Path) -> Any:
    """A TOML value as `setting`'s type. TOML has booleans, integers, floats and strings of
    its own, so a value of another type is a mistake to report, not text to convert:
    `queue-bytes = 2.5` would be 2 bytes, `drain-timeout = true` one second."""
    base = setting.base_type
    if base is bool:
        typed, wanted = isinstance(raw, bool), "true or false"
    elif base is int:
        typed, wanted = isinstance(raw, int) and not isinstance(raw, bool), "an integer"
    elif base is float:
        typed, wanted = isinstance(raw, int | float) and not isinstance(raw, bool), "a number"
    else:  # text, a path or one of the setting's choices
        typed, wanted = isinstance(raw, str), "a string"
    if not typed:
        raise ConfigError(f"{path}: {key} = {raw!r} is not {wanted}")
    return setting.convert(raw, str(path))


def load(
    flags: Mapping[str, Any],
    config_file: Path | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """Merge defaults, the TOML file, `TAPD_*` variables and flags (None = not given)."""
    values: dict[str, Any] = {}
    path = config_file or CONFIG.read(environ)
    if path is not None:
        try:
            table = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        for key, raw in table.get("daemon", table).items():
            setting = _BY_NAME.get(key.replace("-", "_"))
            if setting is None:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[setting.name] = _from_toml(setting, key, raw, path)
    values |= read_environment(DAEMON_SETTINGS, environ)
    for name, raw in flags.items():
        if raw is not None:
            setting = _BY_NAME[name]
            values[name] = setting.convert(raw, setting.flag or name)
    if "pidfile" not in values:
        values["pidfile"] = default_pidfile()
    return Config(**values)
