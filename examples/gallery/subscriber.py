"""The gallery's subscriber for `tap` mode: a separate process that takes the
`jax.debug.print` calls the worker sent with `tapd.tap` (harness.tap_prints), formats each
line as JAX would, takes the current delay (read from `--delay-file`, as the worker
sets it) and appends the line to `--lines`.

    python examples/gallery/subscriber.py --endpoint ipc://... --lines FILE --delay-file FILE
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tapd_client import Subscriber, TapMeta

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import TAP_PRINT_CONSUMER


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--lines", required=True, type=Path)
    parser.add_argument("--delay-file", required=True, type=Path)
    args = parser.parse_args()
    subscriber = Subscriber([args.endpoint], heartbeat=0.2)
    out = open(args.lines, "a", buffering=1)  # noqa: SIM115 (open while the process is)

    def delay() -> float:
        try:
            return float(args.delay_file.read_text() or 0)
        except (OSError, ValueError):
            return 0.0

    @subscriber.on(TAP_PRINT_CONSUMER)
    def print_line(value: Any, meta: TapMeta) -> None:
        args_ = [np.asarray(v) for v in value["args"]]
        kwargs = {k: np.asarray(v) for k, v in value["kwargs"].items()}
        seconds = delay()
        if seconds:
            time.sleep(seconds)
        out.write(meta.meta["fmt"].format(*args_, **kwargs) + "\n")

    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    print("subscribed", flush=True)
    subscriber.run()
    out.close()


if __name__ == "__main__":
    main()
