"""`tapd`: run the receiver daemon, look at it, subscribe to taps, run the demo.

CLI -> `run_daemon()` -> `Config` -> `Daemon`. Only this module configures logging.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tapd import config as config_module
from tapd.cli.exit_codes import ExitCode
from tapd.errors import ConfigError, DaemonAlreadyRunning, TapdError
from tapd.runtime import default_endpoint, default_pidfile

logger = logging.getLogger("tapd.cli")

READY_PREFIX = "tapd ready:"

DESCRIPTION = """\
tapd moves values tapped inside compiled JAX code (tapd.tap, id_tap, id_print) out of
the JAX process, through one receiver daemon per host, to subscriber processes where the
tap functions run. The training step never waits for them.

Typical use:
  tapd start --detach            # once per host
  tapd subscribe mymodule        # runs mymodule's tap functions (id_tap(mymodule.f, x))
  tapd tail loss                 # prints taps named "loss" as they arrive
  python train.py                # the JAX program, with tapd.tap(x, "loss") inside
"""


def _endpoint_arg(parser: argparse.ArgumentParser, *, several: bool = False) -> None:
    parser.add_argument(
        "--endpoint",
        action="append" if several else "store",
        help="the daemon's endpoint (default: $TAPD_ENDPOINT, else "
        f"ipc://<runtime dir>/tapd.sock, here {default_endpoint()})"
        + ("; repeat it to follow the daemons of several hosts" if several else ""),
    )


def _group_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group",
        metavar="NAME",
        help="join the worker pool NAME: its members (here or on other hosts) with the same "
        "consumers share the taps, each tap going to one of them",
    )


_SUBPARSERS: dict[str, argparse.ArgumentParser] = {}  # by command, filled by build_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tapd", description=DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--log-level", default=None, help="debug, info, warning or error (default info)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    start = commands.add_parser(
        "start",
        help="run the receiver daemon (foreground)",
        description="Run this host's receiver daemon.",
    )
    _endpoint_arg(start)
    start.add_argument(
        "--tcp",
        metavar="tcp://HOST:PORT",
        help="also listen here for other hosts; CurveZMQ-authenticated "
        "(see --curve-secret-key, --curve-allowed) unless --insecure",
    )
    start.add_argument(
        "--curve-secret-key",
        type=Path,
        metavar="NAME.key_secret",
        help="this daemon's key pair, from `tapd keygen` (for --tcp, and as its identity "
        "towards a --forward tcp:// upstream)",
    )
    start.add_argument(
        "--curve-allowed",
        type=Path,
        metavar="DIR",
        help="directory of the NAME.key public keys of peers to admit",
    )
    start.add_argument(
        "--forward",
        metavar="ENDPOINT",
        help="also send every tap on to the daemon at ENDPOINT (ipc://PATH, or "
        "tcp://HOST:PORT of its --tcp), so that a job's subscribers can all connect to "
        "that one daemon; local subscribers still get theirs. Taps keep their emitter's "
        "identity and seq. Flow control runs end to end: what the upstream cannot take "
        "(or while it is not up yet) waits in this daemon's queue, under --policy. "
        "An emitter's barrier_wait() returns once the upstream's subscribers have "
        "handled its taps. tcp:// needs --forward-server-key and --curve-secret-key "
        "unless --insecure",
    )
    start.add_argument(
        "--forward-server-key",
        type=Path,
        metavar="NAME.key",
        help="the upstream daemon's public key, for --forward tcp://; the upstream "
        "admits this daemon by the public half of --curve-secret-key",
    )
    start.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="let --tcp accept anyone who can reach it, and --forward tcp:// connect, "
        "unauthenticated and unencrypted",
    )
    start.add_argument(
        "--policy",
        choices=["block", "drop_newest", "spool"],
        help="when a subscriber's queue is full: block (lossless, slows the "
        "emitters), drop_newest (counted), or spool (to an on-disk log per subscriber, "
        "delivered in order as it catches up; lossless without slowing the emitters "
        "until the spool is full, then --spool-fallback). Default block",
    )
    start.add_argument(
        "--spool-dir",
        type=Path,
        help="where --policy spool keeps its logs, one directory per subscriber name "
        "(default: ~/.cache/tapd/spool/<endpoint hash>); a daemon restarted on it delivers "
        "what an earlier one left there",
    )
    start.add_argument(
        "--spool-bytes", type=int, help="bound of each subscriber's spool (default 10 GiB)"
    )
    start.add_argument(
        "--spool-fallback",
        choices=["block", "drop_newest"],
        help="what a full spool (or a full disk) does (default block)",
    )
    start.add_argument(
        "--queue-bytes", type=int, help="bound of each subscriber queue (default 256 MB)"
    )
    start.add_argument(
        "--emitter-window-bytes",
        type=int,
        help="bytes an emitter may have in flight (default 64 MiB)",
    )
    start.add_argument(
        "--subscriber-timeout",
        type=float,
        help="drop a subscriber silent this many seconds (default 10)",
    )
    start.add_argument(
        "--drain-timeout",
        type=float,
        help="on SIGTERM, keep delivering this many seconds (default 10)",
    )
    start.add_argument(
        "--startup-grace",
        type=float,
        help="seconds after start in which taps no subscriber wants yet wait for one, "
        "and emitters' rings are not drained, so subscribers can reconnect first "
        "(default 2)",
    )
    start.add_argument("--max-message-bytes", type=int, help="largest tap accepted (1 GiB)")
    start.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics: the counters and "
        "gauges of `tapd status --json`, per emitter and per subscriber (needs "
        "pip install 'tapd[metrics]'). :PORT listens on every interface; port 0 picks a "
        "free one, shown by `tapd status`",
    )
    start.add_argument(
        "--config",
        type=Path,
        help="TOML file ([daemon] table; "
        "default $TAPD_CONFIG); flags and TAPD_* variables override it",
    )
    start.add_argument("--pidfile", type=Path, help=f"default {default_pidfile()}")
    start.add_argument(
        "--detach", action="store_true", help="run in the background; return once it is ready"
    )
    _SUBPARSERS["start"] = start

    stop = commands.add_parser(
        "stop",
        help="stop the daemon (it drains first)",
        description="Ask the daemon at the endpoint for its pid and stop it. A pidfile "
        "alone is never trusted: after a crash its pid may belong to another process.",
    )
    _endpoint_arg(stop)
    stop.add_argument("--pidfile", type=Path, help=f"default {default_pidfile()}")
    stop.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for exit")

    status = commands.add_parser("status", help="show the daemon's counters and peers")
    _endpoint_arg(status)
    status.add_argument("--json", action="store_true", help="print the raw stats as JSON")

    top = commands.add_parser(
        "top",
        help="a live view of the daemon: taps/s, MB/s, queues, drops per emitter and consumer",
        description="Refreshes every --interval seconds from the daemon's control socket "
        "(what `tapd status --json` shows). Keys: q quits, s changes the sort (rate, name, "
        "drops). --once prints one frame (two samples --interval apart) and exits.",
    )
    _endpoint_arg(top)
    top.add_argument("--interval", type=float, default=1.0, help="seconds between frames (1)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")

    check = commands.add_parser(
        "check",
        help=f"health probe: exit 0 if the daemon answers, {int(ExitCode.UNREACHABLE)} if not",
    )
    _endpoint_arg(check)
    check.add_argument("--timeout", type=float, default=2.0)

    subscribe = commands.add_parser(
        "subscribe",
        help="run the tap functions of MODULE (id_tap(MODULE.f, x)), and/or sinks (--sink)",
        description="Run MODULE's tap functions on the taps of its consumers (MODULE:*), "
        "and send every other tap to each --sink.",
    )
    subscribe.add_argument("module", metavar="MODULE", nargs="?")
    subscribe.add_argument(
        "--sink",
        dest="sinks",
        metavar="SPEC",
        action="append",
        type=_sink_spec,
        default=[],
        help="TOOL[:TARGET][,OPTION[=VALUE]...], repeatable: tensorboard:LOGDIR, "
        "mlflow[:TRACKING_URI], wandb[:PROJECT]; options process_in_tag, assemble, "
        "run_name=N, experiment=E (mlflow). E.g. --sink tensorboard:runs/exp1,assemble "
        "--sink mlflow:http://host:5000,experiment=exp1",
    )
    _endpoint_arg(subscribe, several=True)
    _group_arg(subscribe)

    tail = commands.add_parser(
        "tail",
        help="print taps named NAME as they arrive ('module:*' matches by prefix, '*' everything)",
    )
    tail.add_argument("names", metavar="NAME", nargs="+")
    _endpoint_arg(tail, several=True)
    _group_arg(tail)

    record = commands.add_parser(
        "record",
        help="write taps named NAME (default all) to DIR as they arrive (docs/RECORDING.md)",
        description="Record taps into DIR: npz chunks of their arrays and a JSON-lines "
        "index of their meta, readable with numpy alone. A progress line on stderr shows "
        "taps, MB, the rate and drops. SIGINT/SIGTERM write what is held and stop; a chunk "
        "is complete on disk or absent, never half-written.",
    )
    record.add_argument("directory", metavar="DIR", type=Path)
    record.add_argument("names", metavar="NAME", nargs="*", default=["*"])
    record.add_argument("--max-bytes", type=_byte_size, help="bound DIR's size (e.g. 2G, 500M)")
    record.add_argument(
        "--when-full",
        choices=["rotate", "stop"],
        default="rotate",
        help="at --max-bytes: remove the oldest chunks (rotate, default), or stop recording",
    )
    record.add_argument(
        "--chunk-bytes", type=_byte_size, default=64 * 2**20, help="bytes per chunk (64M)"
    )
    _endpoint_arg(record, several=True)

    replay = commands.add_parser(
        "replay",
        help="publish a recording through the daemon, as its emitters did (meta.meta['replayed'])",
        description="Send the taps recorded in DIR to the daemon's subscribers, at the pace "
        "they were recorded (or --speed X times it, or --as-fast-as-possible), then wait "
        "until they are handled. Subscribers see the recorded consumers and meta; "
        "meta.meta has replayed=True and recorded_emitter.",
    )
    replay.add_argument("directory", metavar="DIR", type=Path)
    replay.add_argument("names", metavar="NAME", nargs="*", help="only these (default all)")
    pace = replay.add_mutually_exclusive_group()
    pace.add_argument("--speed", type=float, default=1.0, help="times the recorded pace (1)")
    pace.add_argument("--as-fast-as-possible", action="store_true")
    replay.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for subscribers at the end"
    )
    _endpoint_arg(replay)

    sink = commands.add_parser(
        "sink",
        help="send taps to a tool users look at: `tapd sink tensorboard --logdir DIR`, "
        "`tapd sink mlflow`, `tapd sink wandb`",
        description="Write taps named NAME (default all) to a tool: a one-element value as a "
        "scalar at meta.step (else the tap's seq), an array as a histogram, an image tapped "
        "with image=True as an image; a pytree's leaves named by their path (grads/w).",
    )
    sinks = sink.add_subparsers(dest="sink", required=True, metavar="TOOL")
    tensorboard = sinks.add_parser(
        "tensorboard",
        help="scalars, histograms and images into TensorBoard event files "
        "(pip install 'tapd[tensorboard]')",
    )
    tensorboard.add_argument("--logdir", type=Path, required=True)
    mlflow = sinks.add_parser(
        "mlflow",
        help="metrics into an MLflow run; an array as tag/mean, /min, /max, /norm; images "
        "with log_image (pip install 'tapd[mlflow]')",
    )
    mlflow.add_argument(
        "--tracking-uri", help="default: MLFLOW_TRACKING_URI, else the file store ./mlruns"
    )
    mlflow.add_argument("--experiment", help="by name, made if missing (default: Default)")
    mlflow.add_argument("--run-name")
    wandb = sinks.add_parser(
        "wandb",
        help="scalars, histograms and images into a W&B run, x-axis tapd/step; WANDB_MODE="
        "offline needs no network (pip install 'tapd[wandb]')",
    )
    wandb.add_argument("--project", help="default: tapd")
    wandb.add_argument("--run-name")
    for tool in (tensorboard, mlflow, wandb):
        tool.add_argument("names", metavar="NAME", nargs="*", default=["*"])
        tool.add_argument(
            "--process-in-tag",
            action="store_true",
            help="start each tag with the emitting process (p0/loss): for multi-process jobs",
        )
        tool.add_argument(
            "--assemble",
            action="store_true",
            help="put a sharded tap's shards together (tapd_client.Assembler, by name and "
            "step) and write the global value, instead of one tag per shard (name/shard0)",
        )
        _endpoint_arg(tool, several=True)
        _group_arg(tool)

    keygen = commands.add_parser(
        "keygen", help="write a CurveZMQ key pair: NAME.key (public), NAME.key_secret"
    )
    keygen.add_argument("name", metavar="NAME")
    keygen.add_argument("--dir", type=Path, default=Path("."), help="where (default .)")

    doctor = commands.add_parser(
        "doctor", help="what this machine offers tapd: backends, native library, daemon"
    )
    _endpoint_arg(doctor)

    clean = commands.add_parser(
        "clean",
        help="remove shared-memory rings left by killed jobs",
        description="Remove the rings in /dev/shm whose runtime directory is gone and "
        "that no live process writes or reads (a job killed with its daemon leaves its "
        "rings, 256 MB each by default). A daemon does this at start too.",
    )
    clean.add_argument("--dry-run", action="store_true", help="only say what would go")

    demo = commands.add_parser(
        "demo", help="daemon + subscriber + a small JAX training loop with taps, then a summary"
    )
    demo.add_argument("--steps", type=int, default=20)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = args.log_level or os.environ.get("TAPD_LOG_LEVEL", "info")
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        _set_log_level(level)
        return int(_COMMANDS[args.command](args))
    except ConfigError as exc:
        logger.error("configuration error: %s", exc)
        return ExitCode.CONFIG
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


def _set_log_level(level: str) -> None:
    if level.upper() not in config_module.LOG_LEVELS:
        raise ConfigError(f"log level {level!r} is not one of "
                          f"{', '.join(n.lower() for n in config_module.LOG_LEVELS)}")  # fmt: skip
    logging.getLogger("tapd").setLevel(level.upper())  # other libraries stay at WARNING


# ---- daemon commands ------------------------------------------------------------------


def _daemon_config(args: argparse.Namespace) -> config_module.Config:
    flags = {name: getattr(args, name) for name in (
        "endpoint", "tcp", "curve_secret_key", "curve_allowed", "insecure", "forward",
        "forward_server_key", "policy", "spool_dir", "spool_bytes", "spool_fallback",
        "queue_bytes", "emitter_window_bytes",
        "subscriber_timeout", "drain_timeout", "startup_grace", "max_message_bytes", "pidfile",
        "metrics",
    )}  # fmt: skip
    flags["log_level"] = args.log_level
    return config_module.load(flags, args.config)


def cmd_start(args: argparse.Namespace) -> int:
    config = _daemon_config(args)
    _set_log_level(config.log_level)  # flag < env < TOML, as every other setting
    if args.detach:
        return _start_detached(config, _start_argv(args))
    return run_daemon(config)


def _start_argv(args: argparse.Namespace) -> list[str]:
    """The command line of a `tapd start` that does what `args` asks, in the foreground:
    rebuilt from the parser's own options and the values it parsed (never a slice of
    sys.argv, which `main(argv)` does not even use)."""
    argv = [sys.executable, "-m", "tapd"]
    if args.log_level is not None:
        argv += ["--log-level", args.log_level]
    argv.append("start")
    for action in _SUBPARSERS["start"]._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest == "detach" or value in (None, False):
            continue
        option = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(option)
        else:
            argv += [option, str(value)]
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

    try:
        daemon.serve(on_ready=announce)
    finally:
        if pidfile is not None and _read_pid(pidfile) == os.getpid():
            pidfile.unlink(missing_ok=True)
    return ExitCode.OK


def _start_detached(config: config_module.Config, argv: list[str]) -> int:
    from tapd.daemon import control
    from tapd.daemon.rings import pid_alive

    try:
        control.stats(config.endpoint, timeout=0.5)
        logger.error("a tapd daemon already answers at %s", config.endpoint)
        return ExitCode.ALREADY_RUNNING
    except TimeoutError:
        pass
    log_path = (config.pidfile or default_pidfile()).with_suffix(".log")
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        # Started by a short-lived launcher, so that the daemon is nobody's child here:
        # a caller that goes on running (main() in-process) is left no zombie to reap.
        launcher = subprocess.run(
            [sys.executable, "-c", _LAUNCHER, *argv],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, check=False,
        )  # fmt: skip
    try:
        pid = int(launcher.stdout)
    except ValueError:
        logger.error("could not start the daemon; see %s", log_path)
        return ExitCode.FAILURE
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            logger.error("the daemon (pid %d) exited; see %s", pid, log_path)
            return ExitCode.FAILURE
        try:
            control.stats(config.endpoint, timeout=0.2)
        except TimeoutError:
            continue
        print(f"tapd daemon started (pid {pid}, log {log_path})")
        return ExitCode.OK
    logger.error("the daemon did not become ready in 15 s; see %s", log_path)
    return ExitCode.FAILURE


_LAUNCHER = """\
import subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                         stderr=sys.stderr, start_new_session=True)
print(child.pid)
"""


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _endpoint(args: argparse.Namespace) -> str:
    return str(args.endpoint or os.environ.get("TAPD_ENDPOINT") or default_endpoint())


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the daemon that answers at the endpoint, by the pid it gives. The pidfile is
    only compared with it: after a kill -9 its pid may have gone to another process."""
    from tapd.daemon import control
    from tapd.daemon.rings import pid_alive

    endpoint = _endpoint(args)
    pidfile = args.pidfile or default_pidfile()
    file_pid = _read_pid(pidfile)
    try:
        stats = control.stats(endpoint, timeout=2.0)
    except TimeoutError:
        if file_pid is not None and pid_alive(file_pid):
            logger.error("no tapd daemon answers at %s; pidfile %s names pid %d, which may "
                         "be another process by now: not signalling it (if it is a hung "
                         "tapd daemon, stop it yourself)", endpoint, pidfile, file_pid)  # fmt: skip
        else:
            if file_pid is not None:
                pidfile.unlink(missing_ok=True)
            logger.error("no tapd daemon answers at %s (and no live pid in %s)", endpoint, pidfile)
        return ExitCode.UNREACHABLE
    pid = stats.get("pid")
    if file_pid is not None and file_pid != pid:
        logger.warning("pidfile %s names pid %d, but the daemon at %s is pid %s: stopping "
                       "the daemon", pidfile, file_pid, endpoint, pid)  # fmt: skip
    if not endpoint.startswith("ipc://"):
        logger.error("%s is not this host's ipc endpoint: stop that daemon on its host", endpoint)
        return ExitCode.FAILURE
    control.request(endpoint, "shutdown")  # (the daemon takes it on its local endpoint only)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            control.stats(endpoint, timeout=0.2)
        except TimeoutError:
            if not isinstance(pid, int) or not pid_alive(pid):
                print(f"tapd daemon (pid {pid}) stopped")
                return ExitCode.OK
        time.sleep(0.05)
    logger.error("the daemon at %s (pid %s) still runs after %g s", endpoint, pid, args.timeout)
    return ExitCode.FAILURE


def cmd_status(args: argparse.Namespace) -> int:
    from tapd.cli.summary import summarize
    from tapd.daemon import control

    endpoint = _endpoint(args)
    try:
        stats = control.stats(endpoint)
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
    else:
        print(f"tapd daemon at {endpoint}")
        for line in summarize(stats):
            print("  " + line)
    return ExitCode.OK


def cmd_top(args: argparse.Namespace) -> int:
    from tapd.daemon import control
    from tapd.tools.top import run

    endpoint = _endpoint(args)
    if args.interval <= 0:
        raise ConfigError(f"--interval must be positive, got {args.interval}")
    try:
        run(lambda: control.stats(endpoint, timeout=2.0), endpoint=endpoint,
            interval=args.interval, once=args.once,
            keys=None if args.once or not sys.stdin.isatty() else sys.stdin)  # fmt: skip
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    return ExitCode.OK


def cmd_check(args: argparse.Namespace) -> int:
    from tapd.daemon import control

    try:
        control.stats(_endpoint(args), timeout=args.timeout)
    except TimeoutError as exc:
        print(f"unhealthy: {exc}")
        return ExitCode.UNREACHABLE
    print("ok")
    return ExitCode.OK


# ---- subscriber commands -----------------------------------------------------------------


def _run_subscriber(subscriber: Any) -> int:
    # Stop between taps, never inside a handler (a sink's write); SIGINT too, even where
    # the process was started with it ignored (a background job of a script).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: subscriber.stop())
    try:
        subscriber.connect()
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    print(
        f"subscribed to {', '.join(subscriber.consumers)} at {', '.join(subscriber.endpoints)}",
        flush=True,
    )
    try:
        subscriber.run()
    finally:
        subscriber.close()
    return ExitCode.OK


def cmd_subscribe(args: argparse.Namespace) -> int:
    from tapd_client import Subscriber
    from tapd_client.sinks import Tee, make_sink
    from tapd_client.tap_functions import serve_module

    if args.module is None and not args.sinks:
        logger.error("give a tap function MODULE, or a --sink, or both")
        return ExitCode.USAGE
    subscriber = Subscriber(args.endpoint, group=args.group)
    try:
        if args.module is not None:
            serve_module(args.module, subscriber)
    except ImportError as exc:
        logger.error("cannot import tap function module %r: %s", args.module, exc)
        return ExitCode.FAILURE
    sinks = []
    try:
        for tool, target, options in args.sinks:
            sinks.append(make_sink(tool, target, **options))
    except (ImportError, ValueError) as exc:
        logger.error("%s", exc)
        for made in sinks:  # end the runs already started
            made.close()
        return ExitCode.FAILURE
    if not sinks:
        return _run_subscriber(subscriber)
    tee = Tee(sinks)
    subscriber.add_handler("*", tee)  # after MODULE:*, which keeps its consumers' taps
    try:
        return _run_subscriber(subscriber)
    finally:
        tee.close()
        for sink in sinks:
            print(f"wrote {sink.written} points to {sink.where}", flush=True)


def _sink_spec(text: str) -> tuple[str, str | None, dict[str, Any]]:
    from tapd_client.sinks import parse_spec

    try:
        return parse_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_tail(args: argparse.Namespace) -> int:
    from tapd_client import Subscriber, TapMeta

    subscriber = Subscriber(args.endpoint, group=args.group)

    def show(arg: Any, meta: TapMeta) -> None:
        step = "" if meta.step is None else f" step={meta.step}"
        print(f"[{meta.emitter} #{meta.seq}{step}] {meta.consumer}: {arg}", flush=True)

    for name in args.names:
        subscriber.add_handler(name, show)
    return _run_subscriber(subscriber)


def _byte_size(text: str) -> int:
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


def cmd_record(args: argparse.Namespace) -> int:
    from tapd.daemon import control
    from tapd.tools.record import Progress, Recorder
    from tapd_client import Subscriber

    subscriber = Subscriber(args.endpoint)
    recorder = Recorder(args.directory, consumers=tuple(args.names),
                        chunk_bytes=args.chunk_bytes, max_bytes=args.max_bytes,
                        when_full=args.when_full, on_full=subscriber.stop)  # fmt: skip
    for name in args.names:
        subscriber.add_handler(name, recorder)
    for signum in (signal.SIGTERM, signal.SIGINT):  # stop between taps, never inside a write
        signal.signal(signum, lambda *_: subscriber.stop())
    try:
        subscriber.connect()
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    print(f"recording {', '.join(args.names)} from {', '.join(subscriber.endpoints)} into "
          f"{args.directory}", file=sys.stderr, flush=True)  # fmt: skip
    progress = Progress(lambda text: print(text, end="", file=sys.stderr, flush=True),
                        tty=sys.stderr.isatty())  # fmt: skip

    def dropped() -> int | None:
        total = 0
        for endpoint in subscriber.endpoints:
            try:
                stats = control.stats(endpoint, timeout=0.5)
            except TimeoutError:
                return None
            total += sum(s["dropped"] for s in stats["subscribers"] if s["name"] == subscriber.name)
        return total

    def tick() -> bool:
        if progress.due():
            progress.show(recorder.stats, dropped())
        return False

    try:
        subscriber.run(until=tick)
    finally:
        recorder.close()
        subscriber.close()
    progress.show(recorder.stats, dropped(), final=True)
    if recorder.full:
        print(f"{args.directory} reached --max-bytes {args.max_bytes}: recording stopped",
              file=sys.stderr)  # fmt: skip
    return ExitCode.OK


def cmd_replay(args: argparse.Namespace) -> int:
    import threading

    from tapd.tools.replay import replay

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    speed = None if args.as_fast_as_possible else args.speed
    try:
        result = replay(args.directory, _endpoint(args), speed=speed, names=args.names,
                        barrier_timeout=args.timeout, stop=stop)  # fmt: skip
    except (FileNotFoundError, ValueError, TimeoutError, TapdError) as exc:
        logger.error("replay: %s", exc)
        return ExitCode.FAILURE
    print(f"replayed {result.sent} taps ({result.bytes / 1e6:.1f} MB) in {result.seconds:.2f} s:"
          f" {result.delivered} delivered, {result.dropped} dropped, {result.unrouted} unrouted"
          f" (no subscriber), {len(result.errors)} handler errors")  # fmt: skip
    return ExitCode.FAILURE if result.errors else ExitCode.OK


def cmd_sink(args: argparse.Namespace) -> int:
    from tapd_client import Subscriber
    from tapd_client.sinks import SINKS, make_sink

    kind = SINKS[args.sink]
    options = {name: getattr(args, name) for name in kind.options if getattr(args, name)}
    try:
        handler = make_sink(args.sink, getattr(args, kind.target), **options,
                            process_in_tag=args.process_in_tag, assemble=args.assemble)  # fmt: skip
    except (ImportError, ValueError) as exc:
        logger.error("%s", exc)
        return ExitCode.FAILURE
    subscriber = Subscriber(args.endpoint, group=args.group)
    for name in args.names:
        subscriber.add_handler(name, handler)
    try:
        return _run_subscriber(subscriber)
    finally:
        handler.close()
        print(f"wrote {handler.written} points to {handler.where}", flush=True)


def cmd_clean(args: argparse.Namespace) -> int:
    from tapd.daemon.rings import sweep_stale_rings

    removed = sweep_stale_rings(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for directory, held in removed:
        print(f"{verb} {directory} ({held / 2**20:.1f} MiB)")
    total = sum(held for _, held in removed) / 2**20
    print(f"{verb} {len(removed)} ring directories, {total:.1f} MiB" if removed
          else "no stale rings")  # fmt: skip
    return ExitCode.OK


def cmd_keygen(args: argparse.Namespace) -> int:
    from tapd.security import keygen

    public, secret = keygen(args.dir, args.name)
    print(f"public key (give it to peers): {public}\nkey pair (keep it secret): {secret}")
    return ExitCode.OK


def cmd_doctor(args: argparse.Namespace) -> int:
    import importlib.metadata
    import platform

    from tapd.daemon import control
    from tapd.native import library
    from tapd.runtime import ring_dir_for, runtime_dir

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    endpoint = _endpoint(args)
    library.load()  # builds or finds it now, so that the rows below say why not
    rows = [
        ("tapd", version("tapd")),
        ("python", platform.python_version()),
        ("jax / jaxlib", f"{version('jax')} / {version('jaxlib')}"),
        ("pyzmq", version("pyzmq")),
        ("runtime dir", str(runtime_dir())),
        ("endpoint", endpoint),
        ("rings", str(ring_dir_for(endpoint) or "none (not an ipc:// endpoint)")),
    ]
    rows += list(library.status().items())
    try:
        stats = control.stats(endpoint, timeout=1.0)
        daemon = f"running ({len(stats['subscribers'])} subscribers, {len(stats['rings'])} rings)"
    except TimeoutError:
        daemon = "not answering (start one with `tapd start`)"
    rows.append(("daemon", daemon))
    rows += [(f"taps on {platform}", path) for platform, path in _tap_paths(endpoint)]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return ExitCode.OK


def _tap_paths(endpoint: str) -> list[tuple[str, str]]:
    """Which path a tap takes on each JAX platform here, and why (`tapd doctor`)."""
    from tapd.native import library
    from tapd.runtime import ring_dir_for

    if library.load() is None:
        sender = f"portable, sender thread (no ring: {library.unavailable_reason()})"
        return [(platform, sender) for platform in ("CPU", "GPU", "TPU")]
    if ring_dir_for(endpoint) is None:
        sender = "portable, sender thread (the endpoint is not a local ipc:// socket)"
        return [(platform, sender) for platform in ("CPU", "GPU", "TPU")]
    paths = []
    for platform, handler in (("CPU", "cpu"), ("GPU", "cuda")):
        if library.has_handler(handler):
            paths.append((platform, "native (tapd's FFI handler writes the ring)"))
        else:
            why = library.handler_reason(handler)
            paths.append((platform, f"portable, host callback into the ring (no handler: {why})"))
    paths.append(("TPU", "portable, host callback into the ring (TPU has no user FFI handlers)"))
    return paths


def cmd_demo(args: argparse.Namespace) -> int:
    from tapd.demo.orchestrate import run_demo

    try:
        return run_demo(steps=args.steps)
    except TapdError as exc:
        logger.error("demo failed: %s", exc)
        return ExitCode.FAILURE


_COMMANDS = {
    "start": cmd_start, "stop": cmd_stop, "status": cmd_status, "check": cmd_check,
    "subscribe": cmd_subscribe, "tail": cmd_tail, "demo": cmd_demo, "doctor": cmd_doctor,
    "keygen": cmd_keygen, "clean": cmd_clean, "record": cmd_record, "replay": cmd_replay,
    "top": cmd_top, "sink": cmd_sink,
}  # fmt: skip
