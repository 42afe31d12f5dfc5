"""Fan-in: how much one upstream daemon takes (issue 20, part 3), and churn.

    python bench/fanin.py [--forwarders 4,32] [--sizes 64,1048576] [--seconds 5]
        [--churn-seconds 120] [--output PATH] [--quick]

One upstream daemon (ipc, its own runtime directory) with one counting subscriber, and
N "hosts": each a forwarding daemon (`tapd start --forward UPSTREAM`, its own runtime
directory and ring directory) fed by a load generator that needs no JAX: a process that
writes the shared-memory ring as the native FFI handler does (tapd's Sender and
NativeEmitter, records written with `tapd_ring_write`), so each forwarder reads rings,
routes and forwards exactly as on a JAX host.

Throughput: for each forwarder count and payload size, the first N generators write as
fast as they can for `--seconds`, then wait in `barrier_wait` (every tap handled by the
upstream's subscriber). Taps/s over the span; the upstream's CPU (utime + stime from
/proc/<pid>/stat) over the same span gives taps/s and MB/s per upstream core.

Churn: every generator writes at `--churn-rate` taps/s while, every `--churn-every`
seconds, a random forwarder is killed with SIGKILL (a preempted host's daemon) and
started again after a short pause; its generator (the job) writes on into its ring and
says hello to the new daemon, which reads the ring from what was released. The
upstream's RSS and open file descriptors are sampled throughout. At the end every
count is checked: distinct taps delivered + counted lost == sent, per generator.

Its child processes are bench/processes.py's: `processes.py generate` (a load generator,
driven on stdin) and `processes.py count` (the upstream's subscriber, writing what it saw
at SIGTERM); `fanin.py generate` and `fanin.py count` run the same (tests/test_fanin.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from processes import (  # noqa: E402
    RUN_TIMEOUT,
    Processes,
    count,
    cpu_seconds,
    generate,
    proc_status,
    read_line,
    wait_until,
)

from tapd.clients import control  # noqa: E402

READY_TIMEOUT = 120.0  # 33 daemons start on 2 shared cores: imports take a while
STATS_TIMEOUT = 60.0
SETTLE_TIMEOUT = 90.0  # the upstream forgets a silent forwarder after 3 x its timeout
CHILD = [sys.executable, str(BENCH_DIR / "processes.py")]  # its generate and count


# ---- the orchestrator ------------------------------------------------------------------


class Host:
    """One forwarding daemon and its generator, in a runtime directory of its own."""

    def __init__(self, index: int, workdir: Path, upstream: str) -> None:
        self.index = index
        self.directory = workdir / f"h{index:02d}"
        self.directory.mkdir(mode=0o700)
        self.daemon = Processes(self.directory)
        self.upstream = upstream
        self.generator: subprocess.Popen[bytes] | None = None
        self.daemon_pid = 0
        self.restarts = 0
        self.lost_stats: list[dict[str, int]] = []  # counters of killed daemons (unreadable)

    def start_daemon(self) -> None:
        flags = ["--forward", self.upstream, "--startup-grace", "0"]
        self.daemon.start_daemon(timeout=READY_TIMEOUT, flags=flags)
        assert self.daemon._daemon is not None
        self.daemon_pid = self.daemon._daemon.pid

    def kill_daemon(self) -> None:
        """SIGKILL, as a preempted host's daemon gets: nothing is flushed or said."""
        process = self.daemon._daemon
        assert process is not None
        process.kill()
        process.wait()
        self.daemon.stop(process)
        self.restarts += 1

    def start_generator(self) -> None:
        argv = [*CHILD, "generate", "--endpoint", self.daemon.endpoint]
        log = self.directory / "generator.log"
        self.generator = self.daemon.spawn(argv, env=dict(os.environ), log=log)
        line = read_line(self.generator, READY_TIMEOUT)
        if '"ready"' not in line:
            raise RuntimeError(f"generator {self.index}: {line!r}\n{log.read_text()[-2000:]}")

    def command(self, line: str) -> None:
        assert self.generator is not None and self.generator.stdin is not None
        self.generator.stdin.write(line.encode() + b"\n")
        self.generator.stdin.flush()

    def result(self) -> dict[str, Any]:
        assert self.generator is not None
        line = read_line(self.generator, RUN_TIMEOUT)
        if not line.startswith("{"):
            log = (self.directory / "generator.log").read_text()[-3000:]
            raise RuntimeError(f"generator {self.index} gave no result: {line!r}\n{log}")
        return dict(json.loads(line))

    def stats(self) -> dict[str, Any]:
        return stats_of(self.daemon.endpoint)


@dataclasses.dataclass
class Throughput:
    forwarders: int
    size: int
    taps: int
    span_s: float
    upstream_cpu_s: float
    results: list[dict[str, Any]]

    @property
    def taps_per_s(self) -> float:
        return self.taps / self.span_s

    @property
    def taps_per_core_s(self) -> float:
        return self.taps / self.upstream_cpu_s if self.upstream_cpu_s else float("nan")


@dataclasses.dataclass
class Fleet:
    workdir: Path
    upstream: Processes
    upstream_pid: int
    sink: subprocess.Popen[bytes]
    sink_result: Path
    hosts: list[Host]


def start_fleet(workdir: Path, count_hosts: int) -> Fleet:
    up = workdir / "up"
    up.mkdir(mode=0o700)
    upstream = Processes(up)
    upstream.start_daemon(timeout=READY_TIMEOUT, flags=["--startup-grace", "0"])
    assert upstream._daemon is not None
    result = up / "count.json"
    argv = [*CHILD, "count", "--endpoint", upstream.endpoint, "--result", str(result)]
    sink = upstream.spawn(argv, env=dict(os.environ), log=up / "count.log")
    wait_until(
        lambda: upstream.daemon_stats()["subscribers"] or sink.poll() is not None,
        "the counting subscriber to connect",
        timeout=READY_TIMEOUT,
    )
    fleet = Fleet(workdir, upstream, upstream._daemon.pid, sink, result, [])
    for index in range(count_hosts):
        host = Host(index, workdir, upstream.endpoint)
        fleet.hosts.append(host)
        host.start_daemon()
        host.start_generator()
        print(f"  fan-in: host {index} up ({time.strftime('%H:%M:%S')})", flush=True)
    return fleet


def ring_for(size: int) -> int:
    """A throughput run's ring: room for a few taps, so that what waits in the rings when
    the writing stops (and is drained inside the timed span) stays small."""
    return max(64 << 10, 4 * (size + 4096))


def run_all(
    hosts: list[Host], consumer: str, size: int, seconds: float, rate: float, ring_bytes: int
) -> list[Any]:
    for host in hosts:
        host.command(f"run {consumer}.{host.index} {size} {seconds} {rate} {ring_bytes}")
    return [host.result() for host in hosts]


def throughput(fleet: Fleet, forwarders: int, size: int, seconds: float) -> Throughput:
    hosts = fleet.hosts[:forwarders]
    cpu_before = cpu_seconds(fleet.upstream_pid)
    results = run_all(hosts, f"fanin.t{forwarders}x{size}", size, seconds, 0, ring_for(size))
    cpu = cpu_seconds(fleet.upstream_pid) - cpu_before
    span = max(r["end"] for r in results) - min(r["start"] for r in results)
    taps = sum(r["sent"] for r in results)
    return Throughput(forwarders, size, taps, span, cpu, results)


@dataclasses.dataclass
class Churn:
    seconds: float
    kills: int
    samples: list[dict[str, float]]  # the upstream, every second while forwarders churn
    drained: dict[str, float]  # once every generator's final barrier returned
    settled: dict[str, float] | None  # once the killed forwarders were forgotten upstream
    results: list[dict[str, Any]]
    upstream_stats: dict[str, Any]


def sample(fleet: Fleet, start: float) -> dict[str, float]:
    """The upstream now: RSS, open fds, the emitters it keeps state for, the taps queued
    for (or in flight to) its subscriber and the bytes it holds."""
    stats = stats_of(fleet.upstream.endpoint)
    subscribers = stats["subscribers"]
    return {
        "t": time.monotonic() - start,
        **proc_status(fleet.upstream_pid),
        "emitters": len(stats["emitters"]),
        "queued": sum(s["queued"] + s["in_flight"] for s in subscribers),
        "held_bytes": sum(s["held_bytes"] for s in subscribers),
    }


def churn(
    fleet: Fleet,
    seconds: float,
    every: float,
    rate: float,
    size: int,
    ring_bytes: int,
    settle: bool = True,
) -> Churn:
    """Every generator writes at `rate` taps/s for `seconds` while forwarders are killed
    and restarted; the upstream is sampled every second."""
    rng = random.Random(20)
    for host in fleet.hosts:
        host.command(f"run fanin.churn.{host.index} {size} {seconds} {rate} {ring_bytes}")
    start = time.monotonic()
    samples = [sample(fleet, start)]
    next_kill = start + every
    next_sample = start + 1.0
    kills = 0
    while (now := time.monotonic()) < start + seconds:
        if now >= next_kill:
            host = rng.choice(fleet.hosts)
            host.kill_daemon()
            kills += 1
            time.sleep(rng.uniform(0.0, 0.5))  # down a moment, as a preempted host is
            host.start_daemon()
            next_kill = time.monotonic() + every
        if now >= next_sample:
            samples.append(sample(fleet, start))
            next_sample = max(next_sample + 1.0, time.monotonic())
        time.sleep(0.05)
    results = [host.result() for host in fleet.hosts]
    drained = sample(fleet, start)
    # Settled: the killed forwarders forgotten upstream (silent for 3 subscriber
    # timeouts), one emitter per host left; state kept for dead ones would show here.
    settled = None
    if settle:
        try:
            wait_until(
                lambda: len(upstream_emitters(fleet)) == len(fleet.hosts),
                "dead forwarders forgotten",
                timeout=SETTLE_TIMEOUT,
            )
        except TimeoutError:
            pass
        settled = sample(fleet, start)
    stats = stats_of(fleet.upstream.endpoint)
    return Churn(seconds, kills, samples, drained, settled, results, stats)


def upstream_emitters(fleet: Fleet) -> list[Any]:
    return list(stats_of(fleet.upstream.endpoint).get("emitters", []))


def stats_of(endpoint: str) -> dict[str, Any]:
    """`tapd status --json` of a daemon, waiting longer than the CLI does: on two shared
    cores with 65 busy processes a daemon may take seconds to answer."""
    return control.stats(endpoint, timeout=STATS_TIMEOUT)


def stop_fleet(fleet: Fleet) -> dict[str, Any]:
    """Quit the generators, stop the daemons, then the subscriber: its counts."""
    for host in fleet.hosts:
        host.command("quit")
    for host in fleet.hosts:
        if host.generator is not None:
            try:
                host.generator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        host.daemon.stop_all()
    fleet.upstream.stop(fleet.sink)
    fleet.upstream.stop_all()
    if not fleet.sink_result.exists():
        log = (fleet.workdir / "up" / "count.log").read_text()[-3000:]
        raise RuntimeError(f"the counting subscriber wrote no result\n{log}")
    return dict(json.loads(fleet.sink_result.read_text()))


def check_counts(results: list[dict[str, Any]], seen: dict[str, Any]) -> list[str]:
    """Per generator run: distinct delivered + counted lost == sent. Lost is counted by
    the ring (dropped: none under `block`) and by the daemons, as their replies told the
    emitter (dropped, unrouted; `unknown`: taps no daemon reported on). Returns the
    mismatches (empty: exact)."""
    problems = []
    for r in results:
        got = seen.get(r["consumer"], {}).get("distinct", 0)
        lost = r["dropped"] + r["daemon_dropped"] + r["unrouted"]
        if got + lost != r["sent"]:
            problems.append(f"{r['consumer']}: delivered {got} + lost {lost} != sent {r['sent']}")
    return problems


# ---- the report --------------------------------------------------------------------------


def render(
    runs: list[Throughput],
    memory: list[dict[str, int]],
    upstream_memory: dict[str, int],
    churned: Churn | None,
    seen: dict[str, Any],
    problems: list[str],
    args: argparse.Namespace,
) -> str:
    from report import code_revision, machine_description, median, number, size_name, table

    lines = ["# Fan-in: what one upstream daemon takes", ""]
    lines += [
        "Made by `python bench/fanin.py " + " ".join(sys.argv[1:]) + "` (issue 20, part 3). "
        "**Every figure comes from a 2-core machine shared with four other engineers' "
        "work**: 32 forwarding daemons, 32 load generators, the upstream and its subscriber "
        "compete for those two cores, so the absolute rates are what this box gave, not "
        "what a host with cores to spare would. The per-core rate (taps over the "
        "upstream's own CPU seconds) is the figure that carries over.",
        "",
        "## The machine",
        "",
        table(
            ["what", "value"], [*machine_description(), ("code", code_revision(BENCH_DIR.parent))]
        ),
        "",
        "## Throughput into one upstream",
        "",
    ]
    rows = []
    for run in runs:
        mb = run.taps * run.size / 1e6
        rows.append([
            str(run.forwarders), size_name(run.size), f"{run.taps:,}", f"{run.span_s:.2f}",
            number(run.taps_per_s, 0), number(mb / run.span_s, 1),
            f"{run.upstream_cpu_s:.2f}", f"{run.upstream_cpu_s / run.span_s:.2f}",
            number(run.taps_per_core_s, 0), number(mb / run.upstream_cpu_s, 0),
            f"{run.upstream_cpu_s / run.taps * 1e6:.1f}",
        ])  # fmt: skip
    lines.append(
        table(
            [
                "forwarders",
                "payload",
                "taps",
                "span s",
                "taps/s",
                "MB/s",
                "upstream CPU s",
                "upstream cores busy",
                "taps/s per upstream core",
                "MB/s per upstream core",
                "upstream µs CPU per tap",
            ],
            rows,
        )
    )
    lines += [
        "",
        f"Each generator wrote for {args.seconds:g} s as fast as its ring took the taps "
        "(policy `block`: a full ring waits for its forwarder), then waited in "
        "`barrier_wait` until the upstream's subscriber had handled every tap; span: the "
        "first generator's start to the last one's barrier returning. Upstream CPU: "
        "utime + stime of the upstream daemon over that span.",
        "",
        "## Memory per forwarder",
        "",
    ]
    if memory:
        mrows = []
        for key, what in (("VmRSS", "RSS"), ("RssAnon", "of which private (anon)"),
                          ("RssShmem", "of which shared (the ring, mapped twice)"),
                          ("fds", "open file descriptors")):  # fmt: skip
            values = [m[key] for m in memory if key in m]
            unit = 1 if key == "fds" else 1024
            fmt = (lambda v: f"{v:.0f}") if key == "fds" else (lambda v: f"{v:.1f} MiB")
            mrows.append([what, fmt(median(values) / unit), fmt(min(values) / unit),
                          fmt(max(values) / unit)])  # fmt: skip
        lines.append(table(["per forwarding daemon", "median", "min", "max"], mrows))
        lines += [
            "",
            f"Read from /proc/<pid>/status of each of the {len(memory)} forwarding daemons "
            "after the throughput runs. The shared part is the generators' rings the "
            f"daemon reads (the last run's: {ring_for(runs[-1].size) >> 10} KiB each; a JAX "
            "emitter's default is 256 MB), mapped twice (so that any span of it is contiguous): "
            "the emitter's memory, not the daemon's own. The "
            f"upstream daemon then: RSS {upstream_memory['VmRSS'] / 1024:.1f} MiB, "
            f"{upstream_memory['fds']} open file descriptors.",
        ]
    if churned is not None:
        lines += ["", "## Churn", ""]
        srows = []
        first_minute = next((x for x in churned.samples if x["t"] >= 60.0), None)
        marks = [("after 1 s", churned.samples[min(1, len(churned.samples) - 1)])]
        if first_minute is not None:
            marks.append(("after the first minute", first_minute))
        marks.append(("end of churn (last sample while killing)", churned.samples[-1]))
        marks.append(("after the generators' final drain", churned.drained))
        if churned.settled is not None:
            marks.append(("settled: the killed forwarders forgotten", churned.settled))
        for label, x in marks:
            srows.append([label, f"{x['t']:.0f}", f"{x['VmRSS'] / 1024:.1f}",
                          f"{x['RssAnon'] / 1024:.1f}", f"{x['fds']:.0f}",
                          f"{x['emitters']:.0f}", f"{x['queued']:.0f}",
                          f"{x['held_bytes'] / 1e6:.1f}"])  # fmt: skip
        rss = [x["VmRSS"] / 1024 for x in churned.samples]
        fds = [x["fds"] for x in churned.samples]
        most = max(x["emitters"] for x in churned.samples)
        final = churned.settled or churned.drained
        sent = sum(r["sent"] for r in churned.results)
        got = sum(seen.get(r["consumer"], {}).get("distinct", 0) for r in churned.results)
        dups = sum(seen.get(r["consumer"], {}).get("duplicates", 0) for r in churned.results)
        unknown = sum(r["unknown"] for r in churned.results)
        lines += [
            f"{len(churned.results)} hosts, each generator writing {args.churn_rate:g} taps/s "
            f"of {size_name(args.churn_size)} for {churned.seconds:g} s; every "
            f"{args.churn_every:g} s one forwarding daemon, picked at random, was killed with "
            f"SIGKILL and started again 0-0.5 s later: {churned.kills} kills. The upstream:",
            "",
            table(
                [
                    "upstream daemon",
                    "t (s)",
                    "RSS MiB",
                    "anon MiB",
                    "open fds",
                    "emitters kept",
                    "taps queued for the subscriber",
                    "MB held",
                ],
                srows,
            ),
            "",
            f"Sampled every second while killing ({len(churned.samples)} samples): RSS "
            f"{min(rss):.1f}-{max(rss):.1f} MiB, fds {min(fds):.0f}-{max(fds):.0f}. The "
            f"upstream kept state for at most {most:.0f} emitters at once "
            f"({len(churned.results)} forwarders live, plus killed ones not yet forgotten: "
            f"a forwarder silent for 3 subscriber timeouts is), and at the end for "
            f"{final['emitters']:.0f}. The drain at the end is a burst (every ring and "
            "forwarder queue emptied at once, while forwarders killed late re-read their "
            "rings), so what the upstream queues for its subscriber then is its high-water "
            "mark; memory the allocator took for it stays with the process.",
            "",
            f"Counts: {sent:,} taps sent, {got:,} distinct taps delivered to the upstream's "
            f"subscriber, {dups:,} delivered twice (at least once: a killed forwarder's "
            "successor reads again what the upstream had handled but the ring had not yet "
            "released; the subscriber can tell them by their seq). "
            f"The generators' own figure of taps whose fate no daemon told them: {unknown:,} "
            "(taps a forwarder delivered and released in the ring, then was killed before "
            "its next report to the emitter; the subscriber has them).",
        ]
    lines += ["", "## Counts", ""]
    if problems:
        lines += ["**Counts are not exact:**", ""] + [f"- {p}" for p in problems]
    else:
        lines.append(
            "Every generator run, throughput and churn: distinct taps delivered + counted "
            "lost == sent (lost counted by the rings and by the daemons' figures in the "
            "barrier replies; none were lost: policy `block`)."
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    gen = sub.add_parser("generate", help="(child) a load generator")
    gen.add_argument("--endpoint", required=True)
    counter = sub.add_parser("count", help="(child) the upstream's counting subscriber")
    counter.add_argument("--endpoint", required=True)
    counter.add_argument("--result", required=True)
    parser.add_argument("--forwarders", default="4,32", help="forwarder counts, comma-separated")
    parser.add_argument("--sizes", default="64,1048576", help="payload bytes, comma-separated")
    parser.add_argument("--seconds", type=float, default=3.0, help="writing time per run")
    parser.add_argument("--churn-ring-bytes", type=int, default=8 << 20, help="in churn")
    parser.add_argument("--churn-seconds", type=float, default=90.0)
    parser.add_argument("--churn-every", type=float, default=3.0, help="seconds between kills")
    parser.add_argument("--churn-rate", type=float, default=50.0, help="taps/s per generator")
    parser.add_argument("--churn-size", type=int, default=4096)
    parser.add_argument("--output", type=Path, help="write the Markdown report here")
    parser.add_argument("--json", type=Path, help="write the raw figures here")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 hosts, short")
    args = parser.parse_args()
    if args.quick and args.command is None:
        args.forwarders, args.sizes, args.seconds = "2", "64,65536", 0.5
        args.churn_seconds, args.churn_every, args.churn_ring_bytes = 3.0, 1.0, 1 << 20
    return args


def main() -> int:
    args = parse_args()
    if args.command in ("generate", "count"):
        {"generate": generate, "count": count}[args.command](args)
        return 0
    from report import publish

    from tapd.runtime import ring_dir_for

    counts = [int(n) for n in args.forwarders.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="fi-", dir="/tmp"))
    os.chmod(workdir, 0o700)
    fleet: Fleet | None = None
    try:
        fleet = start_fleet(workdir, max(counts))
        runs = []
        for size in sizes:
            for n in counts:
                runs.append(throughput(fleet, n, size, args.seconds))
                run = runs[-1]
                print(f"  fan-in: {time.strftime('%H:%M:%S')} {n} forwarders, {size} B: "
                      f"{run.taps_per_s:,.0f} taps/s, "
                      f"{run.taps_per_core_s:,.0f} per upstream core", flush=True)  # fmt: skip
        memory = [proc_status(host.daemon_pid) for host in fleet.hosts]
        upstream_memory = proc_status(fleet.upstream_pid)
        churned = None
        if args.churn_seconds > 0:
            churned = churn(fleet, args.churn_seconds, args.churn_every, args.churn_rate,
                            args.churn_size, args.churn_ring_bytes,
                            settle=not args.quick)  # fmt: skip
            print(f"  fan-in: churn done, {churned.kills} kills", flush=True)
        seen = stop_fleet(fleet)["consumers"]
        results = [r for run in runs for r in run.results] + (churned.results if churned else [])
        problems = check_counts(results, seen)
        text = render(runs, memory, upstream_memory, churned, seen, problems, args)
        publish(text, args.output)
        if args.json:
            churn_raw = dataclasses.asdict(churned) if churned else None
            raw = {"runs": [dataclasses.asdict(r) for r in runs], "memory": memory,
                   "churn": churn_raw, "seen": seen}  # fmt: skip
            args.json.write_text(json.dumps(raw, indent=1))
        return 1 if problems else 0
    finally:
        if fleet is not None:
            for host in fleet.hosts:
                if host.generator is not None and host.generator.poll() is None:
                    host.generator.kill()
                host.daemon.stop_all()
                shutil.rmtree(ring_dir_for(host.daemon.endpoint) or workdir, ignore_errors=True)
            fleet.upstream.stop_all()
            shutil.rmtree(ring_dir_for(fleet.upstream.endpoint) or workdir, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
