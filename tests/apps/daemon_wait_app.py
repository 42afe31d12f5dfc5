"""A JAX emitter that waits on its daemon at the test's word, for tests/test_daemon_waits.py.

`python daemon_wait_app.py COUNT` taps "loss" once and passes a barrier (the daemon and
its subscriber have met this process), prints {"ready": ...}, and waits for a line on
stdin. Then it taps COUNT more times, prints {"tapped": COUNT}, and calls
`tapd.barrier_wait()` with no timeout; last it prints one JSON line saying how that
ended (`"passed"` or the exception's type and message) and how long it took. tapd's
log (warnings and up) goes to stderr, one record a line, as a CLI would configure it.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import jax

import tapd


def main(count: int) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    step = jax.jit(lambda i: tapd.tap(i * 1.0, "loss", step=i))
    step(0)
    tapd.barrier_wait(timeout=60)
    print(json.dumps({"ready": tapd.backend()}), flush=True)
    sys.stdin.readline()
    for i in range(1, count + 1):
        step(i)
    jax.effects_barrier()  # type: ignore[no-untyped-call]
    print(json.dumps({"tapped": count}), flush=True)
    started = time.monotonic()
    ended: dict[str, Any]
    try:
        tapd.barrier_wait(timeout=None)
        ended = {"barrier": "passed"}
    except Exception as exc:
        ended = {"barrier": type(exc).__name__, "message": str(exc)}
    ended["waited"] = time.monotonic() - started
    print(json.dumps(ended), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
