"""What a setting is (`Setting`), how it is read from the environment, and how the
fields of `DaemonFields` and `EmitterFields` declare theirs (`daemon()`, `emitter()`).

An environment variable that is set but empty counts as unset.
"""

# No `from __future__ import annotations`: the fields' types are read at run time.
import dataclasses
import logging
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from tapd.errors import ConfigError

logger = logging.getLogger("tapd.settings")

Reader = Literal["daemon", "emitter", "subscriber", "cli", "build"]
# Everything that finds a daemon: the daemon itself, and each kind of client.
EVERY_PROCESS: tuple[Reader, ...] = ("daemon", "emitter", "subscriber", "cli")
CLIENTS: tuple[Reader, ...] = ("emitter", "subscriber", "cli")


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


def boolean_or(words: tuple[str, ...]) -> Callable[[Any], Any]:
    """`boolean`, which also takes `words` (any case), as themselves."""

    def convert(raw: Any) -> Any:
        if isinstance(raw, str) and raw.strip().lower() in words:
            return raw.strip().lower()
        return boolean(raw)

    convert.__name__ = " or ".join(["boolean", *words])
    return convert


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: Any  # int, float, bool, str, Path or a Literal of names; `| None` if optional
    help: str  # one line, for docs/SETTINGS.md's table and the start of the flag's help
    readers: tuple[Reader, ...]
    variable: str | None = None  # the environment variable, if any
    default: Any = None
    default_factory: Callable[[], Any] | None = None
    default_text: str | None = None  # the default, as docs/SETTINGS.md and --help say it
    flag: str | None = None  # a `tapd start` option (or a global one: global_flag)
    global_flag: bool = False  # given before the command: `tapd --log-level debug start`
    metavar: str | None = None
    details: str = ""  # more for --help
    toml: bool = False  # a key of the TOML file's [daemon] table
    # A deprecated setting that this one replaces: its variable is read (with a warning)
    # where this one's is not set, if its value is one this setting takes.
    legacy: "Setting | None" = None

    @property
    def base_type(self) -> Any:
        """The type without `| None` (`bool` for a boolean that also takes `words`)."""
        if self.words:
            return bool
        if isinstance(self.type, types.UnionType):
            return next(arg for arg in typing.get_args(self.type) if arg is not type(None))
        return self.type

    @property
    def words(self) -> tuple[str, ...]:
        """What a boolean setting takes besides on and off: `bool | Literal["strict"]`."""
        if typing.get_origin(self.type) not in (typing.Union, types.UnionType):
            return ()
        args = typing.get_args(self.type)
        if bool not in args:
            return ()
        literals = [arg for arg in args if typing.get_origin(arg) is Literal]
        return tuple(word for literal in literals for word in typing.get_args(literal))

    @property
    def choices(self) -> tuple[str, ...]:
        base = self.base_type
        return typing.get_args(base) if typing.get_origin(base) is Literal else ()

    @property
    def converter(self) -> Callable[[Any], Any]:
        base = self.base_type
        if base is bool:
            return boolean_or(self.words) if self.words else boolean
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
            if self.choices and raw not in self.choices:
                choices = ", ".join(self.choices)
                raise ConfigError(f"{self.variable}={raw!r} is not one of {choices}")
            return self.convert(raw, self.variable)
        if self.legacy and self.legacy.variable and (raw := environ.get(self.legacy.variable)):
            return self._read_legacy(self.legacy, raw)
        return None

    def value(self, environ: Mapping[str, str] | None = None) -> Any:
        """What the environment sets, else the default."""
        found = self.read(environ)
        if found is not None:
            return found
        return self.default_factory() if self.default_factory is not None else self.default

    def _read_legacy(self, legacy: "Setting", raw: str) -> Any:
        """A deprecated variable that several processes read: it still sets this setting
        where its value is one this setting takes, and is ignored (loudly) where only
        another process takes it, so that what was meant for the daemon never breaks an
        emitter, and what was meant for an emitter never silently changes a daemon."""
        old = f"{legacy.variable}={raw}"
        if raw not in legacy.choices:
            choices = ", ".join(legacy.choices)
            raise ConfigError(f"{legacy.variable}={raw!r} is not one of {choices}")
        reader = self.readers[0]
        why = f"{legacy.variable} is {legacy.help}"
        if raw in self.choices:
            warn_once(f"{old}: the {reader} takes it as {self.variable}={raw}. {why}")
            return self.convert(raw, str(legacy.variable))
        choices = ", ".join(self.choices)
        warn_once(
            f"{old} is not one of the {reader}'s {self.name} values ({choices}): the {reader} "
            f"ignores it and uses {self.shown_default}. {why}"
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
    type from the field (`settings_of`)."""
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


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings that the fields of `cls` declare, in order (made once per class)."""
    if cls in _SETTINGS_OF:
        return _SETTINGS_OF[cls]
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
    _SETTINGS_OF[cls] = tuple(found)
    return _SETTINGS_OF[cls]


_SETTINGS_OF: dict[type, tuple[Setting, ...]] = {}


def check_choices(fields: Any) -> None:
    """ConfigError for a field of `DaemonFields`/`EmitterFields` outside its choices."""
    for setting in settings_of(type(fields)):
        value = getattr(fields, setting.name)
        if setting.choices and value not in setting.choices:
            raise ConfigError(
                f"{setting.name} {value!r} is not one of {', '.join(setting.choices)}"
            )
        if setting.words and not isinstance(value, bool) and value not in setting.words:
            raise ConfigError(
                f"{setting.name} {value!r} is not True, False or {', '.join(setting.words)}"
            )


def read_environment(
    settings: Iterable[Setting], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """{name: value} of those of `settings` that their variables set."""
    found = {s.name: s.read(environ) for s in settings if s.variable or s.legacy}
    return {name: value for name, value in found.items() if value is not None}
