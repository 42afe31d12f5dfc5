"""A real subscriber process for the tests: records each tap as one JSON line.
`--timed`: with the wall-clock time its handler finished (`handled_at`). `--hold FILE`:
no handler runs before FILE exists, so that a test knows none has (a stop is not held up
by it)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from typing import Any

import numpy as np

from tapd_client import Assembler, Subscriber, TapBatch, TapMeta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("consumers", nargs="+")
    parser.add_argument("--endpoint", required=True, action="append")
    parser.add_argument("--record", required=True)
    parser.add_argument("--sleep-ms", type=float, default=0)
    parser.add_argument("--raise-on", default="")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--assemble", action="store_true", help="one record per global step")
    parser.add_argument("--batch", action="store_true", help="batch handlers, records per tap")
    parser.add_argument("--every", type=int, default=1, help="sample: every=N for each consumer")
    parser.add_argument("--hold", default="", help="no handler runs before this file exists")
    parser.add_argument("--timed", action="store_true", help="records say when (handled_at)")
    args = parser.parse_args()

    subscriber = Subscriber(args.endpoint, window=args.window, heartbeat=0.2)
    out = open(args.record, "a", buffering=1)  # noqa: SIM115 (closed at exit)
    stopping = threading.Event()

    def held() -> None:
        while args.hold and not os.path.exists(args.hold) and not stopping.is_set():
            time.sleep(0.01)

    def handle(arg: Any, meta: TapMeta) -> None:
        held()
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if meta.consumer == args.raise_on:
            raise ValueError(f"deliberate failure at seq {meta.seq}")
        value = (
            {k: np.asarray(v).tolist() for k, v in arg.items()}
            if isinstance(arg, dict)
            else np.asarray(arg).tolist()
        )
        out.write(
            json.dumps(
                {
                    "consumer": meta.consumer,
                    "seq": meta.seq,
                    "step": meta.step,
                    "device": meta.device,
                    "process": meta.process,
                    "emitter": meta.emitter,
                    "transforms": [[n, p] for n, p in meta.transforms],
                    "meta": meta.meta,
                    "shard_index": meta.shard_index,
                    "mesh_coords": meta.shard.mesh_coords if meta.shard else None,
                    "global_shapes": meta.shard.global_shapes if meta.shard else None,
                    "value": value,
                    "shape": list(np.shape(arg)) if not isinstance(arg, dict) else None,
                    **({"handled_at": time.time()} if args.timed else {}),
                }
            )
            + "\n"
        )

    def handle_batch(batch: TapBatch) -> None:
        """The same records as `handle`, read from the batch's columns and stacked
        leaves (the per-tap metas only for what has no column)."""
        held()
        if args.sleep_ms:
            time.sleep(args.sleep_ms / 1000)
        if batch.consumer == args.raise_on:
            raise ValueError(f"deliberate failure at seqs {batch.seq.tolist()}")
        first = batch.meta
        metas = batch.metas()
        for i in range(len(batch)):
            leaf = batch.value
            value = (
                {k: np.asarray(v[i]).tolist() for k, v in leaf.items()}
                if isinstance(leaf, dict)
                else np.asarray(leaf[i]).tolist()
            )
            shard = metas[i].shard
            out.write(json.dumps({
                "consumer": batch.consumer,
                "seq": int(batch.seq[i]),
                "step": None if batch.step[i] < 0 else int(batch.step[i]),
                "device": None if batch.device[i] < 0 else int(batch.device[i]),
                "process": int(batch.process[i]),
                "emitter": first.emitter,
                "transforms": [[n, p] for n, p in first.transforms],
                "meta": first.meta,
                "shard_index": None if batch.shard_index is None else int(batch.shard_index[i]),
                "mesh_coords": shard.mesh_coords if shard else None,
                "global_shapes": shard.global_shapes if shard else None,
                "value": value,
                "shape": list(np.shape(leaf[i])) if not isinstance(leaf, dict) else None,
                "time_matches": abs(float(batch.time[i]) - metas[i].time) < 1e-6,
                "batch_size": len(batch),
                **({"handled_at": time.time()} if args.timed else {}),
            }) + "\n")  # fmt: skip

    def assembled(value: Any, metas: list[TapMeta]) -> None:
        out.write(json.dumps({
            "consumer": metas[0].consumer, "step": metas[0].step, "assembled": True,
            "shards": [[m.process, m.device, m.shard_index] for m in metas],
            "value": (
                {k: np.asarray(v).tolist() for k, v in value.items()}
                if isinstance(value, dict)
                else np.asarray(value).tolist()
            ),
        }) + "\n")  # fmt: skip

    for consumer in args.consumers:
        if args.assemble:
            subscriber.add_handler(consumer, Assembler(assembled))
        elif args.batch:
            subscriber.add_handler(consumer, handle_batch, batch=True, every=args.every)
        else:
            subscriber.add_handler(consumer, handle, every=args.every)

    def stop(*_: Any) -> None:
        stopping.set()
        subscriber.stop()

    signal.signal(signal.SIGTERM, stop)
    with subscriber:
        subscriber.run()
    out.close()


if __name__ == "__main__":
    main()
