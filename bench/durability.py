"""Taps kept on disk, each beside what it stands in for: `tapd record`'s throughput beside
the plain subscriber's (1 MiB taps), and the `spool` policy beside `block` and
`drop_newest` with a subscriber slower than the emitter, with the spool's own write and
read rates: bench/RESULTS.md sections 15 (record) and 16 (spool).

    .venv/bin/python bench/durability.py record [--quick] [--output PATH]
    .venv/bin/python bench/durability.py spool [--quick] [--output PATH]

Record. One daemon; this process is the JAX emitter (as in bench/run.py §2: a jitted fori_loop
tapping a 1 MiB float32 array `count` times, timed from dispatch to `barrier_wait()`).
Two consumers: one handled by bench/subscriber_sink.py (a no-op handler: the end-to-end
rate of bench/RESULTS.md §2), one by a `tapd record DIR` process writing to local disk.
Each repeat times both, in alternating order. For the recorder, "on disk" is also timed:
until every tap of the repeat is in a complete chunk (npz + index renamed into place;
written through the page cache, no fsync). The recording is emptied between repeats.

Spool. The emitter's buffer (its ring) is 8 MiB, so that what a policy does shows in the step.
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
from processes import BENCH_DIR, Processes, wait_until
from report import (
    code_revision,
    load_average,
    machine_description,
    median,
    publish,
    table,
    with_spread,
)
from run import configure_emitter, payload_loop, time_tapd_throughput

import tapd
from tapd.clients import control
from tapd.daemon.spool import Spool
from tapd.protocol import decode, encode

COMMAND = ".venv/bin/python bench/durability.py"
RECORD_SIZE = 2**20
PLAIN, RECORDED = "bench.record.plain", "bench.record.rec"
SPOOL_SIZE = 64 * 1024
CONSUMER = "bench.spool"
POLICIES = ("block", "spool", "drop_newest")
QUEUE_BYTES = 4 * 10**6
SLEEP_MS = 1.0
BUFFER_BYTES = 8 * 2**20  # the emitter's ring: small, so that block shows in the step


def recorded_taps(directory: Path) -> int:
    """Taps in complete chunks (an index is renamed into place after its npz)."""
    total = 0
    for index in directory.glob("[0-9]*.jsonl"):
        with open(index, "rb") as lines:
            total += sum(1 for _ in lines)
    return total


def empty(directory: Path) -> None:
    for path in directory.glob("[0-9]*.*"):
        path.unlink()


def record(args: argparse.Namespace) -> None:
    repeats, count = (2, 100) if args.quick else (7, 500)
    output = args.output
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    workdir = Path(tempfile.mkdtemp(prefix="tapdr-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    recording = workdir / "recording"
    procs = Processes(workdir)
    machine = machine_description()
    machine.append(("tapd revision", code_revision(BENCH_DIR.parent)))
    started = time.monotonic()
    plain_s: list[float] = []
    record_s: list[float] = []
    disk_s: list[float] = []
    try:
        procs.start_daemon()
        configure_emitter(procs.endpoint, None)
        sink = procs.start_sink(PLAIN)
        recorder = procs.spawn(
            [sys.executable, "-m", "tapd", "--log-level", "warning", "record", str(recording),
             RECORDED, "--endpoint", procs.endpoint],
            env=dict(os.environ), log=workdir / "record.log",
        )  # fmt: skip
        wait_until(lambda: any(s["consumers"] == [RECORDED]
                               for s in control.stats(procs.endpoint)["subscribers"]),
                   "tapd record")  # fmt: skip
        x = jnp.arange(RECORD_SIZE // 4, dtype=jnp.float32)
        loops = {name: payload_loop(name) for name in (PLAIN, RECORDED)}
        for loop in loops.values():  # compile and warm up outside the timing
            time_tapd_throughput(loop, x, 2)
        wait_until(lambda: recorded_taps(recording) == 2, "the warm-up taps on disk")
        for repeat in range(repeats):
            empty(recording)
            order = (PLAIN, RECORDED) if repeat % 2 == 0 else (RECORDED, PLAIN)
            for name in order:
                began = time.perf_counter()
                handled = time_tapd_throughput(loops[name], x, count)
                if name == PLAIN:
                    plain_s.append(handled)
                    continue
                record_s.append(handled)
                wait_until(lambda: recorded_taps(recording) == count, "the taps on disk", 120)
                disk_s.append(time.perf_counter() - began)
            print(f"  repeat {repeat + 1}/{repeats} done", flush=True)
        procs.stop(recorder)
        procs.stop(sink.process)
        handled_by_sink = sink.results()["processed"]
        if handled_by_sink != repeats * count + 2:
            print(f"warning: the sink handled {handled_by_sink} taps, not {repeats * count + 2}")
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)

    def rate(seconds: list[float]) -> str:
        return with_spread([count * RECORD_SIZE / s / 1e6 for s in seconds], digits=0)

    ratio = median(plain_s) / median(record_s)
    ratio_disk = median(plain_s) / median(disk_s)
    rows = [
        ["(a) plain subscriber, no-op handler (§2's end-to-end rate)", rate(plain_s), "x1.00"],
        ["(b) tapd record, handled (barrier_wait)", rate(record_s), f"x{1 / ratio:.2f}"],
        ["(b) tapd record, on disk (every chunk renamed into place)", rate(disk_s),
         f"x{1 / ratio_disk:.2f}"],
    ]  # fmt: skip
    machine.append(("load average at end", load_average()))
    machine.append(("wall time", f"{time.monotonic() - started:.0f} s"))
    text = "\n".join([
        "# tapd record: throughput beside the plain subscriber",
        "",
        table(["", ""], [[k, v] for k, v in machine]),
        "",
        f"Reproduce: `{COMMAND} record{' --quick' if args.quick else ''}`",
        "",
        f"1 MiB float32 taps, {count} per repeat, {repeats} repeats; MB/s (10^6 bytes): "
        "median (min-max). Method: the docstring of bench/durability.py (record).",
        "",
        table(["consumer", "MB/s", "time vs (a)"], rows),
        "",
        f"**record rate / plain subscriber rate: x{ratio:.2f} handled, x{ratio_disk:.2f} "
        "on disk** (the issue 12 target: within x1.5).",
        "",
    ])  # fmt: skip
    publish(text, output)


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
        x = jnp.zeros(SPOOL_SIZE // 4, jnp.float32)
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


def spool(args: argparse.Namespace) -> None:
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
                 for size in (SPOOL_SIZE, 1 << 20)}  # fmt: skip
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
        f"Reproduce: `{COMMAND} spool{' --quick' if args.quick else ''}`",
        "",
        f"64 KiB float32 taps, {count} per repeat, {repeats} repeats; a subscriber that "
        f"sleeps {SLEEP_MS:g} ms per tap; `--queue-bytes {QUEUE_BYTES}`; the emitter's "
        f"buffer {BUFFER_BYTES >> 20} MiB. Median (min-max). "
        "Step: the loop's time per tap from dispatch until every tap ran in the emitter; "
        "the untapped loop beside it. Drain: until `barrier_wait()` returned. Spooled and "
        "dropped: the daemon's counters over all repeats. Method: bench/durability.py's "
        "docstring (spool).",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measure", choices=["record", "spool"])
    parser.add_argument("--quick", action="store_true",
                        help="record: 2 repeats of 100 taps; spool: 1 repeat of 500")  # fmt: skip
    parser.add_argument("--output", type=Path, help="also write the report here")
    args = parser.parse_args()
    if args.measure == "record":
        record(args)
    else:
        spool(args)


if __name__ == "__main__":
    main()
