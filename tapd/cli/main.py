"""`tapd`: run the receiver daemon, look at it, subscribe to taps, run the demo.

Each family of commands is a module of `tapd.cli.commands`; this one parses the command
line, configures logging (only the CLI does) and maps errors to exit codes.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from tapd.cli.commands import FAMILIES
from tapd.cli.exit_codes import ExitCode
from tapd.cli.logs import configure_logging, set_log_level
from tapd.errors import ConfigError, DaemonUnreachable
from tapd.settings import LOG_LEVEL

DESCRIPTION = """\
tapd moves values tapped inside compiled JAX code (tapd.tap, id_tap, id_print) out of
the JAX process, through one receiver daemon per host, to subscriber processes where the
tap functions run. The training step never waits for them.

Typical use: no daemon to start. The first tap or subscriber that finds none at this
user's default endpoint starts one, which stops after 10 idle minutes.
  tapd subscribe mymodule        # runs mymodule's tap functions (id_tap(mymodule.f, x))
  tapd tail loss                 # prints taps named "loss" as they arrive
  python train.py                # the JAX program, with tapd.tap(x, "loss") inside

Start the daemon by hand where a deployment owns it: on managed hosts (systemd,
Kubernetes, Slurm: set TAPD_AUTOSTART=0 for the clients, so that a missing daemon is an
error at once), at an endpoint other than the default (tcp://, --forward), or to keep it
running without clients:
  tapd start --detach            # once per host; `tapd stop` drains and stops it
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tapd", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        str(LOG_LEVEL.flag),
        default=None,
        help=f"{LOG_LEVEL.help} (default: ${LOG_LEVEL.variable}, else {LOG_LEVEL.shown_default})",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for family in FAMILIES:
        family.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        set_log_level(args.log_level or LOG_LEVEL.value())
        return int(args.run(args))
    except ConfigError as exc:
        logging.getLogger("tapd.cli").error("configuration error: %s", exc)
        return ExitCode.CONFIG
    except DaemonUnreachable as exc:  # (TAPD_AUTOSTART=0 and no daemon, for one)
        logging.getLogger("tapd.cli").error("%s", exc)
        return ExitCode.UNREACHABLE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
