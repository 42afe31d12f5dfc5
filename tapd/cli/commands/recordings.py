"""`tapd record` and `tapd replay`: taps to disk and back (docs/RECORDING.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from tapd.cli.exit_codes import ExitCode
from tapd.cli.options import add_endpoint, byte_size, endpoint
from tapd.errors import TapdError

logger = logging.getLogger("tapd.cli")


def register(commands: Any) -> None:
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
    record.add_argument("--max-bytes", type=byte_size, help="bound DIR's size (e.g. 2G, 500M)")
    record.add_argument(
        "--when-full",
        choices=["rotate", "stop"],
        default="rotate",
        help="at --max-bytes: remove the oldest chunks (rotate, default), or stop recording",
    )
    record.add_argument(
        "--chunk-bytes", type=byte_size, default=64 * 2**20, help="bytes per chunk (64M)"
    )
    add_endpoint(record, several=True)
    record.set_defaults(run=cmd_record)

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
    add_endpoint(replay)
    replay.set_defaults(run=cmd_replay)


def _stderr(text: str) -> None:
    print(text, end="", file=sys.stderr, flush=True)


def cmd_record(args: argparse.Namespace) -> int:
    from tapd.clients import control
    from tapd.tools.record import Progress, Recorder
    from tapd_client import Subscriber

    subscriber = Subscriber(args.endpoint)
    recorder = Recorder(
        args.directory,
        consumers=tuple(args.names),
        chunk_bytes=args.chunk_bytes,
        max_bytes=args.max_bytes,
        when_full=args.when_full,
        on_full=subscriber.stop,
    )
    for name in args.names:
        subscriber.add_handler(name, recorder)
    for signum in (signal.SIGTERM, signal.SIGINT):  # stop between taps, never inside a write
        signal.signal(signum, lambda *_: subscriber.stop())
    try:
        subscriber.connect()
    except TimeoutError as exc:
        logger.error("%s", exc)
        return ExitCode.UNREACHABLE
    sources = ", ".join(subscriber.endpoints)
    _stderr(f"recording {', '.join(args.names)} from {sources} into {args.directory}\n")
    progress = Progress(_stderr, tty=sys.stderr.isatty())

    def dropped() -> int | None:
        total = 0
        for address in subscriber.endpoints:
            try:
                stats = control.stats(address, timeout=0.5)
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
        _stderr(f"{args.directory} reached --max-bytes {args.max_bytes}: recording stopped\n")
    return ExitCode.OK


def cmd_replay(args: argparse.Namespace) -> int:
    from tapd.tools.replay import StopFlag, replay

    stop = StopFlag()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    speed = None if args.as_fast_as_possible else args.speed
    try:
        result = replay(
            args.directory,
            endpoint(args),
            speed=speed,
            names=args.names,
            barrier_timeout=args.timeout,
            stop=stop,
        )
    except (FileNotFoundError, ValueError, TimeoutError, TapdError) as exc:
        logger.error("replay: %s", exc)
        return ExitCode.FAILURE
    print(
        f"replayed {result.sent} taps ({result.bytes / 1e6:.1f} MB) in {result.seconds:.2f} s:"
        f" {result.delivered} delivered, {result.dropped} dropped, {result.unrouted} unrouted"
        f" (no subscriber), {len(result.errors)} handler errors"
    )
    return ExitCode.FAILURE if result.errors else ExitCode.OK
