"""The demo's subscriber: prints the loss and gradient norm as they arrive."""

from __future__ import annotations

import signal
from typing import Any

from tapd_client import Subscriber, TapMeta


def main() -> None:
    subscriber = Subscriber(name="demo-watch")
    latest: dict[int, dict[str, float]] = {}

    @subscriber.on("loss")
    @subscriber.on("grad_norm")
    def show(arg: Any, meta: TapMeta) -> None:
        assert meta.step is not None
        row = latest.setdefault(meta.step, {})
        row[meta.consumer] = float(arg)
        if len(row) == 2:
            print(
                f"  step {meta.step:3d}  loss {row['loss']:9.5f}  "
                f"grad_norm {row['grad_norm']:9.5f}   (from {meta.emitter})",
                flush=True,
            )
            del latest[meta.step]

    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()


if __name__ == "__main__":
    main()
