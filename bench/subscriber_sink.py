"""A tapd subscriber process for the benchmark: one consumer, a minimal handler.

    python bench/subscriber_sink.py --endpoint ipc://... --consumer NAME --result PATH
        [--sleep-ms MS] [--latency] [--window N]

The handler counts taps, optionally sleeps `--sleep-ms` (a slow tap function), and with
`--latency` records `time.time() - meta.time`: seconds from the moment the tap ran in
the emitter to the moment the handler runs here. On SIGTERM it stops, closes, and writes
`{"processed": n, "latencies_s": [...]}` to `--result`.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from tapd_client import Subscriber, TapMeta


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--window", type=int, default=64)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    subscriber = Subscriber(args.endpoint, name=f"sink:{args.consumer}", window=args.window)
    latencies: list[float] = []
    sleep_s = args.sleep_ms / 1000

    @subscriber.on(args.consumer)
    def handle(arg: Any, meta: TapMeta) -> None:
        if args.latency:
            latencies.append(time.time() - meta.time)
        if sleep_s:
            time.sleep(sleep_s)

    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    with open(args.result, "w") as out:
        json.dump({"processed": subscriber.processed, "latencies_s": latencies}, out)


if __name__ == "__main__":
    main()
