"""Options that several `tapd` commands share, declared once; and the `tapd start`
options, made from the settings table (`tapd.settings`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from tapd.runtime import default_endpoint
from tapd.settings import ENDPOINT
from tapd.settings.setting import Setting


def add_endpoint(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    parser.add_argument(
        "--endpoint",
        action="append" if several else "store",
        help=f"the daemon's endpoint (default: ${ENDPOINT.variable}, else "
        f"{ENDPOINT.shown_default}, here {default_endpoint()})"
        + ("; repeat it to follow the daemons of several hosts" if several else ""),
    )


def endpoint(args: argparse.Namespace) -> str:
    """The one endpoint a command talks to: --endpoint, else $TAPD_ENDPOINT, else the
    default."""
    return str(args.endpoint or ENDPOINT.value())


def add_group(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group",
        metavar="NAME",
        help="join the worker pool NAME: its members (here or on other hosts) with the same "
        "consumers share the taps, each tap going to one of them",
    )


def add_setting(parser: argparse.ArgumentParser, setting: Setting) -> None:
    """`setting`'s flag, whose value (None when not given) lands in `args.<name>`."""
    assert setting.flag is not None, setting
    text = setting.help + (f"; {setting.details}" if setting.details else "")
    has_default = setting.default is not None or setting.default_text is not None
    if has_default and setting.base_type is not bool:
        text += f" (default {setting.shown_default})"
    options: dict[str, Any] = {"dest": setting.name, "help": text, "default": None}
    if setting.base_type is bool:  # (on by default: --NAME and --no-NAME)
        options["action"] = argparse.BooleanOptionalAction if setting.default else "store_true"
    elif setting.choices:
        options["choices"] = list(setting.choices)
    elif setting.base_type in (int, float, Path):
        options["type"] = setting.base_type
    if setting.metavar is not None:
        options["metavar"] = setting.metavar
    parser.add_argument(setting.flag, **options)


def byte_size(text: str) -> int:
    """`500M`, `2G`, `1.5GiB`, `1000000`: bytes (K/M/G/T are powers of 1024)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    stripped = text.strip().upper().removesuffix("B").removesuffix("I")
    number = stripped.rstrip("KMGT")
    unit = stripped[len(number) :]
    try:
        value = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 500M, 2G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive size: {text!r}")
    return value
