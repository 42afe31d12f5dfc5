"""`tapd status`, `tapd top` and `tapd check`: looking at a running daemon."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from tapd.cli.exit_codes import ExitCode
from tapd.cli.options import add_endpoint, endpoint
from tapd.errors import ConfigError

logger = logging.getLogger("tapd.cli")


def register(commands: Any) -> None:
    status = commands.add_parser("status", help="show the daemon's counters and peers")
    add_endpoint(status)
    status.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    status.set_defaults(run=cmd_status)

    top = commands.add_parser(
        "top",
        help="a live view of the daemon: taps/s, MB/s, queues, drops per emitter and consumer",
        description="Refreshes every --interval seconds from the daemon's control socket "
        "(what `tapd status --json` shows). Keys: q quits, s changes the sort (rate, name, "
        "drops). --once prints one frame (two samples --interval apart) and exits.",
    )
    add_endpoint(top)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between frames (1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(run=cmd_top)

    check = commands.add_parser(
        "check",
        help=f"health probe: exit 0 if the daemon answers, {int(ExitCode.UNREACHABLE)} if not",
    )
    add_endpoint(check)
    check.add_argument("--timeout", type=float, default=2.0)
    check.set_defaults(run=cmd_check)


def cmd_status(args: argparse.Namespace) -> int:
    from tapd.cli.summary import summarize
    from tapd.clients import control

    address = endpoint(args)
    try:
        stats = control.stats(address)
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        print(f"tapd daemon at {address}")
        for line in summarize(stats):
            print("  " + line)
    return ExitCode.OK


def cmd_top(args: argparse.Namespace) -> int:
    from tapd.clients import control
    from tapd.tools.top import run

    address = endpoint(args)
    if args.interval <= 0:
        raise ConfigError(f"--interval must be positive, got {args.interval}")
    keys = None if args.once or not sys.stdin.isatty() else sys.stdin
    try:
        run(
            lambda: control.stats(address, timeout=2.0),
            endpoint=address,
            interval=args.interval,
            once=args.once,
            keys=keys,
        )
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    return ExitCode.OK


def cmd_check(args: argparse.Namespace) -> int:
    from tapd.clients import control

    try:
        control.stats(endpoint(args), timeout=args.timeout)
    except TimeoutError as exc:
        print(f"unhealthy: {exc}")
        return ExitCode.UNREACHABLE
    print("ok")
    return ExitCode.OK
