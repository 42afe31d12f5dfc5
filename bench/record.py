"""`tapd record`'s throughput beside the plain subscriber's, 1 MiB taps, in one run.

    .venv/bin/python bench/record.py [--quick] [--output PATH]

One daemon; this process is the JAX emitter (as in bench/run.py §2: a jitted fori_loop
tapping a 1 MiB float32 array `count` times, timed from dispatch to `barrier_wait()`).
Two consumers: one handled by bench/subscriber_sink.py (a no-op handler: the end-to-end
rate of bench/RESULTS.md §2), one by a `tapd record DIR` process writing to local disk.
Each repeat times both, in alternating order. For the recorder, "on disk" is also timed:
until every tap of the repeat is in a complete chunk (npz + index renamed into place;
written through the page cache, no fsync). The recording is emptied between repeats.
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

import jax.numpy as jnp
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

from tapd.clients import control

COMMAND = ".venv/bin/python bench/record.py"
SIZE = 2**20
PLAIN, RECORDED = "bench.record.plain", "bench.record.rec"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats of 100 taps")
    parser.add_argument("--output", type=Path, help="also write the report here")
    args = parser.parse_args()
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
        x = jnp.arange(SIZE // 4, dtype=jnp.float32)
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
        return with_spread([count * SIZE / s / 1e6 for s in seconds], digits=0)

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
        f"Reproduce: `{COMMAND}{' --quick' if args.quick else ''}`",
        "",
        f"1 MiB float32 taps, {count} per repeat, {repeats} repeats; MB/s (10^6 bytes): "
        "median (min-max). Method: the docstring of bench/record.py.",
        "",
        table(["consumer", "MB/s", "time vs (a)"], rows),
        "",
        f"**record rate / plain subscriber rate: x{ratio:.2f} handled, x{ratio_disk:.2f} "
        "on disk** (the issue 12 target: within x1.5).",
        "",
    ])  # fmt: skip
    publish(text, output)


if __name__ == "__main__":
    main()
