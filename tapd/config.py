"""The daemon's configuration: one frozen `Config`.

Precedence: defaults < TOML file (`--config` or `$TAPD_CONFIG`) < `TAPD_*` environment
variables < command-line flags. Only the CLI builds one from all four (`load`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tapd.errors import ConfigError
from tapd.policies import DAEMON_POLICIES, POLICIES
from tapd.runtime import check_ipc_endpoint, default_endpoint, default_pidfile


@dataclasses.dataclass(frozen=True)
class Config:
    # Local endpoint for emitters, subscribers and control (ipc in a 0700 directory).
    endpoint: str = dataclasses.field(default_factory=default_endpoint)
    # Optional extra endpoint reachable from other hosts: CurveZMQ-authenticated (our
    # key pair in curve_secret_key, the peers we admit in curve_allowed), unless insecure.
    tcp: str | None = None
    curve_secret_key: Path | None = None
    curve_allowed: Path | None = None
    insecure: bool = False
    # Forward every tap to the daemon at this endpoint (ipc:// or tcp://HOST:PORT), as
    # well as to local subscribers. On tcp, CurveZMQ: the upstream's public key in
    # forward_server_key, ours in curve_secret_key (unless insecure).
    forward: str | None = None
    forward_server_key: Path | None = None
    # What a full subscriber queue does: "block" slows the emitters, "drop_newest" drops,
    # "spool" appends to an on-disk log per subscriber (spool_dir, at most spool_bytes
    # each) and delivers it in order as the subscriber catches up; a full spool (or disk)
    # falls back to spool_fallback ("block" or "drop_newest").
    policy: str = "block"
    spool_dir: Path | None = None  # default: ~/.cache/tapd/spool/<hash of the endpoint>
    spool_bytes: int = 10 * 2**30
    spool_fallback: str = "block"
    # Bound of each subscriber's queue, in bytes of array payload.
    queue_bytes: int = 256 * 10**6
    # Bytes of taps an emitter may have sent that the daemon has not yet passed on.
    emitter_window_bytes: int = 64 * 2**20
    # A subscriber silent this long (no ack, no heartbeat) is dropped; its taps count lost.
    subscriber_timeout: float = 10.0
    # After start, how long to wait before draining rings, so that subscribers of a
    # restarted daemon are back before the taps waiting in rings are routed.
    startup_grace: float = 2.0
    # On SIGTERM, how long to keep delivering what is queued before exiting.
    drain_timeout: float = 10.0
    # Largest tap accepted, in bytes of array payload.
    max_message_bytes: int = 2**30
    pidfile: Path | None = None
    log_level: str = "info"
    # Serve Prometheus metrics over HTTP at HOST:PORT (":PORT": every interface, as
    # exporters do; port 0: any free one, logged and shown by `tapd status`).
    metrics: str | None = None

    def __post_init__(self) -> None:
        if self.policy not in DAEMON_POLICIES:
            raise ConfigError(f"policy {self.policy!r} is not one of "
                              f"{', '.join(DAEMON_POLICIES)}")  # fmt: skip
        if self.spool_fallback not in POLICIES:
            raise ConfigError(f"spool_fallback {self.spool_fallback!r} is not one of "
                              f"{', '.join(POLICIES)}")  # fmt: skip
        for name in ("queue_bytes", "emitter_window_bytes", "max_message_bytes", "spool_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("subscriber_timeout", "drain_timeout", "startup_grace"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ConfigError(f"endpoint {self.endpoint!r} must start with ipc:// or tcp://")
        check_ipc_endpoint(self.endpoint)
        if self.tcp is not None and not self.tcp.startswith("tcp://"):
            raise ConfigError(f"--tcp {self.tcp!r} must be a tcp:// endpoint")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r} is not one of "
                              f"{', '.join(level.lower() for level in LOG_LEVELS)}")  # fmt: skip
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


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

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


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def _boolean(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


def _convert(name: str, raw: Any, source: str) -> Any:
    converters: dict[str, Callable[[Any], Any]] = {
        "queue_bytes": int, "emitter_window_bytes": int, "max_message_bytes": int,
        "subscriber_timeout": float, "drain_timeout": float, "startup_grace": float,
        "pidfile": Path, "curve_secret_key": Path, "curve_allowed": Path, "insecure": _boolean,
        "forward_server_key": Path, "spool_dir": Path, "spool_bytes": int,
    }  # fmt: skip
    kind = converters.get(name, str)
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        what = getattr(kind, "__name__", "value").lstrip("_")
        raise ConfigError(f"{source}: {name}={raw!r} is not a valid {what}") from exc


def load(
    flags: Mapping[str, Any],
    config_file: Path | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Config:
    """Merge defaults, the TOML file, `TAPD_*` variables and flags (None = not given)."""
    values: dict[str, Any] = {}
    path = config_file or (Path(environ["TAPD_CONFIG"]) if "TAPD_CONFIG" in environ else None)
    if path is not None:
        try:
            table = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        for key, raw in table.get("daemon", table).items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[name] = _convert(name, raw, str(path))
    for name in _FIELDS:
        variable = f"TAPD_{name.upper()}"
        if variable in environ:
            values[name] = _convert(name, environ[variable], variable)
    for name, raw in flags.items():
        if raw is not None:
            values[name] = _convert(name, raw, f"--{name.replace('_', '-')}")
    if "pidfile" not in values:
        values["pidfile"] = default_pidfile()
    return Config(**values)
