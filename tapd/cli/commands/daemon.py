"""`tapd start` and `tapd stop`: the daemon's lifecycle.

CLI -> `run_daemon()` -> `Config` -> `Daemon`. The `tapd start` options are made from
the settings table, so a new daemon setting needs no edit here.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from tapd import autostart
from tapd import config as config_module
from tapd.cli.exit_codes import ExitCode
from tapd.cli.logs import set_log_level
from tapd.cli.options import add_endpoint, add_setting, endpoint
from tapd.errors import DaemonAlreadyRunning, DaemonUnreachable
from tapd.runtime import default_pidfile, read_pidfile
from tapd.settings import CONFIG, DAEMON_SETTINGS, LOG_LEVEL

logger = logging.getLogger("tapd.cli")

READY_PREFIX = "tapd ready:"

# The options of `tapd start`: every daemon setting with a flag (--log-level comes before
# the command, as for every command), and the TOML file's.
START_OPTIONS = (*(s for s in DAEMON_SETTINGS if s.flag and not s.global_flag), CONFIG)


def register(commands: Any) -> None:
    start = commands.add_parser(
        "start",
        help="run the receiver daemon (foreground)",
        description="Run this host's receiver daemon. Each option can also be set by its "
        "TAPD_* variable (`python -m tapd.settings` lists them) or in the --config file: "
        "defaults < --config file < TAPD_* variables < flags.",
    )
    for setting in START_OPTIONS:
        add_setting(start, setting)
    start.add_argument(
        "--detach", action="store_true", help="run in the background; return once it is ready"
    )
    start.set_defaults(run=cmd_start)

    stop = commands.add_parser(
        "stop",
        help="stop the daemon (it drains first)",
        description="Ask the daemon at the endpoint for its pid and stop it. A pidfile "
        "alone is never trusted: after a crash its pid may belong to another process.",
    )
    add_endpoint(stop)
    stop.add_argument("--pidfile", type=Path, help=f"default {default_pidfile()}")
    stop.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for exit")
    stop.set_defaults(run=cmd_stop)


def daemon_config(args: argparse.Namespace) -> config_module.Config:
    flags = {setting.name: getattr(args, setting.name) for setting in START_OPTIONS}
    flags.pop(CONFIG.name)
    flags[LOG_LEVEL.name] = args.log_level
    return config_module.load(flags, args.config)


def cmd_start(args: argparse.Namespace) -> int:
    config = daemon_config(args)
    # The daemon's level, as every other setting: defaults < TOML < TAPD_LOG_LEVEL < flag.
    set_log_level(config.log_level)
    if args.detach:
        return _start_detached(config, start_argv(args))
    return run_daemon(config)


def start_argv(args: argparse.Namespace) -> list[str]:
    """The command line of a `tapd start` that does what `args` asks, in the foreground:
    rebuilt from the options and the values parsed (never a slice of sys.argv, which
    `main(argv)` does not even use)."""
    argv = [sys.executable, "-m", "tapd"]
    if args.log_level is not None:
        argv += [str(LOG_LEVEL.flag), args.log_level]
    argv.append("start")
    for setting in START_OPTIONS:
        value = getattr(args, setting.name)
        if value is True:
            argv.append(str(setting.flag))
        elif value is False and setting.default is True:  # --no-NAME
            argv.append(f"--no-{str(setting.flag).removeprefix('--')}")
        elif value is not None and value is not False:
            argv += [str(setting.flag), str(value)]
    return argv


def run_daemon(config: config_module.Config) -> int:
    from tapd.daemon.server import Daemon

    logger.debug("configuration: %s", config)
    daemon = Daemon(config)
    try:
        daemon.bind()
    except DaemonAlreadyRunning as exc:
        logger.error("%s", exc)
        return ExitCode.ALREADY_RUNNING
    except OSError as exc:
        logger.error("%s", exc)
        return ExitCode.FAILURE
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: daemon.request_stop())
    pidfile = config.pidfile
    if pidfile is not None:
        pidfile.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        pidfile.write_text(f"{os.getpid()}\n")

    def announce(endpoints: list[str]) -> None:
        print(READY_PREFIX, " ".join(endpoints), flush=True)

    # A crash in native code (libzmq's, tapd's rings) leaves its stacks in the log; one in
    # Python is logged under this pid, so that autostart's error can say why it exited.
    # A daemon that seems stuck writes every thread's stack there on `kill -USR1 <pid>`.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        daemon.serve(on_ready=announce)
    except Exception:
        logger.critical("the daemon failed", exc_info=True)
        return ExitCode.FAILURE
    finally:
        if pidfile is not None and read_pidfile(pidfile) == os.getpid():
            pidfile.unlink(missing_ok=True)
    return ExitCode.OK


def _start_detached(config: config_module.Config, argv: list[str]) -> int:
    if autostart.answers(config.endpoint, timeout=0.5):
        logger.error("a tapd daemon already answers at %s", config.endpoint)
        return ExitCode.ALREADY_RUNNING
    log = autostart.log_path(config.pidfile)
    try:
        pid = autostart.launch_detached(argv, log)
        autostart.wait_ready(
            config.endpoint, pid, log, autostart.READY_TIMEOUT, pidfile=config.pidfile
        )
    except DaemonUnreachable as exc:
        logger.error("%s", exc)
        return ExitCode.FAILURE
    print(f"tapd daemon started (pid {pid}, log {log})")
    return ExitCode.OK


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the daemon that answers at the endpoint, by the pid it gives. The pidfile is
    only compared with it: after a kill -9 its pid may have gone to another process."""
    from tapd.clients import control
    from tapd.runtime import pid_alive

    address = endpoint(args)
    pidfile = args.pidfile or default_pidfile()
    file_pid = read_pidfile(pidfile)
    try:
        stats = control.stats(address, timeout=2.0)
    except TimeoutError:
        if file_pid is not None and pid_alive(file_pid):
            logger.error(
                "no tapd daemon answers at %s; pidfile %s names pid %d, which may be another "
                "process by now: not signalling it (if it is a hung tapd daemon, stop it "
                "yourself)",
                address,
                pidfile,
                file_pid,
            )
        else:
            if file_pid is not None:
                pidfile.unlink(missing_ok=True)
            logger.error("no tapd daemon answers at %s (and no live pid in %s)", address, pidfile)
        return ExitCode.UNREACHABLE
    pid = stats.get("pid")
    if file_pid is not None and file_pid != pid:
        logger.warning(
            "pidfile %s names pid %d, but the daemon at %s is pid %s: stopping the daemon",
            pidfile,
            file_pid,
            address,
            pid,
        )
    if not address.startswith("ipc://"):
        logger.error("%s is not this host's ipc endpoint: stop that daemon on its host", address)
        return ExitCode.FAILURE
    control.request(address, "shutdown")  # (the daemon takes it on its local endpoint only)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            control.stats(address, timeout=0.2)
        except TimeoutError:
            if not isinstance(pid, int) or not pid_alive(pid):
                print(f"tapd daemon (pid {pid}) stopped")
                return ExitCode.OK
        time.sleep(0.05)
    logger.error("the daemon at %s (pid %s) still runs after %g s", address, pid, args.timeout)
    return ExitCode.FAILURE
