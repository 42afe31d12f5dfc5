"""A worker-pool member for the tests: `Subscriber(group=...)`, recording the seq of each
tap it handles as one JSON line, before the handler returns (so before its ack)."""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from typing import Any

from tapd_client import Subscriber, TapMeta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("consumers", nargs="+")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--group", default=None, help="none: an ungrouped subscriber")
    parser.add_argument("--name", default=None)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--sleep-ms", type=float, default=0)
    parser.add_argument(
        "--hang-after", type=int, default=-1, help="handle this many taps, then block forever"
    )
    args = parser.parse_args()

    subscriber = Subscriber(args.endpoint, name=args.name, window=args.window, heartbeat=0.2,
                            group=args.group)  # fmt: skip
    out = open(args.record, "a", buffering=1)  # noqa: SIM115 (closed at exit)
    handled = 0

    def handle(arg: Any, meta: TapMeta) -> None:
        nonlocal handled
        if handled == args.hang_after:
            out.write(json.dumps({"hung_at": meta.seq}) + "\n")
            threading.Event().wait()  # holds this tap, and the rest in flight, unacked
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        out.write(json.dumps({"consumer": meta.consumer, "seq": meta.seq,
                              "emitter": meta.emitter}) + "\n")  # fmt: skip
        handled += 1

    for consumer in args.consumers:
        subscriber.add_handler(consumer, handle)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        print("CONNECTED", flush=True)
        subscriber.run()
    out.close()


if __name__ == "__main__":
    main()
