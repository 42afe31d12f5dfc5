"""Throughput from JAX to a subscriber's handler, beside what it stands in for: bench/run.py's
section 2 (raw pyzmq and a multiprocessing.Queue moving the same arrays), and that section
at two tapd revisions, alternating (bench/RESULTS.md section 17, into bench/THROUGHPUT.md).

    git worktree add --detach /tmp/tapd-before 2345605
    cp tapd/native/*.so /tmp/tapd-before/tapd/native/   # (the native code is the same)
    .venv/bin/python bench/throughput.py --before /tmp/tapd-before --rounds 3
    .venv/bin/python bench/throughput.py once OUT.json [--repeats N] [--quick] [--backend B]
    python bench/throughput.py zmq   --size BYTES --count N --endpoint ipc://...
    python bench/throughput.py queue --size BYTES --count N

Section 2 (bench/run.py runs it, in its own process: the JAX emitter, with its daemon and
its sinks): per repeat and payload size, tapd's taps from a jitted fori_loop until
`barrier_wait()` returns, then each baseline; then 64 B taps to a per-tap handler beside
a batch handler; the daemon's CPU (/proc/<pid>/stat) around each. `once` runs section 2
alone, prints its tables and writes every repeat's figures to OUT.json.

The baselines, `zmq` and `queue`: this process is the producer; it spawns one consumer
process. One warm-up message makes sure the consumer is connected and running; then the
producer times from its first send of `count` messages of `size` bytes (one float32 numpy
array, as tapd's payload) until the consumer reports it has received the last one.
Prints one JSON line: {"seconds": ...}. No JAX at this module's top, so that spawning the
consumer (which imports it again) is cheap: section 2's functions import JAX themselves.

Two revisions (the default): each round runs `throughput.py once` twice, once importing
tapd (daemon, subscriber and emitter alike) from the `--before` checkout through
PYTHONPATH and once from this one (or from the `--after` checkout: a commit's code alone,
without changes in progress beside it), the order flipped every round, so that both see
the same noise. Every figure is the median over the rounds of each run's own median;
`÷ pyzmq` divides by the raw pyzmq baseline measured inside the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
from processes import BENCH_DIR, Processes
from report import (
    code_revision,
    load_average,
    machine_description,
    median,
    number,
    size_name,
    table,
)

import tapd

if TYPE_CHECKING:
    import jax

SPAWN = mp.get_context("spawn")  # never fork: the parent may hold threads
WAIT_TIMEOUT = 120.0
BARRIER_TIMEOUT = 300.0


@dataclasses.dataclass(frozen=True)
class Load:
    """How much of section 2 to run."""

    repeats: int
    counts: dict[int, int]  # payload bytes -> taps (messages) per repeat
    handler_taps: int  # per-tap vs batch handler: 64 B taps per repeat


FULL = Load(repeats=7, counts={64: 10000, 64 * 1024: 3000, 1024 * 1024: 500}, handler_taps=100_000)
QUICK = Load(repeats=3, counts={64: 1000, 64 * 1024: 400, 1024 * 1024: 60}, handler_taps=10_000)


# ---- section 2 ------------------------------------------------------------------------------


@dataclasses.dataclass
class ThroughputCase:
    """One payload size: seconds per repeat for tapd and the two baselines."""

    size: int
    count: int
    tapd_s: list[float] = dataclasses.field(default_factory=list)
    cpu_s: list[float] = dataclasses.field(default_factory=list)  # the daemon's, per repeat
    zmq_s: list[float] = dataclasses.field(default_factory=list)
    queue_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def consumer(self) -> str:
        return f"bench.throughput.{self.size}"


def payload_loop(name: str) -> Callable[[jax.Array, int], jax.Array]:
    """jit(x, n -> fori_loop of n steps each tapping the payload `x` as `name`)."""
    import jax
    from jax import lax

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x, name, step=i)
        return x

    return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))


def matmul_loops(
    steps: int, side: int, depth: int, scale: float, name: str
) -> tuple[jax.Array, dict[str, Callable[[jax.Array], jax.Array]]]:
    """An input and three jitted `fori_loop`s of `steps` steps of `depth` matmul+tanh
    (side x side, weights `scale`): untapped ("none"), tapping 4 values as `name`
    ("tap"), and a no-op `jax.debug.callback` of them in the tap's place ("callback")."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    weights = jnp.full((side, side), scale, jnp.float32)

    def make(mode: str) -> Callable[[jax.Array], jax.Array]:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            for _ in range(depth):
                x = jnp.tanh(x @ weights)
            if mode == "tap":
                tapd.tap(x[0, :4], name)
            elif mode == "callback":
                jax.debug.callback(lambda v: None, x[0, :4])
            return x

        return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    x = jnp.ones((side, side), jnp.float32)
    return x, {mode: make(mode) for mode in ("none", "tap", "callback")}


def time_tapd_throughput(
    loop: Callable[[jax.Array, int], jax.Array], x: jax.Array, n: int
) -> float:
    """Seconds from dispatching n taps to barrier_wait() returning (all handled)."""
    started = time.perf_counter()
    loop(x, n)
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    return time.perf_counter() - started


def timed_with_cpu(procs: Processes, cpu_s: list[float], run: Callable[[], float]) -> float:
    """`run()`'s seconds, recording the daemon's CPU seconds over it in `cpu_s`."""
    before = procs.daemon_cpu_seconds()
    seconds = run()
    cpu_s.append(procs.daemon_cpu_seconds() - before)
    return seconds


def time_baseline(kind: str, size: int, count: int, workdir: Path) -> float:
    """Seconds for one run of a baseline (`throughput.py zmq|queue`: its own producer and
    consumer processes)."""
    argv = [
        sys.executable, str(BENCH_DIR / "throughput.py"), kind, "--size", str(size),
        "--count", str(count), "--endpoint", f"ipc://{workdir / 'raw.sock'}",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} baseline failed ({done.returncode}):\n{done.stderr}")
    return float(json.loads(done.stdout.splitlines()[-1])["seconds"])


def measure_throughput(procs: Processes, plan: Load) -> list[ThroughputCase]:
    """Measurement 2: per repeat and size, tapd, then raw pyzmq, then multiprocessing.Queue."""
    import jax.numpy as jnp

    cases = [ThroughputCase(size, count) for size, count in plan.counts.items()]
    sinks = [procs.start_sink(case.consumer) for case in cases]
    loops = {case.size: payload_loop(case.consumer) for case in cases}
    arrays = {case.size: jnp.arange(case.size // 4, dtype=jnp.float32) for case in cases}
    for case in cases:  # compile and run once outside the timing
        time_tapd_throughput(loops[case.size], arrays[case.size], 2)
    for repeat in range(plan.repeats):
        for case in cases:
            case.tapd_s.append(
                timed_with_cpu(
                    procs,
                    case.cpu_s,
                    lambda c=case: time_tapd_throughput(loops[c.size], arrays[c.size], c.count),
                )
            )
            case.zmq_s.append(time_baseline("zmq", case.size, case.count, procs.workdir))
            case.queue_s.append(time_baseline("queue", case.size, case.count, procs.workdir))
        print(f"  throughput: repeat {repeat + 1}/{plan.repeats} done", flush=True)
    for case, sink in zip(cases, sinks, strict=True):
        procs.stop(sink.process)
        expected = plan.repeats * case.count + 2  # + the warm-up taps
        handled = sink.results()["processed"]
        if handled != expected:
            print(f"warning: {case.consumer}: the sink handled {handled} taps, not {expected}")
    return cases


def cpu_columns(cpu_s: list[float], taps: int, size: int) -> list[str]:
    """The daemon's CPU per tap (µs) and per MB (ms), from the median repeat."""
    cpu = median(cpu_s)
    return [f"{cpu / taps * 1e6:.2f}", f"{cpu / (taps * size / 1e6) * 1e3:.1f}"]


def throughput_table(cases: list[ThroughputCase]) -> str:
    """Messages/s and MB/s (10^6 bytes) from the median seconds of each path, and the
    daemon's CPU per tap and per MB."""
    rows = []
    for case in cases:
        t_tapd, t_zmq, t_queue = median(case.tapd_s), median(case.zmq_s), median(case.queue_s)

        def rate(seconds: float, c: ThroughputCase = case) -> str:
            return f"{number(c.count / seconds, 0)} / {number(c.count * c.size / seconds / 1e6, 1)}"

        rows.append([
            size_name(case.size), str(case.count), rate(t_tapd), rate(t_zmq), rate(t_queue),
            f"{t_zmq / t_tapd:.3f}", f"{t_queue / t_tapd:.2f}",
            *cpu_columns(case.cpu_s, case.count, case.size),
        ])  # fmt: skip
    header = [
        "payload", "messages", "tapd msg/s / MB/s", "raw pyzmq msg/s / MB/s",
        "mp.Queue msg/s / MB/s", "tapd ÷ pyzmq", "tapd ÷ Queue", "daemon CPU µs/tap",
        "daemon CPU ms/MB",
    ]  # fmt: skip
    return table(header, rows)


HANDLERS = {"per-tap handler": False, "batch handler": True}  # label -> batch


def measure_handlers(
    procs: Processes, plan: Load
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Measurement 2b: seconds per repeat to handle `plan.handler_taps` 64 B taps, by a
    per-tap handler and by a batch handler (each its own consumer and sink process),
    alternating within each repeat; and the daemon's CPU seconds over each."""
    import jax.numpy as jnp

    consumers = {label: f"bench.handlers.{'batch' if batch else 'per_tap'}"
                 for label, batch in HANDLERS.items()}  # fmt: skip
    sinks = {label: procs.start_sink(consumers[label], batch=batch)
             for label, batch in HANDLERS.items()}  # fmt: skip
    loops = {label: payload_loop(consumers[label]) for label in HANDLERS}
    x = jnp.arange(16, dtype=jnp.float32)
    for loop in loops.values():
        time_tapd_throughput(loop, x, 2)
    seconds: dict[str, list[float]] = {label: [] for label in HANDLERS}
    cpu: dict[str, list[float]] = {label: [] for label in HANDLERS}
    for repeat in range(plan.repeats):
        order = list(HANDLERS) if repeat % 2 == 0 else list(reversed(HANDLERS))
        for label in order:
            seconds[label].append(
                timed_with_cpu(
                    procs,
                    cpu[label],
                    lambda loop=loops[label]: time_tapd_throughput(loop, x, plan.handler_taps),
                )
            )
    for label, sink in sinks.items():
        procs.stop(sink.process)
        expected = plan.repeats * plan.handler_taps + 2
        if (handled := sink.results()["processed"]) != expected:
            print(f"warning: {label}: the sink handled {handled} taps, not {expected}")
    return seconds, cpu


def handlers_table(
    measured: tuple[dict[str, list[float]], dict[str, list[float]]], taps: int
) -> str:
    seconds, cpu = measured
    reference = median(seconds["per-tap handler"])
    rows = [
        [label, str(taps), number(taps / median(s), 0), number(taps * 64 / median(s) / 1e6, 1),
         f"{reference / median(s):.2f}", *cpu_columns(cpu[label], taps, 64)]
        for label, s in seconds.items()
    ]  # fmt: skip
    header = ["handler", "taps", "taps/s", "MB/s", "÷ per-tap handler", "daemon CPU µs/tap",
              "daemon CPU ms/MB"]  # fmt: skip
    return table(header, rows)


def run_once(plan: Load, workdir: Path, backend: str | None) -> dict[str, Any]:
    """Section 2 alone (`once`, what the A/B runs at each revision): its tables, and every
    repeat's seconds and daemon CPU seconds."""
    procs = Processes(workdir)
    try:
        procs.start_daemon()
        configure_emitter(procs.endpoint, backend)
        cases = measure_throughput(procs, plan)
        handlers = measure_handlers(procs, plan)
    finally:
        procs.stop_all()
    return {
        "text": throughput_table(cases) + "\n\n" + handlers_table(handlers, plan.handler_taps),
        "sizes": {
            str(c.size): {"count": c.count, "tapd_s": c.tapd_s, "cpu_s": c.cpu_s, "zmq_s": c.zmq_s}
            for c in cases
        },
        "handlers": {
            label: {"count": plan.handler_taps, "tapd_s": s, "cpu_s": handlers[1][label]}
            for label, s in handlers[0].items()
        },
    }


def configure_emitter(endpoint: str, backend: str | None) -> None:
    """Point this process's taps at our daemon (and pick the backend if asked to)."""
    settings: dict[str, Any] = {"endpoint": endpoint, "exit_timeout": 5.0}
    if backend is not None:
        settings["backend"] = backend
    try:
        tapd.configure(**settings)
    except TypeError as exc:  # an older tapd without the setting
        raise SystemExit(f"this tapd does not accept --backend: {exc}") from exc


# ---- the baselines: raw pyzmq, multiprocessing.Queue ---------------------------------------


def payload(size: int) -> np.ndarray:
    """A float32 array of `size` bytes, like the tapped arrays."""
    return np.arange(size // 4, dtype=np.float32)


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


# ---- two revisions ------------------------------------------------------------------------

# (what a row of bench/THROUGHPUT.md is, where its figures come from in a run's JSON)
ROWS = {
    "64 B x 10,000, per-tap handler (the sizes' row)": ("sizes", "64", 64),
    "64 B x 100,000, per-tap handler": ("handlers", "per-tap handler", 64),
    "64 B x 100,000, batch handler": ("handlers", "batch handler", 64),
    "64 KiB": ("sizes", str(64 * 1024), 64 * 1024),
    "1 MiB": ("sizes", str(1024 * 1024), 1024 * 1024),
}

FINDINGS = "## Findings"

# Copies of a tap's bytes per hop, user space (docs/PROTOCOL.md; tapd/daemon/runs.py,
# tapd/protocol/batch.py, tapd/channel.py): hop, before (2345605), after.
COPIES = [
    ["emitter -> ring", "1: the FFI handler's memcpy into the ring", "1 (unchanged)"],
    ["ring -> daemon", "0: records are views of the mapped ring", "0"],
    ["daemon, 64 B taps (ring runs)",
     "2: `bytes(span)`, then pyzmq's copy (spans under 64 KiB)",
     "1: pyzmq copies the ring view (spans under 256 KiB; longer: `bytes(span)`, uncopied)"],
    ["daemon, 64 KiB taps",
     "2: `shared += array`, `bytes(shared)`; sent uncopied (a GC-thread wake each)",
     "1: two to a run, the ring view copied by pyzmq"],
    ["daemon, 1 MiB taps", "0: the ring view, uncopied, in a `tap` message", "0 (unchanged)"],
    ["daemon -> subscriber", "2 in the kernel (socket write and read)", "2 (unchanged)"],
    ["subscriber -> handler", "0: views of the received frame", "0 (unchanged)"],
]  # fmt: skip


def run_revision(checkout: Path | None, repeats: int, out: Path) -> dict[str, Any]:
    """`throughput.py once` with tapd imported from `checkout` (None: this one)."""
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = f"{checkout}:{checkout / 'client'}"
    argv = [sys.executable, str(BENCH_DIR / "throughput.py"), "once", str(out),
            "--repeats", str(repeats)]  # fmt: skip
    subprocess.run(argv, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def figures(run: dict[str, Any], row: str) -> dict[str, float]:
    """taps/s, MB/s, ÷ raw pyzmq and the daemon's CPU µs/tap of one run, for `row`."""
    part, key, size = ROWS[row]
    entry = run[part][key]
    seconds = median(entry["tapd_s"])
    rate = entry["count"] / seconds
    zmq = run["sizes"][str(size)]  # the raw pyzmq baseline at this size, same run
    zmq_rate = zmq["count"] / median(zmq["zmq_s"])
    return {
        "taps_s": rate,
        "mb_s": rate * size / 1e6,
        "vs_zmq": rate / zmq_rate,
        "cpu_us": median(entry["cpu_s"]) / entry["count"] * 1e6,
    }


def render(
    runs: dict[str, list[dict[str, Any]]],
    machine: list[tuple[str, str]],
    command: str,
    findings: str,
) -> str:
    lines = ["# Socket-path throughput: before and after (issue 20, part 1)", ""]
    lines += ["Taken on a shared 2-core machine, under contention from other work: compare",
              "the two columns of one table (same rounds, alternating), not absolute figures.",
              ""]  # fmt: skip
    lines += ["## Machine", "", table(["", ""], [list(m) for m in machine]), ""]
    lines += ["## Reproduce", "", "```", command, "```", ""]
    rounds = len(runs["after"])
    lines += ["## Figures", "",
              f"Median over {rounds} alternating rounds of each run's median (each run: "
              "bench/run.py section 2), the rounds' lowest and highest in brackets. Daemon "
              "CPU: user + system from /proc/<pid>/stat around each timed run.", ""]  # fmt: skip
    for row in ROWS:
        got = {name: [figures(r, row) for r in rs] for name, rs in runs.items()}

        def cell(name: str, key: str, digits: int, got: dict[str, Any] = got) -> str:
            values = [f[key] for f in got[name]]
            low, high = min(values), max(values)
            spread = (
                f" ({number(low, digits)} to {number(high, digits)})" if len(values) > 1 else ""
            )
            return number(median(values), digits) + (spread if len(values) > 1 else "")

        body = [
            ["taps/s", cell("before", "taps_s", 0), cell("after", "taps_s", 0)],
            ["MB/s", cell("before", "mb_s", 1), cell("after", "mb_s", 1)],
            ["÷ raw pyzmq (same run)", cell("before", "vs_zmq", 3), cell("after", "vs_zmq", 3)],
            ["daemon CPU µs/tap", cell("before", "cpu_us", 2), cell("after", "cpu_us", 2)],
        ]
        lines += [f"### {row}", "", table(["", "before", "after"], body), ""]
    lines += ["## Copies of a tap's bytes, per hop (user space)", ""]
    copies_header = ["hop", "before issue 20 (2345605)", "since issue 20 (38903aa on)"]
    lines += [table(copies_header, COPIES), ""]
    return "\n".join(lines) + findings


def two_revisions(args: argparse.Namespace) -> None:
    machine = machine_description()  # (the load average at the start, with the rest)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="tapdt-") as scratch:
        for number_ in range(args.rounds):
            order = ["before", "after"] if number_ % 2 == 0 else ["after", "before"]
            for name in order:
                checkout = args.before if name == "before" else args.after
                out = Path(scratch) / f"{name}-{number_}.json"
                runs[name].append(run_revision(checkout, args.repeats or 3, out))
                print(f"round {number_ + 1}/{args.rounds}: {name} done", flush=True)
    machine.append(("load average at end", load_average()))
    machine.append(("tapd before", code_revision(args.before)))
    machine.append(("tapd after", code_revision(args.after or BENCH_DIR.parent)))
    command = " ".join([".venv/bin/python bench/throughput.py", *sys.argv[1:]])
    # The findings (written by hand, below the figures) stay from one run to the next.
    old = args.output.read_text() if args.output.exists() else ""
    findings = old[old.index(FINDINGS) :] if FINDINGS in old else ""
    text = render(runs, machine, command, findings and "\n" + findings)
    args.output.write_text(text)
    (args.output.with_suffix(".json")).write_text(json.dumps(runs, indent=1))
    print(text)


def once(args: argparse.Namespace) -> None:
    plan = QUICK if args.quick else FULL
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    workdir = Path(tempfile.mkdtemp(prefix="tapdb-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    try:
        result = run_once(plan, workdir, args.backend)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["revision"] = code_revision(Path(tapd.__file__).parent.parent)
    args.json.write_text(json.dumps(result, indent=1))
    print(result["text"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="ab", choices=["ab", "once", "zmq", "queue"],
                        help="ab (the default): two revisions; once: section 2 alone; "
                        "zmq, queue: a baseline's producer")  # fmt: skip
    parser.add_argument("json", nargs="?", type=Path, help="once: its raw figures, written here")
    parser.add_argument("--before", type=Path, help="ab: checkout of the older tapd")
    parser.add_argument("--after", type=Path, help="ab: checkout of the newer tapd (default: this)")
    parser.add_argument("--rounds", type=int, default=3, help="ab: rounds of both")
    parser.add_argument("--repeats", type=int,
                        help="repeats inside each run (ab: 3; once: the plan's)")  # fmt: skip
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "THROUGHPUT.md", help="ab")
    parser.add_argument("--quick", action="store_true", help="once: the quick plan")
    parser.add_argument("--backend", help="once: the emitter backend (default: tapd's)")
    parser.add_argument("--size", type=int, help="zmq, queue: bytes a message")
    parser.add_argument("--count", type=int, help="zmq, queue: messages")
    parser.add_argument("--endpoint", help="zmq: the ipc:// endpoint for its consumer to bind")
    args = parser.parse_args()
    if args.mode == "ab":
        if args.before is None:
            parser.error("two revisions need --before")
        return two_revisions(args)
    if args.mode == "once":
        if args.json is None:
            parser.error("once needs the JSON file to write")
        return once(args)
    if args.size is None or args.count is None:
        parser.error(f"{args.mode} needs --size and --count")
    if args.mode == "zmq":
        if not args.endpoint:
            parser.error("zmq needs --endpoint")
        seconds = zmq_producer(args.endpoint, args.size, args.count)
    else:
        seconds = queue_producer(args.size, args.count)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
