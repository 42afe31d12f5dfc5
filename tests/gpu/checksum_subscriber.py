"""A subscriber for the GPU tests: one JSON line per tap with its metadata and, per
leaf, dtype, shape, sum, first and last element (whole values of MiB-sized leaves would
make the record file huge). `--sleep-ms` makes the handler slow."""

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
    args = parser.parse_args()
    subscriber = Subscriber([args.endpoint], window=64, heartbeat=0.2)
    out = open(args.record, "a", buffering=1)  # noqa: SIM115 (closed at exit)

    def handle(arg: Any, meta: TapMeta) -> None:
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        leaves = {k: summary(v) for k, v in arg.items()} if isinstance(arg, dict) else summary(arg)
        line = {"consumer": meta.consumer, "seq": meta.seq, "step": meta.step,
                "device": meta.device, "leaves": leaves}  # fmt: skip
        out.write(json.dumps(line) + "\n")

    for consumer in args.consumers:
        subscriber.add_handler(consumer, handle)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    out.close()


if __name__ == "__main__":
    main()
