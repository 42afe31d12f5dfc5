"""`tapd subscribe` and `tapd tail`: subscriber processes; and how every subscriber
command runs its subscriber."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Any

from tapd.cli.exit_codes import ExitCode
from tapd.cli.options import add_endpoint, add_group

logger = logging.getLogger("tapd.cli")


def register(commands: Any) -> None:
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
    add_endpoint(subscribe, several=True)
    add_group(subscribe)
    subscribe.set_defaults(run=cmd_subscribe)

    tail = commands.add_parser(
        "tail",
        help="print taps named NAME as they arrive ('module:*' matches by prefix, '*' everything)",
    )
    tail.add_argument("names", metavar="NAME", nargs="+")
    tail.add_argument(
        "--every",
        type=_positive,
        default=1,
        metavar="N",
        help="only every Nth tap of each site (seq a multiple of N); the emitter copies "
        "no others unless another subscriber wants them",
    )
    add_endpoint(tail, several=True)
    add_group(tail)
    tail.set_defaults(run=cmd_tail)


def run_subscriber(subscriber: Any) -> int:
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
        return run_subscriber(subscriber)
    tee = Tee(sinks)
    subscriber.add_handler("*", tee)  # after MODULE:*, which keeps its consumers' taps
    try:
        return run_subscriber(subscriber)
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


def _positive(text: str) -> int:
    from tapd.protocol.schema import MAX_EVERY

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_EVERY:
        raise argparse.ArgumentTypeError(
            f"--every takes an int from 1 to {MAX_EVERY}, not {text!r}"
        )
    return value


def cmd_tail(args: argparse.Namespace) -> int:
    from tapd_client import Subscriber, TapMeta

    subscriber = Subscriber(args.endpoint, group=args.group)

    def show(arg: Any, meta: TapMeta) -> None:
        step = "" if meta.step is None else f" step={meta.step}"
        print(f"[{meta.emitter} #{meta.seq}{step}] {meta.consumer}: {arg}", flush=True)

    for name in args.names:
        subscriber.add_handler(name, show, every=args.every)
    return run_subscriber(subscriber)
