"""A tapd subscriber process for the benchmark: one consumer, a minimal handler.

    python bench/subscriber_sink.py --endpoint ipc://... [--endpoint ...] --consumer NAME
        --result PATH [--sleep-ms MS] [--latency] [--tally] [--window N] [--batch]

It follows every daemon given (one per host of a multi-host job). The handler counts
taps, optionally sleeps `--sleep-ms` (a slow tap function), with `--latency` records
`time.time() - meta.time`: seconds from the moment the tap ran in the emitter to the
moment the handler runs here, and with `--tally` adds up taps and array bytes per
(consumer, emitting process). On SIGTERM it stops, closes, and writes
`{"processed": n, "latencies_s": [...], "tally": {consumer: {process: [taps, bytes]}}}`
to `--result`. With `--batch` the handler is a batch handler (TapBatch per site and
message) doing the same per batch, from its columns.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

from tapd_client import Subscriber, TapBatch, TapMeta


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", action="append", required=True)
    parser.add_argument("--consumer", required=True)
    parser.add_argument("--result", required=True)
    parser.add_argument("--sleep-ms", type=float, default=0.0)
    parser.add_argument("--latency", action="store_true")
    parser.add_argument("--tally", action="store_true")
    parser.add_argument("--window", type=int, help="taps in flight (default: the library's)")
    parser.add_argument("--batch", action="store_true", help="a batch handler (TapBatch)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    window = {"window": args.window} if args.window else {}
    subscriber = Subscriber(args.endpoint, name=f"sink:{args.consumer}", **window)
    latencies: list[float] = []
    tally: dict[tuple[str, int], list[int]] = {}
    sleep_s = args.sleep_ms / 1000

    def handle_batch(batch: TapBatch) -> None:
        if args.latency:
            latencies.extend((time.time() - batch.time).tolist())
        if args.tally:
            counts = tally.setdefault((batch.consumer, batch.meta.process), [0, 0])
            counts[0] += len(batch)
            counts[1] += sum(leaf.nbytes for leaf in batch.leaves)
        if sleep_s:
            time.sleep(sleep_s * len(batch))

    def handle(arg: Any, meta: TapMeta) -> None:
        if args.latency:
            latencies.append(time.time() - meta.time)
        if args.tally:
            counts = tally.setdefault((meta.consumer, meta.process), [0, 0])
            counts[0] += 1
            counts[1] += getattr(arg, "nbytes", 0)
        if sleep_s:
            time.sleep(sleep_s)

    if args.batch:
        subscriber.add_handler(args.consumer, handle_batch, batch=True)
    else:
        subscriber.add_handler(args.consumer, handle)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    by_consumer: dict[str, dict[str, list[int]]] = {}
    for (consumer, process), counts in tally.items():
        by_consumer.setdefault(consumer, {})[str(process)] = counts
    with open(args.result, "w") as out:
        result = {"processed": subscriber.processed, "latencies_s": latencies, "tally": by_consumer}
        json.dump(result, out)


if __name__ == "__main__":
    main()
