"""Every tapd setting, declared once: its name, type, default, environment variable,
`tapd start` flag, which processes read it, and what it does.

The daemon's settings are the fields of `DaemonFields` (checked by `tapd.config.Config`,
which the `tapd start` options and the TOML converter are made from); the emitter's are
the fields of `EmitterFields` (checked by `tapd.emitter.settings.EmitterSettings`); the
rest are read where they are used, through `Setting.read`. A new daemon setting is one
field below. `python -m tapd.settings --markdown` prints README's table of them.

An environment variable that is set but empty counts as unset. This module is read by
every process (no JAX, no sockets) and imports nothing of tapd's but errors and policies.
"""

# No `from __future__ import annotations`: the fields' types are read at run time.
import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from tapd.errors import ConfigError
from tapd.policies import DaemonPolicy, Policy

logger = logging.getLogger("tapd.settings")

Reader = Literal["daemon", "emitter", "subscriber", "cli", "build"]
# Everything that finds a daemon: the daemon itself, and each kind of client.
EVERY_PROCESS: tuple[Reader, ...] = ("daemon", "emitter", "subscriber", "cli")
CLIENTS: tuple[Reader, ...] = ("emitter", "subscriber", "cli")

Backend = Literal["auto", "native", "portable"]

SOCKET_NAME = "tapd.sock"
PIDFILE_NAME = "tapd.pid"


def boolean(raw: Any) -> bool:
    """1/true/yes/on or 0/false/no/off (any case), as environment variables spell them."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(raw)


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: Any  # int, float, bool, str, Path or a Literal of names; `| None` if optional
    help: str  # one line, for README's table and the start of the flag's help
    readers: tuple[Reader, ...]
    variable: str | None = None  # the environment variable, if any
    default: Any = None
    default_factory: Callable[[], Any] | None = None
    default_text: str | None = None  # the default, as README and --help say it
    flag: str | None = None  # a `tapd start` option (or a global one: global_flag)
    global_flag: bool = False  # given before the command: `tapd --log-level debug start`
    metavar: str | None = None
    details: str = ""  # more for --help
    toml: bool = False  # a key of the TOML file's [daemon] table
    legacy: str | None = None  # an older variable, read (with a warning) if `variable` is not

    @property
    def base_type(self) -> Any:
        """The type without `| None`."""
        if isinstance(self.type, types.UnionType):
            return next(arg for arg in typing.get_args(self.type) if arg is not type(None))
        return self.type

    @property
    def choices(self) -> tuple[str, ...]:
        base = self.base_type
        return typing.get_args(base) if typing.get_origin(base) is Literal else ()

    @property
    def converter(self) -> Callable[[Any], Any]:
        base = self.base_type
        if base is bool:
            return boolean
        if base in (int, float, Path):
            return typing.cast(Callable[[Any], Any], base)
        return str

    @property
    def shown_default(self) -> str:
        if self.default_text is not None:
            return self.default_text
        if self.default is None:
            return "none"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return str(self.default)

    def field(self) -> Any:
        """This setting as a dataclass field (of `DaemonFields`, `EmitterFields`)."""
        metadata = {"setting": self}
        if self.default_factory is not None:
            return dataclasses.field(default_factory=self.default_factory, metadata=metadata)
        return dataclasses.field(default=self.default, metadata=metadata)

    def convert(self, raw: Any, source: str) -> Any:
        """`raw` (text from a variable or flag, or a TOML value) as this setting's type;
        ConfigError naming `source` if it is not one."""
        converter = self.converter
        try:
            return converter(raw)
        except (TypeError, ValueError) as exc:
            what = getattr(converter, "__name__", "value")
            raise ConfigError(f"{source}: {self.name}={raw!r} is not a valid {what}") from exc

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value its environment variable gives (converted), or None if unset."""
        environ = os.environ if environ is None else environ
        if self.variable is not None and (raw := environ.get(self.variable)):
            return self.convert(raw, self.variable)
        if self.legacy is not None and (raw := environ.get(self.legacy)):
            return self._read_legacy(raw)
        return None

    def _read_legacy(self, raw: str) -> Any:
        """A deprecated variable that several settings used to share: it still sets this
        one where its value is one this setting takes, and is ignored (loudly) where only
        another does, so that what was meant for the daemon never breaks an emitter."""
        legacy = typing.cast(str, self.legacy)
        heirs = [s for s in SETTINGS if s.legacy == legacy]
        takers = [s for s in heirs if raw in s.choices]
        if not takers:
            names = sorted({choice for s in heirs for choice in s.choices})
            raise ConfigError(f"{legacy}={raw!r} is not one of {', '.join(names)}")
        instead = " and ".join(f"{s.variable} for the {s.readers[0]}" for s in heirs)
        where = " and the ".join(sorted({s.readers[0] for s in heirs}))
        deprecated = f"{legacy} is deprecated (the {where} both read it): set {instead}"
        if self in takers:
            warn_once(f"{deprecated}; taking {legacy}={raw} as {self.variable}={raw}")
            return self.convert(raw, legacy)
        warn_once(
            f"{legacy}={raw} is not one of the {self.readers[0]}'s {self.name} values "
            f"({', '.join(self.choices)}): the {self.readers[0]} ignores it and uses "
            f"{self.shown_default}. {deprecated}"
        )
        return None


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` once per process (settings are read again by each configure())."""
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


_DERIVED: Any = object()  # variable TAPD_<NAME>; flag --<name> for the daemon's


def _declare(
    readers: tuple[Reader, ...],
    default: Any,
    help: str,
    *,
    variable: str | None = _DERIVED,
    flag: str | None = _DERIVED,
    **more: Any,
) -> Any:
    """A field of `DaemonFields` or `EmitterFields`, whose Setting takes its name and
    type from the field (`_settings_of`)."""
    declared = {"readers": readers, "default": default, "help": help, "variable": variable}
    declared |= {"flag": flag, **more}
    return dataclasses.field(default=default, metadata={"declare": declared})


def daemon(
    default: Any, help: str, *, readers: tuple[Reader, ...] = ("daemon",), **more: Any
) -> Any:
    """A daemon setting: a `tapd start` flag, a TOML key and a TAPD_* variable."""
    return _declare(readers, default, help, toml=True, **more)


def emitter(default: Any, help: str, **more: Any) -> Any:
    """An emitter setting: a `tapd.configure()` keyword and a TAPD_* variable."""
    return _declare(("emitter",), default, help, flag=None, **more)


def _settings_of(cls: type) -> tuple[Setting, ...]:
    found = []
    for field in dataclasses.fields(cls):
        if "setting" in field.metadata:  # shared with another process's fields
            found.append(field.metadata["setting"])
            continue
        declared = dict(field.metadata["declare"])
        if declared["variable"] is _DERIVED:
            declared["variable"] = f"TAPD_{field.name.upper()}"
        if declared["flag"] is _DERIVED:
            declared["flag"] = f"--{field.name.replace('_', '-')}"
        found.append(Setting(field.name, field.type, **declared))
    return tuple(found)


# ---- where the daemon lives ---------------------------------------------------------------

RUNTIME_DIR = Setting(
    "runtime_dir",
    Path | None,
    "the per-user 0700 directory of the daemon's socket, pidfile and log",
    EVERY_PROCESS,
    variable="TAPD_RUNTIME_DIR",
    default_text="$XDG_RUNTIME_DIR/tapd, else /tmp/tapd-$UID",
)


def runtime_dir() -> Path:
    """The runtime directory path (not created)."""
    if explicit := RUNTIME_DIR.read():
        return typing.cast(Path, explicit)
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / "tapd"
    return Path(f"/tmp/tapd-{os.getuid()}")


def default_endpoint() -> str:
    return f"ipc://{runtime_dir() / SOCKET_NAME}"


def default_pidfile() -> Path:
    return runtime_dir() / PIDFILE_NAME


ENDPOINT = Setting(
    "endpoint",
    str,
    "the daemon's endpoint: where it listens, and where emitters, subscribers and the "
    "`tapd` command find it",
    EVERY_PROCESS,
    variable="TAPD_ENDPOINT",
    default_factory=default_endpoint,
    default_text="ipc://<runtime dir>/tapd.sock",
    flag="--endpoint",
    toml=True,
)

# ---- the daemon (`tapd start`) --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DaemonFields:
    endpoint: str = ENDPOINT.field()
    # Optional extra endpoint reachable from other hosts: CurveZMQ-authenticated (our
    # key pair in curve_secret_key, the peers we admit in curve_allowed), unless insecure.
    tcp: str | None = daemon(
        None,
        "also listen here for other hosts; CurveZMQ-authenticated (see --curve-secret-key, "
        "--curve-allowed) unless --insecure",
        metavar="tcp://HOST:PORT",
    )
    curve_secret_key: Path | None = daemon(
        None,
        "this daemon's key pair, from `tapd keygen` (for --tcp, and as its identity towards "
        "a --forward tcp:// upstream)",
        metavar="NAME.key_secret",
    )
    curve_allowed: Path | None = daemon(
        None, "directory of the NAME.key public keys of peers to admit", metavar="DIR"
    )
    insecure: bool = daemon(
        False,
        "let --tcp accept anyone who can reach it, and --forward tcp:// connect, "
        "unauthenticated and unencrypted",
    )
    # Forward every tap to the daemon at this endpoint, as well as to local subscribers.
    forward: str | None = daemon(
        None,
        "also send every tap on to the daemon at ENDPOINT (ipc://PATH, or tcp://HOST:PORT "
        "of its --tcp)",
        metavar="ENDPOINT",
        details="so that a job's subscribers can all connect to that one daemon; local "
        "subscribers still get theirs. Taps keep their emitter's identity and seq. Flow "
        "control runs end to end: what the upstream cannot take (or while it is not up "
        "yet) waits in this daemon's queue, under --policy. An emitter's barrier_wait() "
        "returns once the upstream's subscribers have handled its taps. tcp:// needs "
        "--forward-server-key and --curve-secret-key unless --insecure",
    )
    forward_server_key: Path | None = daemon(
        None,
        "the upstream daemon's public key, for --forward tcp://; the upstream admits this "
        "daemon by the public half of --curve-secret-key",
        metavar="NAME.key",
    )
    # What a full subscriber queue does; a full spool (or disk) falls back to spool_fallback.
    policy: DaemonPolicy = daemon(
        "block",
        "when a subscriber's queue is full: block (lossless, slows the emitters), "
        "drop_newest (counted), or spool (to an on-disk log per subscriber, delivered in "
        "order as it catches up; lossless without slowing the emitters until the spool is "
        "full, then --spool-fallback)",
        variable="TAPD_DAEMON_POLICY",
        legacy="TAPD_POLICY",
    )
    spool_dir: Path | None = daemon(
        None,
        "where --policy spool keeps its logs, one directory per subscriber name; a daemon "
        "restarted on it delivers what an earlier one left there",
        default_text="~/.cache/tapd/spool/<endpoint hash>",
    )
    spool_bytes: int = daemon(
        10 * 2**30, "bound of each subscriber's spool, in bytes", default_text="10 GiB"
    )
    spool_fallback: Policy = daemon("block", "what a full spool (or a full disk) does")
    queue_bytes: int = daemon(
        256 * 10**6,
        "bound of each subscriber queue, in bytes of array payload",
        default_text="256 MB",
    )
    emitter_window_bytes: int = daemon(
        64 * 2**20,
        "bytes of taps an emitter may have sent that the daemon has not yet passed on",
        default_text="64 MiB",
    )
    subscriber_timeout: float = daemon(
        10.0, "drop a subscriber silent (no ack, no heartbeat) this many seconds"
    )
    startup_grace: float = daemon(
        2.0,
        "seconds after start in which taps no subscriber wants yet wait for one, and "
        "emitters' rings are not drained, so that subscribers can reconnect first",
    )
    drain_timeout: float = daemon(10.0, "on SIGTERM, keep delivering this many seconds")
    max_message_bytes: int = daemon(
        2**30, "largest tap accepted, in bytes of array payload", default_text="1 GiB"
    )
    pidfile: Path | None = daemon(
        None, "where the daemon writes its pid", default_text="<runtime dir>/tapd.pid"
    )
    log_level: str = daemon(
        "info",
        "debug, info, warning or error",
        readers=("daemon", "cli"),
        flag="--log-level",
        global_flag=True,
    )
    # ":PORT": every interface, as exporters do; port 0: any free one.
    metrics: str | None = daemon(
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics: the counters and gauges of "
        "`tapd status --json`, per emitter and per subscriber (needs pip install "
        "'tapd[metrics]'). :PORT listens on every interface; port 0 picks a free one, "
        "shown by `tapd status`",
        metavar="HOST:PORT",
    )


CONFIG = Setting(
    "config",
    Path | None,
    "TOML file of daemon settings (a [daemon] table); TAPD_* variables and flags override it",
    ("daemon",),
    variable="TAPD_CONFIG",
    flag="--config",
)

# ---- the emitter (the JAX process; `tapd.configure()`) --------------------------------------


@dataclasses.dataclass(frozen=True)
class EmitterFields:
    endpoint: str = ENDPOINT.field()
    policy: Policy = emitter(
        "block",
        "when the emitter's buffer (or ring) is full: block (pauses the computation, "
        "lossless) or drop_newest (counted)",
        variable="TAPD_EMITTER_POLICY",
        legacy="TAPD_POLICY",
    )
    backend: Backend = emitter(
        "auto",
        "native: the XLA FFI handler writes a shared-memory ring (CPU, GPU; daemon on this "
        "host); portable: jax.debug.callback; auto: native where it can be used",
    )
    buffer_bytes: int = emitter(
        256 * 10**6,
        "the emitter's own buffer (or ring), in bytes of payload (host_callback's 256 MB)",
        default_text="256 MB",
    )
    exit_timeout: float = emitter(
        10.0, "how long interpreter exit waits for taps to be delivered, in seconds"
    )
    block_warning_after: float = emitter(
        5.0, "under block, warn when one tap has waited this long for buffer space", variable=None
    )


CONNECT_TIMEOUT = Setting(
    "connect_timeout",
    float,
    "seconds to wait for a daemon before a tap function of this process fails at trace time",
    ("emitter",),
    variable="TAPD_CONNECT_TIMEOUT",
    default=10.0,
)
LOCAL_FALLBACK = Setting(
    "local_fallback",
    bool,
    "run importable tap functions that no subscriber takes in the JAX process (0: only in "
    "subscriber processes; their taps count as unrouted meanwhile)",
    ("emitter",),
    variable="TAPD_LOCAL_FALLBACK",
    default=True,
)

# ---- clients of a tcp:// daemon ---------------------------------------------------------------

CURVE_SERVER_KEY = Setting(
    "curve_server_key",
    Path | None,
    "the daemon's public NAME.key, for a client of a tcp:// daemon (with TAPD_CURVE_SECRET)",
    CLIENTS,
    variable="TAPD_CURVE_SERVER_KEY",
)
CURVE_SECRET = Setting(
    "curve_secret",
    Path | None,
    "this client's NAME.key_secret, from `tapd keygen`, which the daemon admits by its "
    "NAME.key (with TAPD_CURVE_SERVER_KEY)",
    CLIENTS,
    variable="TAPD_CURVE_SECRET",
)

# ---- building the native library (setup.py, or on first use) --------------------------------
# tapd/native/build.py and setup.py read these themselves: setup.py runs without tapd.

XLA_FFI_INCLUDE = Setting(
    "xla_ffi_include",
    Path | None,
    "a directory with jaxlib's XLA FFI headers (xla/ffi/api/ffi.h) to build the CPU handler "
    "against",
    ("build",),
    variable="TAPD_XLA_FFI_INCLUDE",
    default_text="an importable jaxlib's",
)
CUDA_RUNTIME_DIR = Setting(
    "cuda_runtime_dir",
    Path | None,
    "a CUDA runtime (include/, and lib/ or lib64/ with libcudart.so.12 or .13) to build the "
    "CUDA handler against, and only it",
    ("build",),
    variable="TAPD_CUDA_RUNTIME_DIR",
    default_text="JAX's CUDA wheels, $CUDA_HOME, /usr/local/cuda",
)
BUILD_WITH_JAXLIB = Setting(
    "build_with_jaxlib",
    bool | None,
    "whether `pip install` asks for jaxlib, for its FFI headers (1 or 0)",
    ("build",),
    variable="TAPD_BUILD_WITH_JAXLIB",
    default_text="where jaxlib has wheels",
)
BUILD_JAXLIB = Setting(
    "build_jaxlib",
    str,
    "the jaxlib requirement that `pip install` asks for",
    ("build",),
    variable="TAPD_BUILD_JAXLIB",
    default="jaxlib>=0.6",
)

DAEMON_SETTINGS = _settings_of(DaemonFields)
EMITTER_SETTINGS = _settings_of(EmitterFields)
# A deprecated variable, read only through the settings that replace it (Setting.legacy).
POLICY = Setting(
    "policy",
    DaemonPolicy,
    "deprecated: the daemon and the emitter both read it; use TAPD_DAEMON_POLICY and "
    "TAPD_EMITTER_POLICY",
    ("daemon", "emitter"),
    variable="TAPD_POLICY",
)


def _every_setting() -> tuple[Setting, ...]:
    """Each setting once (the endpoint is a field of both the daemon and the emitter)."""
    listed = [
        *DAEMON_SETTINGS,
        CONFIG,
        RUNTIME_DIR,
        *EMITTER_SETTINGS,
        CONNECT_TIMEOUT,
        LOCAL_FALLBACK,
        CURVE_SERVER_KEY,
        CURVE_SECRET,
        XLA_FFI_INCLUDE,
        CUDA_RUNTIME_DIR,
        BUILD_WITH_JAXLIB,
        BUILD_JAXLIB,
        POLICY,
    ]
    return tuple(dict.fromkeys(listed))


SETTINGS = _every_setting()


def check_choices(fields: Any) -> None:
    """ConfigError for a field of `DaemonFields`/`EmitterFields` outside its choices."""
    for setting in _settings_of(type(fields)):
        value = getattr(fields, setting.name)
        if setting.choices and value not in setting.choices:
            raise ConfigError(
                f"{setting.name} {value!r} is not one of {', '.join(setting.choices)}"
            )


def read_environment(
    settings: Iterable[Setting], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """{name: value} of those of `settings` that their variables set."""
    found = {s.name: s.read(environ) for s in settings if s.variable or s.legacy}
    return {name: value for name, value in found.items() if value is not None}


# ---- README's table ----------------------------------------------------------------------------


def _type_text(setting: Setting) -> str:
    if setting.choices:
        return " \\| ".join(f"`{choice}`" for choice in setting.choices)
    names = {
        bool: "boolean",
        int: "integer",
        float: "seconds"
        if "timeout" in setting.name or setting.name.endswith(("_grace", "_after"))
        else "number",
        Path: "path",
    }
    return names.get(setting.base_type, "text")


def markdown_table() -> str:
    """README's table of every TAPD_* variable (`python -m tapd.settings --markdown`)."""
    rows = [
        "| variable | read by | type | default | also | what it does |",
        "|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        if setting.variable is None:
            continue
        also = []
        if setting.flag:
            also.append(
                f"`{setting.flag}`" if setting.global_flag else f"`tapd start {setting.flag}`"
            )
        if setting.toml:
            also.append(f"TOML `{setting.name}`")
        if "emitter" in setting.readers and setting in EMITTER_SETTINGS:
            also.append(f"`tapd.configure({setting.name}=)`")
        cells = [
            f"`{setting.variable}`",
            ", ".join(setting.readers),
            _type_text(setting),
            setting.shown_default.replace("|", "\\|"),
            ", ".join(also),
            setting.help.replace("|", "\\|"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tapd.settings", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print README's table")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        for setting in SETTINGS:
            print(f"{setting.variable or '-':<24} {setting.name:<22} {setting.shown_default}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
