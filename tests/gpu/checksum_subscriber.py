"""A subscriber for the GPU tests: one JSON line per tap with its metadata and, per
leaf, dtype, shape, sum, first and last element (whole values of MiB-sized leaves would
make the record file huge). `--sleep-ms` makes the handler slow. `--verify`: for the
checksum scenario (uint32 k * (step + 1) for k < n), no line per tap but a running
tally per consumer, written every 5,000 taps and at exit: taps, sums that did not
match, seqs out of order."""

from __future__ import annotations

import argparse
import json
import signal
import time
from typing import Any

import numpy as np

from tapd_client import Subscriber, TapMeta


def summary(value: Any) -> dict[str, Any]:
    array = np.asarray(value)
    flat = array.reshape(-1)
    return {
        "dtype": str(array.dtype),
        "shape": list(array.shape),
        "sum": float(flat.astype(np.float64).sum()) if flat.size else 0.0,
        "first": flat[0].item() if flat.size else None,
        "last": flat[-1].item() if flat.size else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("consumers", nargs="+")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--sleep-ms", type=float, default=0)
    parser.add_argument("--verify", action="store_true")
    args = parser.parse_args()
    subscriber = Subscriber([args.endpoint], window=256 if args.verify else 64, heartbeat=0.2)
    out = open(args.record, "a", buffering=1)  # noqa: SIM115 (closed at exit)
    tally = {"taps": 0, "bad_sums": 0, "out_of_order": 0, "bad": []}
    next_seq: dict[tuple[str, int], int] = {}

    def verify(arg: Any, meta: TapMeta) -> None:
        values = np.asarray(arg)
        n = values.size
        expected = (meta.step + 1) * (n * (n - 1) // 2) % 2**32
        if int(values.astype(np.uint64).sum()) % 2**32 != expected or values.dtype != np.uint32:
            tally["bad_sums"] += 1
            if len(tally["bad"]) < 10:
                tally["bad"].append([meta.consumer, meta.seq, meta.step])
        key = (meta.consumer, meta.device)
        if meta.seq != next_seq.get(key, 0):
            tally["out_of_order"] += 1
        next_seq[key] = meta.seq + 1
        tally["taps"] += 1
        if tally["taps"] % 5000 == 0:
            out.write(json.dumps(tally) + "\n")

    def handle(arg: Any, meta: TapMeta) -> None:
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        leaves = {k: summary(v) for k, v in arg.items()} if isinstance(arg, dict) else summary(arg)
        line = {"consumer": meta.consumer, "seq": meta.seq, "step": meta.step,
                "device": meta.device, "leaves": leaves}  # fmt: skip
        out.write(json.dumps(line) + "\n")

    for consumer in args.consumers:
        subscriber.add_handler(consumer, verify if args.verify else handle)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    if args.verify:
        out.write(json.dumps(tally) + "\n")
    out.close()


if __name__ == "__main__":
    main()
