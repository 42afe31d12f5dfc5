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
    assert sub.taps()[0]["ring_taps"] == 1  # it held a descriptor, not bytes
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


def test_the_offsets_subscribers_read_are_ring_h_s() -> None:
    sys.path.insert(0, str(HERE.parent))
    from test_ring_format import layout

    control = layout("RingControl")
    assert control["tail"][0] == ring_format.TAIL_OFFSET
    assert control["committed"][0] == ring_format.COMMITTED_OFFSET


if __name__ == "__main__":
    {"sub": subscriber_main, "emit": emitter_main}[sys.argv[1]](sys.argv[2:])
    sys.exit(0)
