"""Subscribers other than the plain one on the socket, each beside what it stands in for:
one reading the ring from shared memory beside one reading the socket, raw pyzmq and a
memcpy (shm); `tapd record`'s throughput beside the plain subscriber's (1 MiB taps); and
the `spool` policy beside `block` and `drop_newest` with a subscriber slower than the
emitter, with the spool's own write and read rates: bench/RESULTS.md sections 6 (shm),
15 (record) and 16 (spool).

    .venv/bin/python bench/durability.py shm [--size BYTES] [--count N] [--rounds R]
    .venv/bin/python bench/durability.py record [--quick] [--output PATH]
    .venv/bin/python bench/durability.py spool [--quick] [--output PATH]

Shm: One daemon (policy block) with two subscriber processes of one consumer each would split
nothing (each gets every tap), so each path has a daemon of its own: one whose
subscriber reads ring taps from shared memory (the default), one whose subscriber has
TAPD_SHM_SUBSCRIBERS=0 (the bytes over the socket). A JAX process (native backend) taps
a `size`-byte float32 array `count` times in one jitted loop (as bench/run.py, section
2, does); the time is from its first tap until `barrier_wait()` returns, i.e. until the
subscriber's handler (a no-op per tap, under the default: the leaves copied into the
subscriber's memory first) has handled every tap. Raw pyzmq: bench/throughput.py's
PUSH/PULL between two processes over ipc. One memcpy: numpy copying `size`-byte blocks
between two 256 MiB regions (neither cache-resident). Each round runs all of them once,
so that the machine's load falls on each alike; the table gives the median (min-max) of
the rounds. (JAX is imported where it is used: the processes this module starts again,
the pyzmq consumer and the shm subscriber, need none.)

Record. One daemon; this process is the JAX emitter (as in bench/run.py §2: a jitted fori_loop
tapping a 1 MiB float32 array `count` times, timed from dispatch to `barrier_wait()`).
Two consumers: one handled by `bench/processes.py sink` (a no-op handler: the end-to-end
rate of bench/RESULTS.md §2), one by a `tapd record DIR` process writing to local disk.
Each repeat times both, in alternating order. For the recorder, "on disk" is also timed:
until every tap of the repeat is in a complete chunk (npz + index renamed into place;
written through the page cache, no fsync). The recording is emptied between repeats.

Spool. The emitter's buffer (its ring) is 8 MiB, so that what a policy does shows in the step.
Per policy, one daemon (`--policy P --queue-bytes 4 MB`, spool on local disk), one sink
(`processes.py sink`) whose handler sleeps 1 ms per tap, and this process as the
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
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from processes import BENCH_DIR, Processes, read_line, wait_until
from report import (
    code_revision,
    load_average,
    machine_description,
    median,
    publish,
    size_name,
    table,
    with_spread,
)
from throughput import configure_emitter, payload_loop, time_tapd_throughput, zmq_producer

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
    import jax.numpy as jnp

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


def tapping_loop(tapped: bool) -> Callable[..., Any]:
    import jax
    from jax import lax

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        if tapped:
            tapd.tap(x, CONSUMER, step=i)
        return x + 0

    return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))


def run_policy(policy: str, repeats: int, count: int, workdir: Path) -> dict[str, object]:
    import jax
    import jax.numpy as jnp

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


# ---- same-host subscribers (shm): the child processes --------------------------------------------


def subscriber(endpoint: str) -> None:
    """A per-tap no-op handler; prints how many taps it read from rings at exit."""
    from tapd_client import Subscriber

    sub = Subscriber(endpoint, name="bench-shm")
    handled = [0]

    @sub.on("big")
    def handle(value: Any, meta: Any) -> None:
        handled[0] += 1

    signal.signal(signal.SIGTERM, lambda *_: sub.stop())
    with sub:
        sub.run()
    print(json.dumps({"handled": handled[0], "ring_taps": sub.ring_taps}), flush=True)


def emitter(size: int, count: int) -> None:
    """Tap `count` times; print the seconds until all were handled."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd

    def body(i: Any, x: Any) -> Any:
        tapd.tap(x, "big", step=i)
        return x

    # All `count` taps in one call, as bench/run.py's section 2 taps: what is timed is
    # the delivery, not JAX's dispatch of one call per tap (tens of µs each).
    loop = jax.jit(lambda x, n: lax.fori_loop(0, n, body, x)[0])
    x = jnp.arange(size // 4, dtype=jnp.float32)
    loop(x, 2).block_until_ready()
    tapd.barrier_wait(timeout=120)
    started = time.perf_counter()
    loop(x, count)
    tapd.barrier_wait(timeout=300)
    print(json.dumps({"seconds": time.perf_counter() - started}), flush=True)


# ---- same-host subscribers (shm): measuring ------------------------------------------------------


class Route:
    """One daemon and its subscriber, reading through rings or not."""

    def __init__(self, workdir: Path, shm: bool) -> None:
        workdir.mkdir(mode=0o700)
        self.processes = Processes(workdir)
        self.processes.start_daemon(flags=["--startup-grace", "0"])
        self.endpoint = self.processes.endpoint
        env = {**os.environ, "TAPD_SHM_SUBSCRIBERS": "1" if shm else "0"}
        self.sub = self.processes.spawn(
            [sys.executable, __file__, "shm", "--role", "subscriber", self.endpoint],
            env=env,
            log=workdir / "sub.log",
        )
        wait_until(
            lambda: self.processes.daemon_stats()["subscribers"] or self.sub.poll() is not None,
            "the subscriber to connect",
        )

    def run(self, size: int, count: int) -> tuple[float, float]:
        """Seconds for `count` taps, and the daemon's CPU seconds meanwhile."""
        env = {**os.environ, "TAPD_ENDPOINT": self.endpoint, "TAPD_BACKEND": "native"}
        cpu = self.processes.daemon_cpu_seconds()
        process = self.processes.spawn(
            [sys.executable, __file__, "shm", "--role", "emitter", str(size), str(count)],
            env=env,
            log=self.processes.workdir / "emitter.log",
        )
        line = read_line(process, 600)
        self.processes.stop(process)
        if not line.startswith("{"):
            log = (self.processes.workdir / "emitter.log").read_text()
            raise RuntimeError(f"emitter failed: {line!r}\n{log}")
        return json.loads(line)["seconds"], self.processes.daemon_cpu_seconds() - cpu

    def close(self) -> dict[str, Any]:
        """Stop both; what the subscriber said at exit."""
        self.sub.send_signal(signal.SIGTERM)
        out = self.sub.communicate(timeout=30)[0].decode()
        self.processes.stop_all()
        return dict(json.loads(out.splitlines()[-1])) if out.strip() else {}


def memcpy_seconds(size: int, count: int) -> float:
    """`count` copies of `size` bytes, source and destination each walking through its
    own 256 MiB (neither stays in a cache): one core's memcpy bandwidth."""
    region = 256 * 2**20
    source = np.ones(region // 8, np.float64).view(np.uint8)
    destination = np.ones(region // 8, np.float64).view(np.uint8)
    blocks = region // size
    started = time.perf_counter()
    for i in range(count):
        offset = (i % blocks) * size
        np.copyto(destination[offset : offset + size], source[offset : offset + size])
    return time.perf_counter() - started


def same_host(args: argparse.Namespace) -> None:
    if args.role == "subscriber":
        return subscriber(args.args[0])
    if args.role == "emitter":
        return emitter(int(args.args[0]), int(args.args[1]))
    size, count = args.size, args.count
    workdir = Path(tempfile.mkdtemp(prefix="tapd-shm-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    results: dict[str, list[float]] = {"shm": [], "socket": [], "zmq": [], "memcpy": []}
    cpu: dict[str, list[float]] = {"shm": [], "socket": []}
    paths = {"shm": Route(workdir / "shm", True), "socket": Route(workdir / "socket", False)}
    try:
        for round_ in range(args.rounds):
            for name, path in paths.items():
                seconds, daemon_cpu = path.run(size, count)
                results[name].append(seconds)
                cpu[name].append(daemon_cpu)
            results["zmq"].append(zmq_producer(f"ipc://{workdir}/z{round_}.sock", size, count))
            results["memcpy"].append(memcpy_seconds(size, count))
            print(
                f"round {round_ + 1}: "
                + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items())
            )
        seen = {name: path.close() for name, path in paths.items()}
    finally:
        for path in paths.values():
            path.processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    assert seen["shm"].get("ring_taps", 0) > 0, f"the shm subscriber read no ring taps: {seen}"
    assert seen["socket"].get("ring_taps", 1) == 0, f"the socket subscriber read rings: {seen}"

    def gbps(name: str) -> list[float]:
        return [size * count / s / 1e9 for s in results[name]]

    medians = {name: float(np.median(gbps(name))) for name in results}
    rows = []
    for name, what in [
        ("shm", "tapd, subscriber reads the ring (shared memory)"),
        ("socket", "tapd, bytes over the socket (TAPD_SHM_SUBSCRIBERS=0)"),
        ("zmq", "raw pyzmq PUSH/PULL, ipc"),
        ("memcpy", "one memcpy (numpy copyto), one core"),
    ]:
        per_tap = (
            with_spread([c / count * 1e6 for c in cpu[name]], digits=0) if name in cpu else "-"
        )
        rows.append(
            [
                what,
                with_spread(gbps(name)),
                f"{medians[name] / medians['zmq']:.2f}",
                f"{medians[name] / medians['memcpy']:.2f}",
                per_tap,
            ]
        )
    header = ["path", "GB/s", "÷ raw pyzmq", "÷ memcpy", "daemon CPU µs/tap"]
    machine = "\n".join(f"- {what}: {value}" for what, value in machine_description())
    text = f"""# Same-host subscribers: shared memory vs socket vs raw pyzmq

`python bench/durability.py shm --size {size} --count {count} --rounds {args.rounds}`:
{size_name(size)} taps, {count} per run, {args.rounds} rounds; median (min-max) of the rounds.
Each round runs every row once, one after the other. tapd rows: from a JAX process's
first tap (native backend, one jitted loop, policy block) until `barrier_wait()` returned,
every tap handled by a per-tap no-op handler in another process (shared memory: the
leaves copied into the subscriber's memory before the call, the default). Subscribers:
{seen}.

{table(header, rows)}

Code: {code_revision(BENCH_DIR.parent)}. The machine is shared (other engineers' builds and tests
ran meanwhile): the ratios of one run are what to compare, not the absolute figures.

{machine}
"""
    publish(text, args.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measure", choices=["shm", "record", "spool"])
    parser.add_argument("--quick", action="store_true",
                        help="record: 2 repeats of 100 taps; spool: 1 repeat of 500")  # fmt: skip
    parser.add_argument("--output", type=Path, help="also write the report here")
    parser.add_argument("--size", type=int, default=2**20, help="shm: bytes a tap")
    parser.add_argument("--count", type=int, default=1000, help="shm: taps a run")
    parser.add_argument("--rounds", type=int, default=3, help="shm: rounds of every row")
    parser.add_argument("--role", choices=["subscriber", "emitter"], help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args()  # (shm's roles: `shm --role R ARGS...`)
    {"shm": same_host, "record": record, "spool": spool}[args.measure](args)


if __name__ == "__main__":
    main()
