"""Taps over several devices: multi-host throughput (bench/run.py, section 5), and per tap
against gathered (`slices`, bench/RESULTS.md section 13).

Multi-host throughput: taps/s and MB/s reaching ONE
subscriber from (a) a single JAX process with 4 CPU devices tapping into one daemon,
and (b) a 2-process `jax.distributed` job, 4 CPU devices each, every process tapping
into its own daemon (its own ipc socket and ring directory, as on two hosts), the one
subscriber following both daemons.

Both jobs (processes of this very script) are started once, up front, and wait on stdin;
each repeat asks each of them, in turn, for one timed run per payload size, so (a) and
(b) alternate and share the machine's noise while the other job sits idle.

Run as a script, this module is one process of such a job:

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python bench/multihost.py \
        --endpoint ipc://... --sizes 64,1048576 [--processes 2 --process-id I \
        --coordinator HOST:PORT] [--backend native]

With `--processes 1` it is a plain single-process job; otherwise it joins a
`jax.distributed` job (CPU collectives over gloo) and `pmap` spans every process's
devices. For each payload size it compiles a pmapped `fori_loop` whose every step taps
the device's float32 shard of that many bytes (consumer `bench.multihost.pP.SIZE`),
runs it once (2 steps, then `barrier_wait()`) to warm up, and prints `ready {json}`.

Then, for each line `run SIZE STEPS` on stdin: sync with the other processes
(`multihost_utils.sync_global_devices`, skipped when alone), read the clock
(`time.monotonic()`, one clock for every process on the machine), dispatch STEPS steps,
block until the output is ready, `tapd.barrier_wait()` (every tap of this process
handled by the subscriber), read the clock again, and print `{"start", "end", "taps"}`
as one JSON line. `quit` prints `{"stats": tapd.stats()}`, leaves the job
(`jax.distributed.shutdown()`) and exits. Only these lines go to stdout: what native
code prints there (gloo does) is sent to stderr.

Slices (issue 50), on the CPU with forced devices: what a call of a tapping loop costs,
and how many host callbacks it runs.

    python bench/multihost.py slices [--devices 8] [--out PATH]

Each kind of computation over all the devices (a `jit` the compiler partitions over a
mesh, a `shard_map`, a `pmap`, a `shard_map` called at each step of a loop, a `jit` over
a mesh of Explicit axes) runs a `fori_loop` of 400 steps that taps 64 B a step (an
`id_tap` of a no-op closure: this process's own ring; or a dormant `tapd.tap`, whose
consumer the daemon started here says no subscriber takes), and the same loop
untapped. One child process per `TAPD_GATHER` setting (`off`: one host callback a tap;
`on`: gathered on each device), `TAPD_BACKEND=portable` (a TPU's path), each variant
timed in interleaved rounds, medians. On the CPU a host callback costs a few µs, not a
TPU's ~1 ms: the callback counts are the figure that carries over, the times are this
box's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import multihost_utils
from processes import BENCH_DIR, Processes, read_line
from report import median, number, size_name, table, with_spread

import tapd

DEVICES_PER_PROCESS = 4
CONSUMERS = "bench.multihost.*"
READY_TIMEOUT = 300.0  # import, distributed init and compiling, on a loaded machine
RUN_TIMEOUT = 360.0
EXIT_TIMEOUT = 60.0


@dataclasses.dataclass
class Runs:
    """One job at one payload size: per repeat, the span from the earliest start to
    the latest end over its processes, and how far apart the processes started."""

    processes: int
    size: int
    steps: int
    span_s: list[float] = dataclasses.field(default_factory=list)
    start_skew_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def taps(self) -> int:
        return self.processes * DEVICES_PER_PROCESS * self.steps

    def taps_per_s(self) -> list[float]:
        return [self.taps / s for s in self.span_s]

    def mb_per_s(self) -> list[float]:
        return [self.taps * self.size / s / 1e6 for s in self.span_s]


class Job:
    """The processes of one JAX job (one per "host"), driven line by line."""

    def __init__(
        self, name: str, processes: list[subprocess.Popen[bytes]], logs: list[Path]
    ) -> None:
        self.name = name
        self.processes = processes
        self.logs = logs
        self.facts: list[dict[str, Any]] = []
        self.stats: list[dict[str, Any]] = []
        self.exits: list[int | None] = []  # exit statuses after `quit`; None: had to stop it

    def _replies(self, timeout: float, what: str) -> list[str]:
        lines = []
        for index, process in enumerate(self.processes):
            line = read_line(process, timeout)
            if not line:
                tail = self.logs[index].read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{self.name}, process {index}: no answer to {what} within {timeout:g} s "
                    f"(exit status {process.poll()}); its stderr ends:\n{tail}"
                )
            lines.append(line)
        return lines

    def _send(self, line: str) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(line.encode() + b"\n")
            process.stdin.flush()

    def wait_ready(self) -> None:
        for line in self._replies(READY_TIMEOUT, "start-up"):
            if not line.startswith("ready "):
                raise RuntimeError(f"{self.name}: expected 'ready', got {line!r}")
            self.facts.append(json.loads(line.removeprefix("ready ")))

    def run(self, runs: Runs) -> None:
        """One timed run on every process at once; records span and start skew."""
        self._send(f"run {runs.size} {runs.steps}")
        replies = [json.loads(line) for line in self._replies(RUN_TIMEOUT, "run")]
        starts = [r["start"] for r in replies]
        runs.span_s.append(max(r["end"] for r in replies) - min(starts))
        runs.start_skew_s.append(max(starts) - min(starts))

    def quit(self, processes: Processes) -> None:
        """Leave the job: every process prints its tapd.stats() and exits by itself
        (leaving the job, then tapd's exit drain, which removes its ring); a process
        still there after EXIT_TIMEOUT s is stopped, and `exits` says so."""
        self._send("quit")
        self.stats = [json.loads(line)["stats"] for line in self._replies(EXIT_TIMEOUT, "quit")]
        deadline = time.monotonic() + EXIT_TIMEOUT
        for process in self.processes:
            try:
                self.exits.append(process.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.exits.append(None)
            processes.stop(process)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_job(hosts: list[Processes], count: int, sizes: list[int], backend: str | None) -> Job:
    """`count` processes, process i tapping into hosts[i]'s daemon (not yet ready)."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
    }
    coordinator = f"127.0.0.1:{free_port()}"
    processes, logs = [], []
    for index in range(count):
        host = hosts[index]
        argv = [
            sys.executable, str(BENCH_DIR / "multihost.py"), "--endpoint", host.endpoint,
            "--sizes", ",".join(map(str, sizes)), "--processes", str(count),
            "--process-id", str(index), "--coordinator", coordinator,
            *(["--backend", backend] if backend else []),
        ]  # fmt: skip
        log = host.workdir / f"job{count}.{index}.log"
        processes.append(host.spawn(argv, env=env, log=log))
        logs.append(log)
    return Job(f"the {count}-process job", processes, logs)


@dataclasses.dataclass
class Outcome:
    """What section 5 reports."""

    single: list[Runs]
    pair: list[Runs]
    tally: dict[str, dict[str, list[int]]]
    expected: dict[str, dict[str, list[int]]]
    facts: list[dict[str, Any]]
    emitter_stats: list[dict[str, Any]]
    exits: list[int | None]
    daemon_counters: list[dict[str, Any]]
    daemon_logs: list[str]


def measure(workdir: Path, counts: dict[int, int], repeats: int, backend: str | None) -> Outcome:
    """Two daemons, one sink following both, both jobs; `repeats` interleaved rounds."""
    hosts = []
    for index in range(2):
        directory = workdir / f"host{index}"
        directory.mkdir(mode=0o700)
        hosts.append(Processes(directory))
    sizes = list(counts)
    single = [Runs(1, size, steps) for size, steps in counts.items()]
    pair = [Runs(2, size, steps) for size, steps in counts.items()]
    try:
        for host in hosts:
            host.start_daemon()
        endpoints = [host.endpoint for host in hosts]
        sink = hosts[0].start_sink(CONSUMERS, tally=True, endpoints=endpoints)
        jobs = [start_job(hosts, 1, sizes, backend), start_job(hosts, 2, sizes, backend)]
        for job in jobs:
            job.wait_ready()
        print(f"  multi-host: jobs ready ({jobs[0].facts + jobs[1].facts})", flush=True)
        for repeat in range(repeats):
            for index in range(len(sizes)):
                pairs = [(jobs[0], single[index]), (jobs[1], pair[index])]
                for job, runs in pairs if repeat % 2 == 0 else reversed(pairs):
                    job.run(runs)
            print(f"  multi-host: repeat {repeat + 1}/{repeats} done", flush=True)
        for job in jobs:
            job.quit(hosts[0])
        hosts[0].stop(sink.process)
        tally = sink.results()["tally"]
        counters = [host.daemon_stats()["counters"] for host in hosts]
    finally:
        for host in reversed(hosts):
            host.stop_all()
    expected: dict[str, dict[str, list[int]]] = {}
    for runs in single + pair:
        taps = DEVICES_PER_PROCESS * (2 + repeats * runs.steps)  # + the 2 warm-up steps
        expected[f"bench.multihost.p{runs.processes}.{runs.size}"] = {
            str(p): [taps, taps * runs.size] for p in range(runs.processes)
        }
    return Outcome(
        single, pair, tally, expected, jobs[0].facts + jobs[1].facts,
        jobs[0].stats + jobs[1].stats, jobs[0].exits + jobs[1].exits, counters,
        [host.daemon_log_text().strip() for host in hosts],
    )  # fmt: skip


def spread(values: list[float]) -> str:
    """`median (min-max)`, big numbers with thousands separators."""
    return f"{number(median(values), 0)} ({number(min(values), 0)}-{number(max(values), 0)})"


def render(outcome: Outcome) -> str:
    """The table, the ratios, and the checks of what the subscriber received."""
    rows = []
    for a, b in zip(outcome.single, outcome.pair, strict=True):
        ratios = [y / x for x, y in zip(a.taps_per_s(), b.taps_per_s(), strict=True)]
        for runs, label in ((a, "(a) 1 process x 4 devices, 1 daemon"),
                            (b, "(b) 2 processes x 4 devices, 2 daemons")):  # fmt: skip
            rows.append([
                size_name(runs.size), label, f"{runs.taps:,}",
                spread(runs.taps_per_s()), number(median(runs.mb_per_s()), 1),
                f"{median(runs.span_s) * 1e3:.0f}",
                with_spread(ratios) if runs is b else "",
            ])  # fmt: skip
    header = [
        "payload per device-tap", "job", "taps per run", "taps/s: median (min-max)",
        "MB/s (median)", "run ms (median)", "(b) ÷ (a) taps/s: median (min-max)",
    ]  # fmt: skip
    skews = [s * 1e3 for runs in outcome.pair for s in runs.start_skew_s]
    notes = [
        f"(b)'s two processes started their timed runs within {median(skews):.2f} ms of each "
        f"other (median; at most {max(skews):.2f} ms) after the sync.",
        "Ideal scaling would be x2 (twice the devices, processes and daemons); all of them, "
        "and the one subscriber, share this machine's cores.",
    ]
    if outcome.tally == outcome.expected:
        taps = sum(c[0] for per in outcome.tally.values() for c in per.values())
        data = sum(c[1] for per in outcome.tally.values() for c in per.values())
        notes.append(
            f"The subscriber received every tap, warm-ups included: {taps:,} taps, "
            f"{data / 1e6:,.1f} MB, from process 0 and (in (b)) process 1, as expected."
        )
    else:
        notes.append(
            "**The subscriber's tally differs from what was tapped**: got "
            f"`{json.dumps(outcome.tally, sort_keys=True)}`, expected "
            f"`{json.dumps(outcome.expected, sort_keys=True)}` ({{consumer: {{process: "
            "[taps, bytes]}}}})."
        )
    backends = sorted({f["backend"] for f in outcome.facts})
    health = [
        f"emitter backend(s): {', '.join(backends)}; devices seen by (a): "
        f"{outcome.facts[0]['devices']}, by (b): {outcome.facts[1]['devices']}",
        "daemon counters, host 0 then host 1: "
        + "; ".join(f"`{json.dumps(c, sort_keys=True)}`" for c in outcome.daemon_counters),
        "emitter counters, (a) then (b)'s processes 0 and 1 (`blocked_ns`: time taps "
        "waited for room in a full ring, i.e. for the daemon and subscriber to catch up): "
        + "; ".join(f"`{json.dumps(s, sort_keys=True)}`" for s in outcome.emitter_stats),
    ]
    health.append(
        "job processes' exit statuses after `quit`, (a) then (b)'s 0 and 1: "
        + ", ".join("stopped, had not exited" if e is None else str(e) for e in outcome.exits)
    )
    logs = "\n".join(log for log in outcome.daemon_logs if log)
    health.append("daemon warnings/errors: " + (f"\n\n```\n{logs}\n```" if logs else "none"))
    return (
        table(header, rows)
        + "\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + "\n\nHealth of this section:\n\n"
        + "\n".join(f"- {h}" for h in health)
    )


def method(counts: dict[int, int], repeats: int) -> str:
    """The Method bullet for RESULTS.md."""
    sizes = ", ".join(f"{size_name(s)} x {steps} steps" for s, steps in counts.items())
    return (
        "- Multi-host throughput: two tapd daemons, each on its own ipc socket and ring "
        "directory (two hosts' daemons, on one machine), and ONE subscriber process "
        "following both with a no-op handler that adds up taps and bytes per consumer and "
        "emitting process. (a) is one JAX process with 4 CPU devices "
        "(`--xla_force_host_platform_device_count=4`) tapping into daemon 0; (b) is a "
        "2-process `jax.distributed` job (gloo CPU collectives), 4 devices each, process i "
        "tapping into daemon i. Each job runs a `pmap` over all its devices (4 or 8) of a "
        "`fori_loop` whose every step taps the device's float32 shard "
        f"({sizes} per device per run; no collective inside the loop). Per process the "
        "time runs from just after a cross-process sync "
        "(`multihost_utils.sync_global_devices`; none in (a)) through dispatch, "
        "`block_until_ready()` and `tapd.barrier_wait()` returning (every tap of that "
        "process handled by the subscriber); a run's time is the earliest start to the "
        "latest end over the job's processes (`time.monotonic()`, one clock on this "
        f"machine). taps/s = taps of all devices / that time. {repeats} repeats; within "
        "each, (a) and (b) alternate per size (order flipped every repeat) while the other "
        "job waits idle; the (b) ÷ (a) column is the median of the per-repeat ratios. "
        "Compilation, process start-up and 2 warm-up steps per size are outside the timing."
    )


# ---- one process of the job (run as a script) -------------------------------------------

JOB_BARRIER_TIMEOUT = 300.0


def job_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one process of the multi-host benchmark's job")
    parser.add_argument("--endpoint", required=True, help="this host's daemon")
    parser.add_argument("--sizes", required=True, help="bytes per device-tap, comma-separated")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", help="HOST:PORT of jax.distributed's coordinator")
    parser.add_argument("--backend", help="tapd emitter backend (default: tapd's own)")
    return parser.parse_args()


def consumer_name(processes: int, size: int) -> str:
    return f"bench.multihost.p{processes}.{size}"


def tapping_loop(name: str) -> Callable[[jax.Array, int], jax.Array]:
    """pmap over every device of the job: a fori_loop of n steps, each tapping the shard."""

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x, name, step=i)
        return x

    return jax.pmap(lambda x, n: lax.fori_loop(0, n, body, x), in_axes=(0, None))


def protocol_channel() -> TextIO:
    """The real stdout, for our lines only; fd 1 becomes stderr from here on, so what
    native code prints (gloo does) cannot get into the protocol."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


def job_main() -> None:
    """One process of the job (the module docstring's second half), run as a script."""
    args = job_args()
    channel = protocol_channel()

    def say(line: str) -> None:
        channel.write(line + "\n")
        channel.flush()

    if args.processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator, num_processes=args.processes, process_id=args.process_id
        )
        # jax.distributed's preemption notice takes SIGTERM over; the bench stops us
        # with it only when something went wrong, so go at once.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    settings = {"endpoint": args.endpoint, "exit_timeout": 5.0}
    if args.backend:
        settings["backend"] = args.backend
    tapd.configure(**settings)
    local = jax.local_device_count()
    sizes = [int(s) for s in args.sizes.split(",")]
    loops = {size: tapping_loop(consumer_name(args.processes, size)) for size in sizes}
    shards = {size: jnp.ones((local, size // 4), jnp.float32) for size in sizes}
    for size in sizes:  # compile and warm up outside the timing
        loops[size](shards[size], 2).block_until_ready()
        tapd.barrier_wait(timeout=JOB_BARRIER_TIMEOUT)

    def sync(name: str) -> None:
        if args.processes > 1:
            multihost_utils.sync_global_devices(name)

    sync("ready")
    facts = {"backend": tapd.backend(), "devices": jax.device_count(), "local_devices": local}
    say("ready " + json.dumps(facts))
    for runs, line in enumerate(sys.stdin, start=1):
        command = line.split()
        if command == ["quit"]:
            break
        if len(command) != 3 or command[0] != "run":
            raise SystemExit(f"multihost job: unknown command {line!r}")
        size, steps = int(command[1]), int(command[2])
        sync(f"run {runs}")
        started = time.monotonic()
        loops[size](shards[size], steps).block_until_ready()
        tapd.barrier_wait(timeout=JOB_BARRIER_TIMEOUT)
        ended = time.monotonic()
        say(json.dumps({"start": started, "end": ended, "taps": local * steps}))
    say(json.dumps({"stats": tapd.stats()}))
    if args.processes > 1:
        jax.distributed.shutdown()


# ---- slices: taps over several devices, per tap against gathered ---------------------------------

SLICE_STEPS = 400
SMALL = 16


def slices_child() -> dict[str, Any]:
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("d",))

    def step(tapped: str) -> Any:
        def body(i: Any, x: Any) -> Any:
            if tapped == "tap":
                x = tapd.id_tap(lambda v, t: None, x)
            elif tapped == "dormant":  # (no subscriber takes "nobody": the daemon says so)
                x = tapd.tap(x, "nobody")
            return x * 0.999 + 0.001

        return body

    def loop(tapped: str) -> Any:
        return lambda x: lax.fori_loop(0, SLICE_STEPS, step(tapped), x)

    def per_device(tapped: str) -> Any:
        inner = loop(tapped)
        return lambda x: inner(x.reshape(SMALL)).reshape(x.shape)

    def in_loop(tapped: str) -> Any:  # a shard_map at each step of the loop
        body = jax.shard_map(
            lambda i, x: step(tapped)(i, x), mesh=mesh, in_specs=(P(), P("d")), out_specs=P("d")
        )
        return jax.jit(lambda x: lax.fori_loop(0, SLICE_STEPS, body, x))

    explicit = jax.make_mesh((devices,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def under_explicit(tapped: str) -> Any:  # each tap of a sharded value: its shards'
        with jax.set_mesh(explicit):
            function = jax.jit(loop(tapped))

        def call(x: Any) -> Any:
            with jax.set_mesh(explicit):
                return function(x)

        return call

    variants: dict[str, tuple[Any, Any]] = {}
    spread = jnp.zeros((devices, SMALL), jnp.float32)
    sharded = jax.device_put(jnp.zeros(devices * SMALL), NamedSharding(mesh, P("d")))
    on_explicit = jax.device_put(jnp.zeros(devices * SMALL), NamedSharding(explicit, P("d")))
    for name in ("none", "tap", "dormant"):
        variants[f"sharded jit {name}"] = (jax.jit(loop(name)), sharded)
        smap = jax.shard_map(per_device(name), mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        variants[f"shard_map {name}"] = (jax.jit(smap), spread.reshape(-1))
        variants[f"pmap {name}"] = (jax.pmap(per_device(name)), spread)
        variants[f"shard_map in a loop {name}"] = (in_loop(name), spread.reshape(-1))
        variants[f"Explicit mesh {name}"] = (under_explicit(name), on_explicit)

    callbacks: dict[str, int] = {}
    for name, (function, x) in variants.items():
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=300)
        before = tapd.stats().get("host_callbacks", 0)
        jax.block_until_ready(function(x))
        tapd.barrier_wait(timeout=300)
        callbacks[name] = tapd.stats().get("host_callbacks", 0) - before
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name, (function, x) in variants.items():
            start = time.perf_counter()
            for _ in range(3):
                out = function(x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / (3 * SLICE_STEPS) * 1e6)
            tapd.barrier_wait(timeout=300)
    return {
        "us": {name: statistics.median(values) for name, values in times.items()},
        "callbacks": callbacks,
        "devices": devices,
        "jax": jax.__version__,
    }


def slices_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="taps over several devices (slices)")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--out", default=None, help="write the report here (Markdown)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(slices_child()))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="sl-", dir="/tmp") as workdir:
        processes = Processes(Path(workdir))
        try:
            processes.start_daemon()  # (it marks "nobody" dormant: no subscriber takes it)
            for gather in ("off", "on"):
                env = {
                    **os.environ,
                    "JAX_PLATFORMS": "cpu",
                    "TAPD_AUTOSTART": "0",
                    "TAPD_ENDPOINT": processes.endpoint,
                    "TAPD_BACKEND": "portable",
                    "TAPD_GATHER": gather,
                    "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}",
                }
                done = subprocess.run([sys.executable, __file__, "slices", "--child"], env=env,
                                      capture_output=True, text=True, check=True)  # fmt: skip
                results[gather] = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            processes.stop_all()
    lines = [
        "# Taps over several devices (bench/multihost.py slices)",
        "",
        f"{args.devices} forced CPU devices, JAX {results['on']['jax']}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs; a {SLICE_STEPS}-step loop "
        "tapping 64 B a step (id_tap of a no-op closure; dormant: `tapd.tap` of a consumer "
        "no subscriber takes), portable backend. µs a step (medians of 5 rounds of 3 "
        "calls), and in brackets the host callbacks one call runs.",
        "",
        "| computation | tap | untapped | tapped, gather off | tapped, gather on "
        "| added: on ÷ off |",
        "|---|---|---|---|---|---|",
    ]
    kinds = ("sharded jit", "shard_map", "pmap", "shard_map in a loop", "Explicit mesh")
    off, on = results["off"], results["on"]
    for kind in kinds:
        for tapped in ("tap", "dormant"):
            added_off = off["us"][f"{kind} {tapped}"] - off["us"][f"{kind} none"]
            added_on = on["us"][f"{kind} {tapped}"] - on["us"][f"{kind} none"]
            lines.append(
                f"| {kind} | {tapped} | {on['us'][f'{kind} none']:.2f} | "
                f"{off['us'][f'{kind} {tapped}']:.2f} ({off['callbacks'][f'{kind} {tapped}']}) | "
                f"{on['us'][f'{kind} {tapped}']:.2f} ({on['callbacks'][f'{kind} {tapped}']}) | "
                f"{added_on / added_off:.3f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["slices"]:
        slices_main(sys.argv[2:])
    else:
        job_main()
