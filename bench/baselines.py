"""Throughput baselines without tapd: raw pyzmq PUSH/PULL over ipc, multiprocessing.Queue;
and tapd's same-host subscribers beside them (shm: bench/RESULTS.md section 6).

    python bench/baselines.py zmq   --size BYTES --count N --endpoint ipc://...
    python bench/baselines.py queue --size BYTES --count N
    python bench/baselines.py shm [--size BYTES] [--count N] [--rounds R] [--output PATH]

This process is the producer; it spawns one consumer process. One warm-up message
makes sure the consumer is connected and running; then the producer times from its
first send of `count` messages of `size` bytes (one float32 numpy array, as tapd's
payload) until the consumer reports it has received the last one. Prints one JSON
line: {"seconds": ...}. No JAX here, so spawning the consumer is cheap (the modules that
import tapd, and with it JAX, are imported by the shm functions that use them).

Shm: One daemon (policy block) with two subscriber processes of one consumer each would split
nothing (each gets every tap), so each path has a daemon of its own: one whose
subscriber reads ring taps from shared memory (the default), one whose subscriber has
TAPD_SHM_SUBSCRIBERS=0 (the bytes over the socket). A JAX process (native backend) taps
a `size`-byte float32 array `count` times in one jitted loop (as bench/run.py, section
2, does); the time is from its first tap until `barrier_wait()` returns, i.e. until the
subscriber's handler (a no-op per tap, under the default: the leaves copied into the
subscriber's memory first) has handled every tap. Raw pyzmq: bench/baselines.py's
PUSH/PULL between two processes over ipc. One memcpy: numpy copying `size`-byte blocks
between two 256 MiB regions (neither cache-resident). Each round runs all of them once,
so that the machine's load falls on each alike; the table gives the median (min-max) of
the rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

REPO = Path(__file__).resolve().parent.parent
SPAWN = mp.get_context("spawn")  # never fork: the parent may hold threads
WAIT_TIMEOUT = 120.0


def payload(size: int) -> np.ndarray:
    """A float32 array of `size` bytes, like the tapped arrays."""
    return np.arange(size // 4, dtype=np.float32)


# ---- raw pyzmq --------------------------------------------------------------------------


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


# ---- multiprocessing.Queue ----------------------------------------------------------------


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
        from processes import Processes, wait_until

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
        from processes import read_line

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
    from report import code_revision, machine_description, publish, size_name, table, with_spread

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

`python bench/baselines.py shm --size {size} --count {count} --rounds {args.rounds}`:
{size_name(size)} taps, {count} per run, {args.rounds} rounds; median (min-max) of the rounds.
Each round runs every row once, one after the other. tapd rows: from a JAX process's
first tap (native backend, one jitted loop, policy block) until `barrier_wait()` returned,
every tap handled by a per-tap no-op handler in another process (shared memory: the
leaves copied into the subscriber's memory before the call, the default). Subscribers:
{seen}.

{table(header, rows)}

Code: {code_revision(REPO)}. The machine is shared (other engineers' builds and tests
ran meanwhile): the ratios of one run are what to compare, not the absolute figures.

{machine}
"""
    publish(text, args.output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["zmq", "queue", "shm"])
    parser.add_argument("--size", type=int, help="bytes a message (shm: 1 MiB unless given)")
    parser.add_argument("--count", type=int, help="messages (shm: 1000 unless given)")
    parser.add_argument("--endpoint", help="ipc:// endpoint for the zmq consumer to bind")
    parser.add_argument("--rounds", type=int, default=3, help="shm: rounds of every row")
    parser.add_argument("--output", type=Path, help="shm: also write the report here")
    parser.add_argument("--role", choices=["subscriber", "emitter"], help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args()  # (shm's roles: `shm --role R ARGS...`)
    if args.kind == "shm":
        args.size = args.size or 2**20
        args.count = args.count or 1000
        return same_host(args)
    if args.size is None or args.count is None:
        parser.error(f"{args.kind} needs --size and --count")
    if args.kind == "zmq":
        if not args.endpoint:
            parser.error("zmq needs --endpoint")
        seconds = zmq_producer(args.endpoint, args.size, args.count)
    else:
        seconds = queue_producer(args.size, args.count)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
