"""The `spool` policy beside `block` and `drop_newest`, with a subscriber slower than the
emitter, in one run; and the spool's own write and read rates.

    .venv/bin/python bench/spool.py [--quick] [--output PATH]

The emitter's buffer (its ring) is 8 MiB, so that what a policy does shows in the step.
Per policy, one daemon (`--policy P --queue-bytes 4 MB`, spool on local disk), one sink
(bench/subscriber_sink.py) whose handler sleeps 1 ms per tap, and this process as the
JAX emitter: a jitted fori_loop tapping a 64 KiB float32 array `count` times. Timed:
- the loop: from dispatch until the computation is done (`block_until_ready` and
  `jax.effects_barrier()`: every tap has run), as a training step sees it. Divided by
  `count`, the step time; with the untapped loop's beside it;
- the drain: from dispatch until `barrier_wait()` returns (every tap handled, or
  dropped and counted).
Then the daemon's counters: taps spooled, dropped. And, in this process, `Spool.append`
and `Spool.take` on 64 KiB and 1 MiB records (through the page cache, no fsync).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from processes import BENCH_DIR, Processes
from report import (
    code_revision,
    load_average,
    machine_description,
    median,
    publish,
    table,
    with_spread,
)

import tapd
from tapd.daemon.spool import Spool
from tapd.protocol import decode, encode

COMMAND = ".venv/bin/python bench/spool.py"
SIZE = 64 * 1024
CONSUMER = "bench.spool"
POLICIES = ("block", "spool", "drop_newest")
QUEUE_BYTES = 4 * 10**6
SLEEP_MS = 1.0
BUFFER_BYTES = 8 * 2**20  # the emitter's ring: small, so that block shows in the step


def tapping_loop(tapped: bool) -> jax.stages.Wrapped:
    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        if tapped:
            tapd.tap(x, CONSUMER, step=i)
        return x + 0

    return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))


def run_policy(policy: str, repeats: int, count: int, workdir: Path) -> dict[str, object]:
    procs = Processes(workdir)
    spool_dir = workdir / "spool"
    try:
        procs.start_daemon(flags=["--policy", policy, "--queue-bytes", str(QUEUE_BYTES),
                                  "--spool-dir", str(spool_dir)])  # fmt: skip
        procs.start_sink(CONSUMER, sleep_ms=SLEEP_MS)
        x = jnp.zeros(SIZE // 4, jnp.float32)
        tapped, plain = tapping_loop(True), tapping_loop(False)
        tapped(x, 2).block_until_ready()  # compile, warm up
        plain(x, 2).block_until_ready()
        tapd.barrier_wait(timeout=120)
        loop_s, drain_s, plain_s = [], [], []
        for _ in range(repeats):
            began = time.perf_counter()
            plain(x, count).block_until_ready()
            plain_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            tapped(x, count).block_until_ready()
            jax.effects_barrier()  # type: ignore[no-untyped-call]
            loop_s.append(time.perf_counter() - began)
            tapd.barrier_wait(timeout=600)
            drain_s.append(time.perf_counter() - began)
        counters = procs.daemon_stats()["counters"]
        return {"loop": loop_s, "drain": drain_s, "plain": plain_s,
                "spooled": counters.get("taps_spooled", 0),
                "dropped": counters.get("deliveries_dropped", 0)}  # fmt: skip
    finally:
        procs.stop_all()
        shutil.rmtree(spool_dir, ignore_errors=True)


def spool_rates(directory: Path, size: int, records: int) -> tuple[float, float]:
    """MB/s appending then taking back `records` taps of `size` bytes."""
    tap = decode(encode("tap", {"consumer": "x", "seq": 0, "step": None, "device": None,
                                "process": 0, "host": "h", "pid": 1, "time": 0,
                                "transforms": [], "meta": {}, "tree": ["*"]},
                        [np.zeros(size, np.uint8)]))  # fmt: skip
    spool = Spool(directory, f"bench-{size}", limit=1 << 40)
    began = time.perf_counter()
    for _ in range(records):
        spool.append([tap], "h:1", size)
    wrote = time.perf_counter() - began
    began = time.perf_counter()
    while (taken := spool.take()) is not None:
        spool.acknowledge(taken.entry)
    read = time.perf_counter() - began
    spool.remove()
    return records * size / wrote / 1e6, records * size / read / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat of 500 taps")
    parser.add_argument("--output", type=Path, help="also write the report here")
    args = parser.parse_args()
    repeats, count = (1, 500) if args.quick else (3, 3000)
    output = args.output
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    machine = machine_description()
    machine.append(("tapd revision", code_revision(BENCH_DIR.parent)))
    started = time.monotonic()
    results = {}
    workdir = Path(tempfile.mkdtemp(prefix="tapds-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    # Every policy's daemon on the same endpoint: this emitter reconnects to each.
    tapd.configure(endpoint=Processes(workdir).endpoint, exit_timeout=5.0,
                   buffer_bytes=BUFFER_BYTES)  # fmt: skip
    try:
        for policy in POLICIES:
            print(f"  policy {policy} ...", flush=True)
            results[policy] = run_policy(policy, repeats, count, workdir)
        rates = {size: spool_rates(workdir / "raw", size, max(50, (256 << 20) // size // 4))
                 for size in (SIZE, 1 << 20)}  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def ms(seconds: list[float]) -> str:
        return with_spread([s / count * 1000 for s in seconds], digits=3)

    rows = []
    block = results["block"]["loop"]
    assert isinstance(block, list)
    for policy, r in results.items():
        loop, drain, plain = r["loop"], r["drain"], r["plain"]
        assert isinstance(loop, list) and isinstance(drain, list) and isinstance(plain, list)
        rows.append([policy, ms(plain), ms(loop), f"x{median(loop) / median(block):.2f}",
                     with_spread([count / s for s in loop], digits=0),
                     with_spread(drain, digits=2), str(r["spooled"]),
                     str(r["dropped"])])  # fmt: skip
    rate_rows = [[f"{size // 1024} KiB", f"{write:.0f}", f"{read:.0f}"]
                 for size, (write, read) in rates.items()]  # fmt: skip
    machine.append(("load average at end", load_average()))
    machine.append(("wall time", f"{time.monotonic() - started:.0f} s"))
    text = "\n".join([
        "# The spool policy: step time and throughput with a slow subscriber",
        "",
        table(["", ""], [[k, v] for k, v in machine]),
        "",
        f"Reproduce: `{COMMAND}{' --quick' if args.quick else ''}`",
        "",
        f"64 KiB float32 taps, {count} per repeat, {repeats} repeats; a subscriber that "
        f"sleeps {SLEEP_MS:g} ms per tap; `--queue-bytes {QUEUE_BYTES}`; the emitter's "
        f"buffer {BUFFER_BYTES >> 20} MiB. Median (min-max). "
        "Step: the loop's time per tap from dispatch until every tap ran in the emitter; "
        "the untapped loop beside it. Drain: until `barrier_wait()` returned. Spooled and "
        "dropped: the daemon's counters over all repeats. Method: bench/spool.py's "
        "docstring.",
        "",
        table(["policy", "untapped step ms", "tapped step ms", "tapped step vs block",
               "taps/s into the daemon", "drain s", "spooled", "dropped"], rows),
        "",
        "The spool alone (`tapd.daemon.spool.Spool`, one process, local disk through the "
        "page cache), MB/s:",
        "",
        table(["tap size", "append", "take back"], rate_rows),
        "",
    ])  # fmt: skip
    publish(text, output)


if __name__ == "__main__":
    main()
