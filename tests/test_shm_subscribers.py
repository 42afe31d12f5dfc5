"""Same-host subscribers reading ring taps from shared memory (tapd/daemon/targets/shm.py,
tapd_client/shm.py): real daemons, real subscriber processes, real JAX programs.

The processes this file starts are this file itself run as a script
(`python test_shm_subscribers.py sub|emit ...`, at the bottom), so that each test says
in one place what its subscriber and emitter do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from conftest import (
    PROCESS_TIMEOUT,
    Daemon,
    native_unavailable,
    rings_of,
    stop_process,
    wait_until,
)
from tapd.protocol import decode, encode, ring_format
from tapd.protocol.message import MAGIC, encode_header

HERE = Path(__file__).resolve()
KIB = 256  # taps of this many KiB unless a test says otherwise: over SHM_MIN_BYTES


def tap_value(seq: int, floats: int) -> dict[str, np.ndarray]:
    """What the emitter taps at step `seq` (exact in float32: integers below 2**24)."""
    return {
        "a": np.arange(floats, dtype=np.float32) + np.float32(seq),
        "b": np.full((3,), seq, np.int32),
    }


def digest(value: Any) -> str:
    leaves = [value[k] for k in sorted(value)] if isinstance(value, dict) else [value]
    sha = hashlib.sha256()
    for leaf in leaves:
        sha.update(np.ascontiguousarray(leaf).tobytes())
    return sha.hexdigest()


# ---- the processes --------------------------------------------------------------------


def subscriber_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("record")
    parser.add_argument("--views", action="store_true")
    parser.add_argument(
        "--keep", action="store_true", help="keep the first value; at exit say if it changed"
    )
    parser.add_argument("--hold", help="the handler waits for this file to exist")
    parser.add_argument("--group")
    parser.add_argument("--other-uid", action="store_true", help="offer rings as another user")
    parser.add_argument("--window", type=int, default=16)
    args = parser.parse_args(argv)

    import time

    import tapd_client.daemon_link as link_module
    from tapd_client import Subscriber, TapMeta

    if args.other_uid:  # what a subscriber of another user on this host would offer
        real_offer = link_module.ring_offer

        def other_offer(directory: Any) -> Any:
            offer = real_offer(directory)
            return None if offer is None else {**offer, "uid": offer["uid"] + 1}

        link_module.ring_offer = other_offer
    out = open(args.record, "a", buffering=1)  # noqa: SIM115 (closed at exit)
    sub = Subscriber(
        args.endpoint, window=args.window, heartbeat=0.2, group=args.group, views=args.views
    )
    kept: list[Any] = []

    @sub.on("big")
    def handle(value: Any, meta: TapMeta) -> None:
        out.write(
            json.dumps({"seq": meta.seq, "sha": digest(value), "ring_taps": sub.ring_taps}) + "\n"
        )
        if args.keep and not kept:
            kept.extend([value, digest(value)])
        while args.hold and not os.path.exists(args.hold):
            time.sleep(0.01)

    signal.signal(signal.SIGTERM, lambda *_: sub.stop())
    with sub:
        out.write(json.dumps({"connected": True}) + "\n")
        sub.run()
    final: dict[str, Any] = {"final": True, "ring_taps": sub.ring_taps, "failed": sub.failed}
    if kept:
        final["kept_changed"] = digest(kept[0]) != kept[1]
    out.write(json.dumps(final) + "\n")


def emitter_main(argv: list[str]) -> None:
    count, floats = int(argv[0]), int(argv[1])
    import jax
    import jax.numpy as jnp

    import tapd

    def step(i: jax.Array) -> jax.Array:
        value = {"a": jnp.arange(floats, dtype=jnp.float32) + i.astype(jnp.float32),
                 "b": jnp.full((3,), i, jnp.int32)}  # fmt: skip
        return tapd.tap(value, "big", step=i)["b"]

    stepped = jax.jit(step)
    for i in range(count):
        stepped(jnp.int32(i))
    tapd.barrier_wait(timeout=120)
    print(json.dumps({"stats": tapd.stats()}), flush=True)


def emitter_when_told_main(argv: list[str]) -> None:
    """One warm-up tap (seq 0), then `count` more (seq 1..count) in one jitted loop when a
    line comes on stdin; says when they are in the ring, then waits for the barrier."""
    count, floats = int(argv[0]), int(argv[1])
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd

    def body(i: jax.Array, carry: jax.Array) -> jax.Array:
        value = {"a": jnp.arange(floats, dtype=jnp.float32) + i.astype(jnp.float32),
                 "b": jnp.full((3,), i, jnp.int32)}  # fmt: skip
        return carry + tapd.tap(value, "big", step=i)["b"][0]

    loop = jax.jit(lambda start, n: lax.fori_loop(start, start + n, body, jnp.int32(0)))
    loop(0, 1).block_until_ready()
    tapd.barrier_wait(timeout=120)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    loop(1, count).block_until_ready()
    print(json.dumps({"written": count}), flush=True)
    tapd.barrier_wait(timeout=120)
    print(json.dumps({"stats": tapd.stats()}), flush=True)


# ---- the tests --------------------------------------------------------------------------


class Sub:
    def __init__(self, process: subprocess.Popen[str], record: Path) -> None:
        self.process = process
        self.record = record

    def lines(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        text = self.record.read_text().splitlines()
        return [json.loads(line) for line in text if line.endswith("}")]

    def taps(self) -> list[dict[str, Any]]:
        return [line for line in self.lines() if "seq" in line]

    def stop(self) -> dict[str, Any]:
        assert stop_process(self.process) == 0
        finals = [line for line in self.lines() if line.get("final")]
        assert finals, f"subscriber wrote no final line: {self.lines()[-3:]}"
        return finals[-1]


@pytest.fixture
def start_sub(runtime_dir: Path) -> Any:
    started: list[Sub] = []
    counter = iter(range(100))

    def start(
        daemon: Daemon | None,
        *flags: str,
        endpoint: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Sub:
        record = runtime_dir / f"shm-sub{next(counter)}.jsonl"
        target = endpoint or (daemon.endpoint if daemon else "")
        before = daemon.subscriber_count() if daemon else 0
        argv = [sys.executable, str(HERE), "sub", target, str(record), *flags]
        process = subprocess.Popen(argv, env={**os.environ, **(env or {})}, text=True)
        sub = Sub(process, record)
        started.append(sub)
        if daemon is not None:
            wait_until(
                lambda: daemon.subscriber_count() > before or process.poll() is not None,
                "the subscriber to connect",
            )
            assert process.poll() is None, "subscriber exited early"
        return sub

    yield start
    for sub in started:
        if sub.process.poll() is None:
            stop_process(sub.process)


def emit(
    endpoint: str, count: int, floats: int, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    full_env = {**os.environ, "TAPD_ENDPOINT": endpoint, **(env or {})}
    return subprocess.Popen(
        [sys.executable, str(HERE), "emit", str(count), str(floats)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def emitted(process: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = process.communicate(timeout=PROCESS_TIMEOUT * 2)
    assert process.returncode == 0, f"emitter exited {process.returncode}\n{out}\n{err}"
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"emitter printed nothing\n{out}\n{err}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def expected(count: int, floats: int) -> dict[int, str]:
    return {seq: digest(tap_value(seq, floats)) for seq in range(count)}


def received(sub: Sub) -> dict[int, str]:
    return {line["seq"]: line["sha"] for line in sub.taps()}


@pytest.fixture
def ring_backend(backend: str) -> str:
    """Both backends, each writing a ring (the portable one through the native
    library's ring writer): the ring path needs the library."""
    if reason := native_unavailable():
        pytest.skip(reason)
    return backend


# ---- data through shared memory is the data ---------------------------------------------


def test_ring_taps_are_the_socket_path_s_data(
    ring_backend: str, start_daemon: Any, start_sub: Any
) -> None:
    daemon = start_daemon()
    count, floats = 24, KIB * 256
    via_ring = start_sub(daemon)
    via_socket = start_sub(daemon, env={"TAPD_SHM_SUBSCRIBERS": "0"})
    emitted(emit(daemon.endpoint, count, floats))
    want = expected(count, floats)
    assert received(via_ring) == want
    assert received(via_socket) == want
    assert via_ring.stop()["ring_taps"] == count
    assert via_socket.stop()["ring_taps"] == 0


def test_64_kib_taps_are_read_from_the_ring(
    ring_backend: str, start_daemon: Any, start_sub: Any
) -> None:
    """Taps of 64 KiB (the smallest that go through shared memory) come as descriptors
    (several to a `ring_taps` message), and are the data."""
    daemon = start_daemon()
    count, floats = 40, 16 * 1024  # 64 KiB of floats, and 12 bytes more
    sub = start_sub(daemon, "--window", "64")
    emitted(emit(daemon.endpoint, count, floats))
    assert received(sub) == expected(count, floats)
    final = sub.stop()
    assert final["ring_taps"] == count and final["failed"] == 0


class RawSubscriber:
    """A subscriber made of a bare ZeroMQ socket: it says hello (offering rings as the
    library does, with or without `batch`), and keeps every message it gets, decoded,
    acknowledging each."""

    def __init__(self, daemon: Daemon, *, batch_offer: bool) -> None:
        from tapd_client.shm import ring_directory, ring_offer

        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(daemon.endpoint)
        directory = ring_directory(daemon.endpoint, enabled=True)
        offer = wait_until(lambda: ring_offer(directory), "the daemon's ring directory")
        assert offer["batch"] is True
        if not batch_offer:
            del offer["batch"]  # what a subscriber of the version before ring_taps offers
        hello = {"role": "subscriber", "consumers": ["big"], "window": 64, "name": "raw",
                 "batch": True, "rings": offer}  # fmt: skip
        self.sock.send_multipart(encode("hello", hello))
        self.messages: list[Any] = []

    def receive(self, taps: int, *, ack: bool = True) -> None:
        """Take messages until `taps` taps came in all; acknowledge them if `ack`."""
        got = 0
        while got < taps:
            assert self.sock.poll(PROCESS_TIMEOUT * 1000), f"{got} of {taps} taps came"
            message = decode(self.sock.recv_multipart())
            if message.kind not in ("tap", "taps", "ring_tap", "ring_taps"):
                continue
            self.messages.append(message)
            got += len(self.tids(message))
        if ack:
            self.ack()

    @staticmethod
    def tids(message: Any) -> list[int]:
        rows = [row for run in (*message.runs, *message.spans) for row in run.rows]
        return [row[1] for row in rows] or [message.header["tid"]]

    def ack(self) -> None:
        upto = max(tid for message in self.messages for tid in self.tids(message))
        self.sock.send_multipart(encode("ack", {"upto": upto, "errors": []}))

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


@pytest.mark.parametrize("batch_offer", [True, False], ids=["ring_taps", "older_subscriber"])
def test_ring_taps_describe_many_taps_per_message(
    batch_offer: bool, start_daemon: Any, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """40 taps of 64 KiB written while the daemon is stopped (SIGSTOP), so that it finds
    them all at once: a subscriber that offers `batch` gets their descriptors in a few
    `ring_taps` messages, in order, which describe the bytes the emitter wrote; one that
    does not (a subscriber of the version before) gets their bytes, as it did."""
    if reason := native_unavailable():
        pytest.skip(reason)
    from tapd_client.shm import RingReader

    monkeypatch.setenv("TAPD_BACKEND", "native")
    daemon = start_daemon()
    raw = RawSubscriber(daemon, batch_offer=batch_offer)
    count, floats = 40, 16 * 1024
    full_env = {**os.environ, "TAPD_ENDPOINT": daemon.endpoint}
    emitter = subprocess.Popen(
        [sys.executable, str(HERE), "emit_when_told", str(count), str(floats)],
        env=full_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    reader = RingReader(rings_of(runtime_dir))
    try:
        raw.receive(1)  # the warm-up tap: the emitter's ring is known, its site read
        assert emitter.stdout is not None and emitter.stdin is not None
        assert json.loads(emitter.stdout.readline()) == {"ready": True}
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            emitter.stdin.write("go\n")
            emitter.stdin.flush()
            assert json.loads(emitter.stdout.readline()) == {"written": count}
        finally:
            daemon.process.send_signal(signal.SIGCONT)
        raw.receive(count, ack=False)  # (unacknowledged: the ring keeps them)
        messages = raw.messages[1:]
        if not batch_offer:  # (taps over 64 KiB: 64 KiB and less come batched, as bytes)
            assert [m.kind for m in messages] == ["ring_tap"] * count
            return
        assert {m.kind for m in messages} == {"ring_taps"}
        assert len(messages) < count / 4, [len(m.header["taps"]) for m in messages]
        rows = [row for m in messages for span in m.spans for row in span.rows]
        assert [row[2] for row in rows] == list(range(1, count + 1))  # seqs, in order
        want = expected(count + 1, floats)
        for message in messages:  # the bytes they name are the taps the emitter wrote
            for run in reader.read_spans(message.spans, views=False):
                assert not isinstance(run, Exception), run
                for i, value in enumerate(run.values()):
                    assert digest(value) == want[run.rows[i][2]]
        raw.ack()
        assert "stats" in json.loads(emitter.stdout.readline())  # its barrier returned
    finally:
        reader.close()
        raw.close()
        if emitter.poll() is None:
            emitter.kill()
        emitter.communicate()


def test_a_kept_value_does_not_change_when_the_ring_laps(
    start_daemon: Any, start_sub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the default a handler's value is its own copy: kept past its call, it does
    not change when later taps overwrite the ring. A view (views=True) kept past its call
    does: which shows that the ring did lap under the kept copy."""
    if reason := native_unavailable():
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", "native")
    daemon = start_daemon()
    count, floats = 40, 2**18  # 1 MiB taps through a 4 MiB ring: it laps ten times
    copying = start_sub(daemon, "--keep")
    viewing = start_sub(daemon, "--keep", "--views")
    emitted(emit(daemon.endpoint, count, floats, env={"TAPD_BUFFER_BYTES": str(4 * 2**20)}))
    want = expected(count, floats)
    assert received(copying) == want and received(viewing) == want
    kept_copy, kept_view = copying.stop(), viewing.stop()
    assert kept_copy["ring_taps"] == count and kept_view["ring_taps"] == count
    assert kept_copy["kept_changed"] is False
    assert kept_view["kept_changed"] is True  # the hazard views=True documents


# ---- where shared memory does not apply ---------------------------------------------------


@pytest.mark.parametrize("policy", ["drop_newest", "spool"])
def test_other_policies_keep_the_socket_path(
    policy: str,
    start_daemon: Any,
    start_sub: Any,
    runtime_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if reason := native_unavailable():
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", "native")
    flags = ["--policy", policy]
    if policy == "spool":
        flags += ["--spool-dir", str(runtime_dir / "spool")]
    daemon = start_daemon(*flags)
    count, floats = 12, KIB * 256
    sub = start_sub(daemon)
    emitted(emit(daemon.endpoint, count, floats))
    assert received(sub) == expected(count, floats)
    assert sub.stop()["ring_taps"] == 0


@pytest.mark.parametrize("how", ["tcp", "other_user", "worker_pool", "turned_off"])
def test_subscribers_it_does_not_apply_to_get_bytes(
    how: str, start_daemon: Any, start_sub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber over tcp (as a remote one is), one offering rings as another user, a
    worker pool's member, and a daemon with TAPD_SHM_SUBSCRIBERS=0: each gets the bytes."""
    if reason := native_unavailable():
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", "native")
    if how == "turned_off":
        monkeypatch.setenv("TAPD_SHM_SUBSCRIBERS", "0")  # (the daemon inherits it)
    daemon = start_daemon(*(["--tcp", "tcp://127.0.0.1:0", "--insecure"] if how == "tcp" else []))
    monkeypatch.delenv("TAPD_SHM_SUBSCRIBERS", raising=False)  # the subscriber would offer
    flags = {"other_user": ["--other-uid"], "worker_pool": ["--group", "pool"]}.get(how, [])
    endpoint = daemon.endpoints[-1] if how == "tcp" else None
    if how == "tcp":
        assert endpoint is not None and endpoint.startswith("tcp://")
    sub = start_sub(daemon, *flags, endpoint=endpoint)
    count, floats = 8, KIB * 256
    emitted(emit(daemon.endpoint, count, floats))
    assert received(sub) == expected(count, floats)
    assert sub.stop()["ring_taps"] == 0


def test_forwarded_taps_reach_the_upstream_s_subscribers_as_bytes(
    start_daemon: Any, start_sub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upstream daemon's taps come from a forwarding daemon, not from a ring: its
    subscriber (on this host, offering rings) gets bytes; the forwarder's own gets
    descriptors."""
    if reason := native_unavailable():
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", "native")
    upstream = start_daemon(name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    far, near = start_sub(upstream), start_sub(forwarder)
    count, floats = 8, KIB * 256
    emitted(emit(forwarder.endpoint, count, floats))
    want = expected(count, floats)
    assert received(far) == want and received(near) == want
    assert far.stop()["ring_taps"] == 0
    assert near.stop()["ring_taps"] == count


# ---- a subscriber that dies holding descriptors ---------------------------------------------


def test_a_killed_subscriber_s_descriptors_are_released(
    start_daemon: Any, start_sub: Any, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of a subscriber whose handler holds ring taps: its taps are counted lost
    as any dead subscriber's, their ring space goes back, and the emitter, blocked under
    `block` on a full ring, runs on to its end."""
    if reason := native_unavailable():
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", "native")
    daemon = start_daemon("--subscriber-timeout", "1")
    sub = start_sub(daemon, "--hold", str(runtime_dir / "never"), "--window", "64")
    count, floats = 16, 2**18  # 16 MiB of taps through a 4 MiB ring
    emitter = emit(daemon.endpoint, count, floats, env={"TAPD_BUFFER_BYTES": str(4 * 2**20)})
    wait_until(lambda: sub.taps(), "the subscriber to hold a ring tap")
    rings = daemon.stats()["rings"]
    wait_until(
        lambda: any(r["committed"] - r["released"] >= 3 * 2**20 for r in daemon.stats()["rings"]),
        f"the ring to fill behind the held taps ({rings})",
    )
    assert sub.taps()[0]["ring_taps"] >= 1  # it held descriptors, not bytes
    sub.process.kill()
    sub.process.wait(timeout=PROCESS_TIMEOUT)
    result = emitted(emitter)  # (it would block for ever if the ring stayed held)
    counters = daemon.counters()
    assert counters["deliveries_lost"] >= 1
    stats = result["stats"]
    # Once its only taker is gone the site is dormant: the taps after that are skipped.
    accounted = stats["delivered"] + stats["daemon_dropped"] + stats["unrouted"]
    assert accounted + stats["skipped"] == count, stats
    assert stats["daemon_dropped"] == counters["deliveries_lost"], (stats, counters)


# ---- what a subscriber maps ------------------------------------------------------------------


def test_a_daemon_cannot_make_a_subscriber_read_another_file(
    runtime_dir: Path, start_sub: Any
) -> None:
    """A fake daemon names a path, then a ring name that is not there, then positions
    outside the ring: each tap is refused, with its reason sent back in the ack, and no
    handler runs."""
    endpoint = f"ipc://{runtime_dir}/fake.sock"
    ring_dir = rings_of(runtime_dir)  # (the socket's directory names it, not the socket)
    ring_dir.mkdir(mode=0o700, exist_ok=True)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    try:
        sub = start_sub(None, endpoint=endpoint)
        assert router.poll(PROCESS_TIMEOUT * 1000)
        peer, *frames = router.recv_multipart()
        hello = decode(frames).header
        assert hello["rings"]["uid"] == os.getuid()  # it offers: the directory is there
        router.send_multipart([peer, *encode("welcome", {"window_bytes": 0, "daemon": "fake"})])
        header = {
            "kind": "ring_tap", "consumer": "big", "seq": 0, "step": None, "device": 0,
            "process": 0, "host": "h", "pid": 1, "time": 0, "transforms": [], "meta": {},
            "tree": ["*"], "leaves": [["float32", [4], 16]], "emitter": "h:1",
        }  # fmt: skip
        bad = [
            ("../../../etc/passwd", "not a ring file name"),
            ("passwd", "not a ring file name"),
            ("1-ab.ring/..", "not a ring file name"),
            ("123-abc.ring", "cannot open ring"),
        ]
        for tid, (name, _) in enumerate(bad):
            fields = {**header, "tid": tid, "seq": tid, "ring": name, "positions": [0]}
            router.send_multipart([peer, MAGIC, encode_header(fields)])
        errors: dict[int, str] = {}
        while len(errors) < len(bad):
            assert router.poll(PROCESS_TIMEOUT * 1000), f"no ack; errors so far {errors}"
            peer, *frames = router.recv_multipart()
            message = decode(frames)
            if message.kind == "ack":
                errors.update({e["tid"]: e["error"] for e in message.header["errors"]})
        for tid, (name, why) in enumerate(bad):
            assert why in errors[tid], (name, errors[tid])
        assert sub.taps() == []
        assert stop_process(sub.process) == 0
    finally:
        router.close(linger=0)
        context.term()


def test_a_daemon_s_bad_ring_taps_are_refused_tap_by_tap(runtime_dir: Path, start_sub: Any) -> None:
    """A fake daemon sends `ring_taps` that name a path, a ring that is not there, and
    positions no ring holds: every tap of each is acknowledged with its reason, and no
    handler runs."""
    from tapd.protocol.batch import RingPiece, encode_ring_batch

    endpoint = f"ipc://{runtime_dir}/fake.sock"
    rings_of(runtime_dir).mkdir(mode=0o700, exist_ok=True)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    static = {"consumer": "big", "process": 0, "host": "h", "pid": 1, "transforms": [],
              "meta": {}, "tree": ["*"], "leaves": [["float32", [4], 16]]}  # fmt: skip

    def batch(ring: str, first_tid: int) -> list[Any]:
        piece = RingPiece(static, ring, [0, 64], first_tid, "h:1", "s", [0, 1], [None] * 2,
                          [0, 0], [0, 0])  # fmt: skip
        return encode_ring_batch([piece])

    try:
        sub = start_sub(None, endpoint=endpoint)
        assert router.poll(PROCESS_TIMEOUT * 1000)
        peer, *frames = router.recv_multipart()
        assert decode(frames).header["rings"]["batch"] is True  # it reads ring_taps
        router.send_multipart([peer, *encode("welcome", {"window_bytes": 0, "daemon": "fake"})])
        path = batch("12-ab.ring", 0)
        header = msgpack.unpackb(path[1], raw=False)
        header["rings"] = ["../../x.ring"]  # (decode refuses it)
        router.send_multipart([peer, MAGIC, msgpack.packb(header, use_bin_type=True)])
        router.send_multipart([peer, *batch("123-abc.ring", 2)])
        why = {0: "not a ring file name", 1: "not a ring file name", 2: "cannot open ring",
               3: "cannot open ring"}  # fmt: skip
        errors: dict[int, str] = {}
        while len(errors) < len(why):
            assert router.poll(PROCESS_TIMEOUT * 1000), f"no ack; errors so far {errors}"
            peer, *frames = router.recv_multipart()
            message = decode(frames)
            if message.kind == "ack":
                errors.update({e["tid"]: e["error"] for e in message.header["errors"]})
        for tid, text in why.items():
            assert text in errors[tid], (tid, errors[tid])
        assert sub.taps() == []
        assert stop_process(sub.process) == 0
    finally:
        router.close(linger=0)
        context.term()


@pytest.fixture
def ring_with_one_tap(runtime_dir: Path) -> Iterator[tuple[Path, Any]]:
    """A real ring file `1-ab.ring` in a 0700 `rings` directory, holding one 16-byte tap
    (float32 0..3) at position 56: (the directory, the ring)."""
    if reason := native_unavailable():
        pytest.skip(reason)
    from tapd.native.ring import Ring

    directory = runtime_dir / "rings"
    directory.mkdir(mode=0o700)
    ring = Ring.create(directory / "1-ab.ring", 1 << 16)
    try:
        ring.write(1, np.arange(4, dtype=np.float32).tobytes())
        yield directory, ring
    finally:
        ring.close()


ONE_TAP = {
    "consumer": "big", "seq": 0, "tree": ["*"], "leaves": [["float32", [4], 16]],
    "ring": "1-ab.ring",
}  # fmt: skip


@pytest.mark.fast
def test_positions_outside_the_ring_are_refused(ring_with_one_tap: tuple[Path, Any]) -> None:
    """A real ring file, and a descriptor naming bytes it has not committed: refused,
    naming the ring's readable span (the subscriber's reader, in process)."""
    from tapd_client.shm import RingReader, RingReadError

    directory, ring = ring_with_one_tap
    reader = RingReader(directory)
    tap, intact = reader.read({**ONE_TAP, "positions": [56]}, views=False)
    assert tap.value().tolist() == [0.0, 1.0, 2.0, 3.0]
    intact()
    with pytest.raises(RingReadError, match=r"outside its unreleased records \[0, 72\)"):
        reader.read({**ONE_TAP, "positions": [72]}, views=False)
    ring.release(72)  # delivered: a later tap may be written there
    with pytest.raises(RingReadError, match="outside its unreleased records"):
        reader.read({**ONE_TAP, "positions": [56]}, views=False)
    reader.close()


def one_tap_batch(position: int, ring: str = "1-ab.ring") -> Any:
    """A decoded `ring_taps` naming the fixture's tap (float32 0..3) at `position`."""
    from tapd.protocol.batch import RingPiece, encode_ring_batch

    static = {"consumer": "big", "process": 0, "host": "h", "pid": 1, "transforms": [],
              "meta": {}, "tree": ["*"], "leaves": [["float32", [4], 16]]}  # fmt: skip
    piece = RingPiece(static, ring, [position], 7, "h:1", "site", [0], [None], [0], [0])
    return decode(encode_ring_batch([piece]))


@pytest.mark.fast
@pytest.mark.parametrize("views", [False, True], ids=["copies", "views"])
def test_ring_taps_spans_are_read_as_ring_taps_are(
    views: bool, ring_with_one_tap: tuple[Path, Any]
) -> None:
    """A `ring_taps` span inside the ring's unreleased records is read; one outside, or
    one whose space was released, is refused, naming why (the subscriber's reader, in
    process)."""
    from tapd_client.shm import RingReader, RingReadError

    directory, ring = ring_with_one_tap
    reader = RingReader(directory)
    message = one_tap_batch(56)
    [run] = reader.read_spans(message.spans, views=views)
    assert not isinstance(run, RingReadError), run
    assert [v.tolist() for v in run.values()] == [[0.0, 1.0, 2.0, 3.0]]
    assert run.header(0)["tid"] == 7 and run.header(0)["emitter"] == "h:1"
    assert not reader.torn(message.spans[0])
    [outside] = reader.read_spans(one_tap_batch(72).spans, views=views)
    assert isinstance(outside, RingReadError)
    assert "outside its unreleased records [0, 72)" in str(outside)
    [missing] = reader.read_spans(one_tap_batch(56, "2-ab.ring").spans, views=views)
    assert isinstance(missing, RingReadError) and "cannot open ring" in str(missing)
    ring.release(72)  # delivered: a later tap may be written there
    assert reader.torn(message.spans[0])  # (what a view read before is no longer sure)
    [released] = reader.read_spans(message.spans, views=views)
    assert isinstance(released, RingReadError)
    del run
    reader.close()


@pytest.mark.fast
def test_a_removed_ring_is_unmapped(ring_with_one_tap: tuple[Path, Any]) -> None:
    """Once the daemon removed a finished emitter's ring, the subscriber unmaps it (its
    shared memory is freed only then)."""
    from tapd_client.shm import RingReader

    directory, _ = ring_with_one_tap
    reader = RingReader(directory)
    reader.read({**ONE_TAP, "positions": [56]}, views=False)
    reader.forget_unlinked()
    assert list(reader._maps) == ["1-ab.ring"]  # still there: still mapped
    (directory / "1-ab.ring").unlink()
    reader.forget_unlinked()
    assert list(reader._maps) == []


def test_the_client_reads_rings_without_jax_or_the_native_library() -> None:
    code = (
        "import sys\n"
        "sys.modules['jax'] = None\n"
        "import tapd_client, tapd_client.shm\n"
        "assert 'tapd.native.library' not in sys.modules, 'loaded the native library'\n"
        "assert 'tapd.native.ring' not in sys.modules, 'imported the native ring'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.fast
def test_the_offsets_subscribers_read_are_ring_h_s() -> None:
    sys.path.insert(0, str(HERE.parent))
    from test_ring_format import layout

    control = layout("RingControl")
    assert control["tail"][0] == ring_format.TAIL_OFFSET
    assert control["committed"][0] == ring_format.COMMITTED_OFFSET


if __name__ == "__main__":
    mains = {"sub": subscriber_main, "emit": emitter_main, "emit_when_told": emitter_when_told_main}
    mains[sys.argv[1]](sys.argv[2:])
    sys.exit(0)
