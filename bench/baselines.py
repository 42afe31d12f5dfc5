"""Throughput baselines without tapd: raw pyzmq PUSH/PULL over ipc, multiprocessing.Queue.

    python bench/baselines.py zmq   --size BYTES --count N --endpoint ipc://...
    python bench/baselines.py queue --size BYTES --count N

This process is the producer; it spawns one consumer process. One warm-up message
makes sure the consumer is connected and running; then the producer times from its
first send of `count` messages of `size` bytes (one float32 numpy array, as tapd's
payload) until the consumer reports it has received the last one. Prints one JSON
line: {"seconds": ...}. No JAX here, so spawning the consumer is cheap.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from typing import Any

import numpy as np
import zmq

SPAWN = mp.get_context("spawn")  # never fork: the parent may hold threads
WAIT_TIMEOUT = 120.0


def payload(size: int) -> np.ndarray:
    """A float32 array of `size` bytes, like the tapped arrays."""
    return np.arange(size // 4, dtype=np.float32)


# ---- raw pyzmq --------------------------------------------------------------------------


def zmq_consumer(endpoint: str, count: int, warm: Any, done: Any) -> None:
    """Bind PULL, take one warm-up message, then `count` messages (zero-copy receive)."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVTIMEO, int(WAIT_TIMEOUT * 1000))  # never outlive a dead producer
    pull.bind(endpoint)
    pull.recv(copy=False)
    warm.set()
    for _ in range(count):
        pull.recv(copy=False)
    done.set()
    pull.close(linger=0)
    context.term()


def zmq_producer(endpoint: str, size: int, count: int) -> float:
    """Seconds to push `count` messages of `size` bytes to a consumer process."""
    warm, done = SPAWN.Event(), SPAWN.Event()
    consumer = SPAWN.Process(target=zmq_consumer, args=(endpoint, count, warm, done), daemon=True)
    consumer.start()
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(endpoint)  # connects (and retries) in the background until the bind
    data = payload(size)
    push.send(data, copy=False)
    _wait(warm, consumer, "the zmq consumer to receive the warm-up message")
    started = time.perf_counter()
    for _ in range(count):
        push.send(data, copy=False)
    _wait(done, consumer, "the zmq consumer to receive everything")
    elapsed = time.perf_counter() - started
    push.close(linger=0)
    context.term()
    consumer.join(WAIT_TIMEOUT)
    return elapsed


# ---- multiprocessing.Queue ----------------------------------------------------------------


def queue_consumer(queue: Any, count: int, warm: Any, done: Any) -> None:
    """Take one warm-up array, then `count` arrays, from the queue."""
    queue.get(timeout=WAIT_TIMEOUT)  # never outlive a dead producer
    warm.set()
    for _ in range(count):
        queue.get(timeout=WAIT_TIMEOUT)
    done.set()


def queue_producer(size: int, count: int) -> float:
    """Seconds to put `count` numpy arrays of `size` bytes through a multiprocessing.Queue."""
    queue = SPAWN.Queue()
    warm, done = SPAWN.Event(), SPAWN.Event()
    consumer = SPAWN.Process(target=queue_consumer, args=(queue, count, warm, done), daemon=True)
    consumer.start()
    data = payload(size)
    queue.put(data)
    _wait(warm, consumer, "the queue consumer to receive the warm-up array")
    started = time.perf_counter()
    for _ in range(count):
        queue.put(data)
    _wait(done, consumer, "the queue consumer to receive everything")
    elapsed = time.perf_counter() - started
    consumer.join(WAIT_TIMEOUT)
    return elapsed


def _wait(event: Any, consumer: Any, what: str) -> None:
    if not event.wait(WAIT_TIMEOUT):
        consumer.kill()
        raise TimeoutError(f"timed out waiting for {what}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["zmq", "queue"])
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--endpoint", help="ipc:// endpoint for the zmq consumer to bind")
    args = parser.parse_args()
    if args.kind == "zmq":
        if not args.endpoint:
            parser.error("zmq needs --endpoint")
        seconds = zmq_producer(args.endpoint, args.size, args.count)
    else:
        seconds = queue_producer(args.size, args.count)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
