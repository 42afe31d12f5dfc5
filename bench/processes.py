"""The benchmark's child processes: one tapd daemon, subscriber sinks, other helpers
(`spawn`), and their cleanup; and the code of the children that are bench/'s own.

Readiness is always observed, never slept for: the daemon's `tapd ready:` line on its
stdout, and the daemon's own list of subscribers (`control.stats`) for each sink (every
daemon's list, for a sink that follows several). Every process started here is stopped
by `Processes.stop_all()` with SIGTERM and a bounded wait (SIGKILL after it).

Run as a script, this module is one of those children:

    python bench/processes.py sink --endpoint ipc://... [--endpoint ...] --consumer NAME
        --result PATH [--sleep-ms MS] [--latency] [--tally] [--window N] [--batch]
    python bench/processes.py generate --endpoint ipc://...   # fan-in's ring writer
    python bench/processes.py count --endpoint ipc://... --result PATH   # fan-in's counter

`sink` is a subscriber with one consumer and a minimal handler (`sink`, below), the one
every section measures delivery with; `generate` and `count` are bench/fanin.py's load
generator and its upstream's subscriber (`generate` and `count`, below).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tapd.clients import control

BENCH_DIR = Path(__file__).resolve().parent
READY_PREFIX = "tapd ready:"
STOP_TIMEOUT = 15.0
RUN_TIMEOUT = 300.0  # a generator's barrier after its writing
# What the daemons said became of an emitter's taps (tapd.emitter.sender.SenderStats).
DAEMON_FIGURES = ("delivered", "daemon_dropped", "unrouted", "unknown")


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `condition` every 20 ms until it is truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


class Sink:
    """A running `processes.py sink` process and the file it writes its results to."""

    def __init__(self, process: subprocess.Popen[bytes], consumer: str, result: Path) -> None:
        self.process = process
        self.consumer = consumer
        self.result = result

    def results(self) -> dict[str, Any]:
        """What the sink wrote at exit (call after `Processes.stop`)."""
        return dict(json.loads(self.result.read_text()))


class Processes:
    """Starts the daemon and sinks in `workdir` and remembers them for cleanup."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.endpoint = f"ipc://{workdir / 'd.sock'}"
        self.daemon_log = workdir / "daemon.log"
        self._started: list[subprocess.Popen[bytes]] = []
        self._daemon: subprocess.Popen[bytes] | None = None

    # ---- daemon ---------------------------------------------------------------------

    def start_daemon(self, timeout: float = 30.0, flags: Sequence[str] = ()) -> list[str]:
        """Start `python -m tapd start [flags]` and return its endpoints once it says it
        is ready."""
        argv = [
            sys.executable, "-m", "tapd", "--log-level", "warning", "start",
            "--endpoint", self.endpoint, "--pidfile", str(self.workdir / "d.pid"), *flags,
        ]  # fmt: skip
        with open(self.daemon_log, "wb") as log:
            process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
        self._started.append(process)
        self._daemon = process
        line = read_line(process, timeout)
        if not line.startswith(READY_PREFIX):
            raise RuntimeError(f"daemon did not become ready: {line!r}\n{self.daemon_log_text()}")
        return line.removeprefix(READY_PREFIX).split()

    def daemon_stats(self) -> dict[str, Any]:
        return control.stats(self.endpoint, timeout=5.0)

    def daemon_cpu_seconds(self) -> float:
        """User + system CPU seconds the daemon process has used so far."""
        assert self._daemon is not None
        return cpu_seconds(self._daemon.pid)

    def daemon_log_text(self) -> str:
        return self.daemon_log.read_text(errors="replace") if self.daemon_log.exists() else ""

    # ---- subscribers ----------------------------------------------------------------

    def start_sink(
        self,
        consumer: str,
        *,
        sleep_ms: float = 0.0,
        latency: bool = False,
        tally: bool = False,
        window: int | None = None,
        endpoints: Sequence[str] = (),
        batch: bool = False,
    ) -> Sink:
        """Start a subscriber for `consumer` following this daemon, or every daemon in
        `endpoints`; return once each of them lists it."""
        follow = list(endpoints) or [self.endpoint]
        result = self.workdir / f"{consumer.replace('*', 'all')}.json"
        argv = [
            sys.executable, str(BENCH_DIR / "processes.py"), "sink",
            *(arg for endpoint in follow for arg in ("--endpoint", endpoint)),
            "--consumer", consumer, "--result", str(result),
            "--sleep-ms", str(sleep_ms), *(["--window", str(window)] if window else []),
            *(["--latency"] if latency else []), *(["--tally"] if tally else []),
            *(["--batch"] if batch else []),
        ]  # fmt: skip
        process = subprocess.Popen(argv)
        self._started.append(process)
        wait_until(
            lambda: all(_subscribed(e, consumer) for e in follow) or process.poll() is not None,
            f"the subscriber for {consumer!r} to connect to {', '.join(follow)}",
        )
        if process.poll() is not None:
            raise RuntimeError(f"the subscriber for {consumer!r} exited with {process.returncode}")
        return Sink(process, consumer, result)

    # ---- other processes ------------------------------------------------------------

    def spawn(self, argv: list[str], *, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start `argv` with pipes for stdin and (unbuffered) stdout, stderr to `log`;
        it is stopped with the rest."""
        with open(log, "wb") as stderr:
            process = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                bufsize=0,
            )  # fmt: skip
        self._started.append(process)
        return process

    # ---- stopping -------------------------------------------------------------------

    def stop(self, process: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM, wait at most `timeout` s, then SIGKILL. Returns the exit status."""
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"warning: {process.args!r} ignored SIGTERM for {timeout} s; killing it")
            process.kill()
            code = process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:  # unflushed input to a process that has gone
                    pass
        if process in self._started:
            self._started.remove(process)
        return code

    def stop_all(self) -> None:
        """Stop the subscribers first (newest first), then the daemon."""
        for process in reversed(list(self._started)):
            if process is not self._daemon:
                self.stop(process)
        if self._daemon is not None and self._daemon in self._started:
            self.stop(self._daemon)


def cpu_seconds(pid: int) -> float:
    """CPU seconds process `pid` has used so far: its threads' run time in nanoseconds
    (/proc/<pid>/task/*/schedstat), where the kernel has it; else user + system in clock
    ticks (/proc/<pid>/stat), 10 ms each: a tenth of a microsecond a tap over 100,000 taps,
    too coarse for a daemon's CPU a tap. (A thread that exits takes its time along: the
    daemon's threads live as long as it does.)"""
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssShmem (KiB) and the number of open file descriptors of `pid`."""
    out = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def _subscribed(endpoint: str, consumer: str) -> bool:
    """Whether the daemon at `endpoint` lists a subscriber for `consumer`."""
    subscribers = control.stats(endpoint, timeout=5.0)["subscribers"]
    return any(consumer in s["consumers"] for s in subscribers)


def read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The next line of the process's stdout, or '' if it exits or `timeout` passes.
    Past the first line, only for unbuffered stdout (`spawn`): a buffered reader can
    hold lines that select() no longer sees."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        return ""
    return process.stdout.readline().decode(errors="replace").strip()


def run_backend_child(script: str, backend: str, argv: Sequence[str]) -> dict[str, Any]:
    """Run `script --child ...argv` with TAPD_BACKEND=`backend` (each backend in a process
    of its own: the backend is chosen once per process); return the JSON object it prints
    last on stdout."""
    command = [sys.executable, script, "--child", *argv]
    env = {**os.environ, "TAPD_BACKEND": backend, "TAPD_AUTOSTART": "0"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"{backend} run failed ({result.returncode}):\n{result.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def run_child(command: list[str], env: dict[str, str], what: str) -> dict[str, Any]:
    """A bench's child process (one process at a time holds a TPU): its stderr's tail
    passed on, its result the last JSON line it printed; SystemExit where it failed."""
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    sys.stderr.write(done.stderr[-4000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed: {done.returncode}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


# ---- the children --------------------------------------------------------------------------


def sink(args: argparse.Namespace) -> None:
    """A subscriber of every daemon given (one per host of a multi-host job), for one
    consumer. Its handler counts taps, optionally sleeps `--sleep-ms` (a slow tap
    function), with `--latency` records `time.time() - meta.time`: seconds from the moment
    the tap ran in the emitter to the moment the handler runs here, and with `--tally` adds
    up taps and array bytes per (consumer, emitting process). On SIGTERM it stops, closes,
    and writes `{"processed": n, "latencies_s": [...], "tally": {consumer: {process: [taps,
    bytes]}}}` to `--result`. With `--batch` the handler is a batch handler (TapBatch per
    site and message) doing the same per batch, from its columns."""
    from tapd_client import Subscriber, TapBatch, TapMeta

    window = {"window": args.window} if args.window else {}
    subscriber = Subscriber(args.endpoint, name=f"sink:{args.consumer}", **window)
    latencies: list[float] = []
    tally: dict[tuple[str, int], list[int]] = {}
    sleep_s = args.sleep_ms / 1000

    def handle_batch(batch: TapBatch) -> None:
        if args.latency:
            latencies.extend((time.time() - batch.time).tolist())
        if args.tally:
            counts = tally.setdefault((batch.consumer, batch.meta.process), [0, 0])
            counts[0] += len(batch)
            counts[1] += sum(leaf.nbytes for leaf in batch.leaves)
        if sleep_s:
            time.sleep(sleep_s * len(batch))

    def handle(arg: Any, meta: TapMeta) -> None:
        if args.latency:
            latencies.append(time.time() - meta.time)
        if args.tally:
            counts = tally.setdefault((meta.consumer, meta.process), [0, 0])
            counts[0] += 1
            counts[1] += getattr(arg, "nbytes", 0)
        if sleep_s:
            time.sleep(sleep_s)

    if args.batch:
        subscriber.add_handler(args.consumer, handle_batch, batch=True)
    else:
        subscriber.add_handler(args.consumer, handle)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    by_consumer: dict[str, dict[str, list[int]]] = {}
    for (consumer, process), counts in tally.items():
        by_consumer.setdefault(consumer, {})[str(process)] = counts
    with open(args.result, "w") as out:
        result = {"processed": subscriber.processed, "latencies_s": latencies, "tally": by_consumer}
        json.dump(result, out)


def generate(args: argparse.Namespace) -> None:
    """Fan-in's load generator: write taps into this process's ring as the FFI handler
    does (tapd's Sender and NativeEmitter, records written with `tapd_ring_write`), so
    that a forwarding daemon reads, routes and forwards them as on a JAX host; no JAX.
    Commands on stdin: `run CONSUMER SIZE SECONDS RATE RING_BYTES` (RATE 0: as fast as the
    ring takes them) answers one JSON line once barrier_wait has returned; `quit` exits. A
    ring of another size is a new emitter (ring, sites file, hello), as a restarted job's
    would be."""
    import numpy as np

    from tapd.emitter.native_backend import NativeEmitter
    from tapd.emitter.sender import Sender
    from tapd.emitter.settings import from_environment
    from tapd.native import library
    from tapd.native.ring import NO_STEP
    from tapd.runtime import ring_dir_for

    directory = ring_dir_for(args.endpoint)
    assert directory is not None, "the generator needs an ipc:// endpoint"
    lib = library.load()
    assert lib is not None
    emitter: tuple[int, NativeEmitter, Sender] | None = None  # (ring bytes, ring, sender)

    def connect(ring_bytes: int) -> tuple[int, NativeEmitter, Sender]:
        """A ring of `ring_bytes` (a new one if the size changes) and its Sender."""
        if emitter is not None:
            if emitter[0] == ring_bytes:
                return emitter
            emitter[2].close(timeout=10.0)
            emitter[1].remove_files()
        settings = from_environment(
            endpoint=args.endpoint, policy="block", backend="native", buffer_bytes=ring_bytes
        )
        native = NativeEmitter(directory, ring_bytes, "block")
        return ring_bytes, native, Sender(settings, native=native)

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        consumer, size, seconds, rate = words[1], int(words[2]), float(words[3]), float(words[4])
        emitter = connect(int(words[5]))
        _, native, sender = emitter
        handle = native.ring.handle
        fields = {"tree": ["*"], "meta": {}, "transforms": []}
        site = native.register_site(consumer, fields, [["uint8", [size], size]])
        consumer_id = native.consumer_id(consumer)
        payload = np.arange(size, dtype=np.uint8).tobytes()
        before, stats_before = native.ring.counters(), sender.stats()
        start = time.monotonic()
        end = start + seconds
        written = 0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            due = 256 if rate <= 0 else min(256, int((now - start) * rate) - written)
            if due <= 0:
                time.sleep(0.005)
                continue
            for _ in range(due):
                lib.tapd_ring_write(handle, site, consumer_id, 0, NO_STEP, payload, size)
            written += due
        writes_done = time.monotonic()
        sender.barrier(timeout=RUN_TIMEOUT)
        done = time.monotonic()
        after, stats_after = native.ring.counters(), sender.stats()
        delta = {k: stats_after[k] - stats_before[k] for k in DAEMON_FIGURES}
        result = {
            "consumer": consumer,
            "size": size,
            "start": start,
            "writes_done": writes_done,
            "end": done,
            "sent": after.taps - before.taps,
            "dropped": after.dropped - before.dropped,
            "blocked_ns": after.blocked_ns - before.blocked_ns,
            **delta,
        }
        print(json.dumps(result), flush=True)
    if emitter is not None:
        emitter[2].close(timeout=10.0)
        emitter[1].remove_files()


def count(args: argparse.Namespace) -> None:
    """Fan-in's upstream subscriber: `fanin.*` with a batch handler; per (emitter,
    consumer), which seqs arrived (a bitmap), so that a tap delivered twice (at least once,
    after a forwarder was killed) is counted once and as a duplicate. At SIGTERM, write
    the counts."""
    import numpy as np

    from tapd_client import Subscriber, TapBatch

    seen: dict[tuple[str, str], np.ndarray] = {}
    duplicates: dict[tuple[str, str], int] = {}
    sizes: dict[str, int] = {}

    def handle(batch: TapBatch) -> None:
        key = (batch.meta.emitter, batch.consumer)
        seqs = batch.seq
        bits = seen.get(key)
        top = int(seqs.max()) + 1
        if bits is None or len(bits) < top:
            grown = np.zeros(max(top, 2 * (0 if bits is None else len(bits)), 1024), bool)
            if bits is not None:
                grown[: len(bits)] = bits
            bits = seen[key] = grown
        unique = np.unique(seqs)
        again = len(seqs) - len(unique) + int(bits[unique].sum())
        if again:
            duplicates[key] = duplicates.get(key, 0) + again
        bits[unique] = True
        sizes[batch.consumer] = int(batch.leaves[0][0].nbytes)

    subscriber = Subscriber(args.endpoint, name="fanin-count")
    subscriber.add_handler("fanin.*", handle, batch=True)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    out: dict[str, Any] = {}
    for (emitter, consumer), bits in seen.items():
        entry = out.setdefault(consumer, {"distinct": 0, "duplicates": 0, "emitters": []})
        entry["distinct"] += int(bits.sum())
        entry["duplicates"] += duplicates.get((emitter, consumer), 0)
        entry["emitters"].append(emitter)
        entry["size"] = sizes[consumer]
    Path(args.result).write_text(json.dumps({"processed": subscriber.processed, "consumers": out}))


def main() -> None:
    parser = argparse.ArgumentParser(description="one of the benchmark's child processes")
    sub = parser.add_subparsers(dest="child", required=True)
    sinks = sub.add_parser("sink", help="a subscriber for one consumer, counting")
    sinks.add_argument("--endpoint", action="append", required=True)
    sinks.add_argument("--consumer", required=True)
    sinks.add_argument("--result", required=True)
    sinks.add_argument("--sleep-ms", type=float, default=0.0)
    sinks.add_argument("--latency", action="store_true")
    sinks.add_argument("--tally", action="store_true")
    sinks.add_argument("--window", type=int, help="taps in flight (default: the library's)")
    sinks.add_argument("--batch", action="store_true", help="a batch handler (TapBatch)")
    for name, what in (("generate", "fan-in's load generator"), ("count", "fan-in's counter")):
        child = sub.add_parser(name, help=what)
        child.add_argument("--endpoint", required=True)
        if name == "count":
            child.add_argument("--result", required=True)
    args = parser.parse_args()
    {"sink": sink, "generate": generate, "count": count}[args.child](args)


if __name__ == "__main__":
    main()
