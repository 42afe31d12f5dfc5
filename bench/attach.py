"""Attach latency: how long after a subscriber's hello the first tap of a running job
reaches it, when the job's tap site was dormant (issue 21; target: 50 ms, or one step
where a step takes longer).

A JAX job (native backend) runs step after step, each tapping "acts" (SIZE bytes), one
every INTERVAL ms, with no subscriber: the site is dormant, its taps skipped. Then a
subscriber in this process connects (its hello goes out in `connect()`) and runs until
its first tap; the time from just before `connect()` to that tap's handler is the
attach latency. It leaves (bye), the daemon makes the site dormant again, and the next
repeat starts. Median (min-max) over REPEATS per row.

    .venv/bin/python bench/attach.py [--repeats 10] [--output PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from processes import BENCH_DIR, Processes, read_line, wait_until
from report import (
    code_revision,
    load_average,
    machine_description,
    publish,
    size_name,
    table,
    with_spread,
)

from tapd.protocol.ring_format import EVERY_DORMANT
from tapd_client import Subscriber, TapMeta

# The job: steps forever, one every argv[2] ms, each tapping argv[1] bytes as "acts".
JOB = """
import sys, time
import jax, jax.numpy as jnp
import tapd
size, interval = int(sys.argv[1]), float(sys.argv[2]) / 1000
step = jax.jit(lambda i, x: tapd.tap(x + i, "acts", step=i).sum())
x = jnp.zeros(size // 4, jnp.float32)
i = 0
while True:
    step(jnp.int32(i), x).block_until_ready()
    i += 1
    if i == 3:
        print("running", tapd.backend(), flush=True)
    if interval:
        time.sleep(interval)
"""
CASES = [(64, 1.0), (64, 10.0), (2**20, 1.0), (2**20, 10.0)]  # (tap bytes, step interval ms)


def acts_every(processes: Processes) -> int | None:
    for sites in processes.daemon_stats()["wants"].values():
        for _, consumer, every in sites:
            if consumer == "acts":
                return int(every)
    return None


def attach_once(endpoint: str) -> tuple[float, float]:
    """Seconds from a new subscriber's hello (as it went out), and from the start of its
    `connect()`, to its first tap of "acts"."""
    first: list[float] = []

    def handle(value: Any, meta: TapMeta) -> None:
        if not first:
            first.append(time.monotonic())

    subscriber = Subscriber(endpoint, heartbeat=0.2)
    subscriber.add_handler("acts", handle)
    start = time.monotonic()
    subscriber.connect(timeout=10)  # connects, sends the hello, waits for the welcome
    hello = subscriber._links[0].hello_sent  # (when the hello went out)
    subscriber.run(until=lambda: bool(first))
    subscriber.close()
    return first[0] - hello, first[0] - start


def measure(processes: Processes, size: int, interval: float, repeats: int) -> list[str]:
    env = {**os.environ, "TAPD_ENDPOINT": processes.endpoint, "TAPD_BACKEND": "native"}
    job = processes.spawn(
        [sys.executable, "-c", JOB, str(size), str(interval)],
        env=env,
        log=processes.workdir / f"job-{size}-{interval}.log",
    )
    line = read_line(job, 120)
    if line != "running native":
        raise RuntimeError(f"the job said {line!r}; see {processes.workdir}")
    latencies, from_connect = [], []
    for _ in range(repeats):
        wait_until(lambda: acts_every(processes) == EVERY_DORMANT, "acts to be dormant")
        before = skipped(processes)
        wait_until(lambda b=before: skipped(processes) > b, "a skipped tap (it is dormant)")
        latency, whole = attach_once(processes.endpoint)
        latencies.append(latency)
        from_connect.append(whole)
    processes.stop(job)
    target = max(50.0, interval)
    worst = max(latencies) * 1e3
    return [
        size_name(size),
        f"{interval:g}",
        with_spread(latencies, 1e3),
        with_spread(from_connect, 1e3),
        f"{target:g}",
        "yes" if worst <= target else f"no (max {worst:.1f})",
    ]


def skipped(processes: Processes) -> int:
    rings = processes.daemon_stats()["rings"]
    return sum(int(r["skipped_by_consumer"].get("acts", 0)) for r in rings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, help="also write the report here")
    args = parser.parse_args()
    machine = machine_description()
    machine.append(("tapd revision", code_revision(BENCH_DIR.parent)))
    started = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tapd-attach-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon(flags=["--startup-grace", "0"])
            for size, interval in CASES:
                rows.append(measure(processes, size, interval, args.repeats))
                print(" | ".join(rows[-1]), flush=True)
        finally:
            processes.stop_all()
    machine.append(("load average at end", load_average()))
    machine.append(("wall time", f"{time.monotonic() - started:.0f} s"))
    text = "\n\n".join(
        [
            "# Attach latency: a subscriber joining a running job whose tap site is dormant",
            table(["", ""], machine),
            "Reproduce: `.venv/bin/python bench/attach.py`",
            f"{args.repeats} attaches per row. Attach: from the moment the subscriber's "
            "hello went out to its handler's first call for the site (and, beside it, from "
            "the start of `connect()`, which first makes the connection); before each, the "
            "site is dormant (the daemon wrote EVERY_DORMANT and the ring counts skipped "
            "taps). Median (min-max), ms. Target: 50 ms from the hello, or one step "
            "interval where that is longer. Taken on a shared 2-core machine under load "
            "from other work. Method: bench/attach.py's docstring.",
            table(
                [
                    "tap",
                    "step interval ms",
                    "attach ms (from hello)",
                    "from connect() ms",
                    "target ms",
                    "within target",
                ],
                rows,
            ),
        ]
    )
    publish(text + "\n", args.output)


if __name__ == "__main__":
    main()
