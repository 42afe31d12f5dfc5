"""Hostile input to a real daemon (issue 10): messages that used to kill it, paths and
names a peer sends, taps that subscribers would refuse. Each is rejected and counted by
reason, the daemon serves on, and a normal tap still arrives afterwards."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from conftest import Daemon, native_unavailable, rings_of, wait_until
from tapd.errors import ProtocolError, TapDefinitionError
from tapd.protocol import MAGIC, decode, encode, flatten
from tapd_client import Subscriber, TapMeta

TAP_FIELDS: dict[str, Any] = {
    "consumer": "probe", "seq": 0, "step": None, "device": None, "process": 0, "host": "h",
    "pid": 1, "time": 0, "transforms": [], "meta": {}, "tree": ["*"],
}  # fmt: skip


def raw(header: dict[str, Any], *frames: bytes) -> list[bytes]:
    return [MAGIC, msgpack.packb(header, use_bin_type=True), *frames]


class Probe:
    """An in-process subscriber of "probe", running in a thread: proves that a normal
    tap still gets through."""

    def __init__(self, endpoint: str) -> None:
        self.seen: list[float] = []
        self.subscriber = Subscriber(endpoint, heartbeat=0.2)

        def handle(arg: Any, meta: TapMeta) -> None:
            self.seen.append(float(arg[0]))

        self.subscriber.add_handler("probe", handle)
        self.subscriber.connect(timeout=10)
        self.thread = threading.Thread(target=self.subscriber.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.subscriber.stop()
        self.thread.join(timeout=10)
        self.subscriber.close()


@pytest.fixture
def probe() -> Iterator[Callable[[str], Probe]]:
    made: list[Probe] = []

    def make(endpoint: str) -> Probe:
        made.append(Probe(endpoint))
        return made[-1]

    yield make
    for one in made:
        one.close()


def a_normal_tap_arrives(
    daemon: Daemon, raw_peer: Callable[[str], zmq.Socket[bytes]], probe: Probe, value: float
) -> None:
    emitter = raw_peer(daemon.endpoint)
    emitter.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1,
                                            "process": 0}))  # fmt: skip
    emitter.send_multipart(encode("tap", TAP_FIELDS, [np.array([value], np.float32)]))
    wait_until(lambda: value in probe.seen, f"the normal tap {value} to arrive")
    assert daemon.process.poll() is None


def alive_for(daemon: Daemon, seconds: float) -> None:
    """The daemon still answers after `seconds` (it checks emitters' pids every 0.5 s)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert daemon.process.poll() is None, f"the daemon died:\n{daemon.log()[-3000:]}"
        daemon.stats()
        time.sleep(0.1)


# ---- defects 1-3: a single message killed the daemon ---------------------------------------


@pytest.mark.fast
@pytest.mark.parametrize(
    "tree",
    [
        ["nt", "Point", [[1], "y"], [["*"], ["n"]]],
        ["k", "Node", [{"a": 1}, "b"], [["*"], ["n"]]],
        ["d", [[1, 2]], [["*"]]],
    ],
    ids=["namedtuple_list_key", "custom_node_map_key", "dict_list_key"],
)
def test_tree_keys_that_are_lists_or_maps_are_refused(tree: list[Any]) -> None:
    frames = raw({**TAP_FIELDS, "kind": "tap", "tree": tree, "leaves": [["float32", [1], 4]]},
                 bytes(4))  # fmt: skip
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    assert info.value.reason == "bad_tree"


def test_the_three_crashers_are_rejected_counted_and_the_daemon_serves_on(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    probe: Callable[[str], Probe],
) -> None:
    daemon = start_daemon()
    watcher = probe(daemon.endpoint)
    import socket

    sock = raw_peer(daemon.endpoint)
    # 1. a tree node with a list among its keys
    tree = ["nt", "P", [[1], "y"], [["*"], ["n"]]]
    sock.send_multipart(raw({**TAP_FIELDS, "kind": "tap", "leaves": [["float32", [1], 4]],
                             "tree": tree}, bytes(4)))  # fmt: skip
    # 2. an emitter of this host whose pid os.kill cannot take
    hostile = raw_peer(daemon.endpoint)
    hostile.send_multipart(encode("hello", {"role": "emitter", "host": socket.gethostname(),
                                            "pid": 2**40, "process": 0}))  # fmt: skip
    # 3. an empty ring path
    empty = raw_peer(daemon.endpoint)
    empty.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1,
                                          "process": 0, "ring": "", "sites": "x"}))  # fmt: skip
    wait_until(lambda: daemon.counters().get("rejected_bad_tree") == 1
               and daemon.counters().get("rejected_bad_field") == 2,
               "three rejections")  # fmt: skip
    alive_for(daemon, 1.2)  # past the daemon's pid check
    a_normal_tap_arrives(daemon, raw_peer, watcher, 1.0)


# ---- defect 5: the sites path of a hello ------------------------------------------------------


def make_dead_ring(directory: Path, records: int = 1) -> Path:
    """A ring in `directory` written by a process that has exited, holding `records`
    records of site 0."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    script = (
        "import sys, os, secrets\n"
        "from pathlib import Path\n"
        "from tapd.native.ring import Ring\n"
        "path = Path(sys.argv[1]) / f'{os.getpid()}-{secrets.token_hex(4)}.ring'\n"
        "ring = Ring.create(path, 1 << 16)\n"
        "for i in range(int(sys.argv[2])): ring.write(0, bytes(8))\n"
        "print(path)\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(directory), str(records)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


needs_native = pytest.mark.skipif(
    native_unavailable() is not None, reason=str(native_unavailable())
)


@needs_native
def test_a_sites_path_outside_the_ring_dir_is_refused_and_never_deleted(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    runtime_dir: Path,
    tmp_path: Path,
) -> None:
    daemon = start_daemon()
    ring = make_dead_ring(rings_of(runtime_dir), records=0)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    sock = raw_peer(daemon.endpoint)
    for sites in (str(victim), "/dev/zero", str(ring.with_suffix(".other"))):
        sock.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1,
                                             "process": 0, "ring": str(ring),
                                             "sites": sites}))  # fmt: skip
    wait_until(lambda: daemon.counters().get("rejected_bad_field", 0) >= 3
               or not victim.exists(), "the hellos to be refused")  # fmt: skip
    alive_for(daemon, 1.2)
    assert victim.read_text() == "precious"
    assert daemon.stats()["rings"] == []


@needs_native
def test_a_sites_file_that_is_a_link_or_endless_is_refused_with_bounded_memory(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    runtime_dir: Path,
) -> None:
    daemon = start_daemon()
    for target in ("/dev/zero", None):
        ring = make_dead_ring(rings_of(runtime_dir), records=1)
        sites = ring.with_suffix(".sites")
        if target is None:  # a regular file, larger than any sites file may be
            with open(sites, "wb") as big:
                big.truncate(65 << 20)
        else:
            sites.symlink_to(target)
        sock = raw_peer(daemon.endpoint)
        sock.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1,
                                             "process": 0, "ring": str(ring)}))  # fmt: skip
    wait_until(lambda: daemon.counters().get("rejected_bad_ring", 0) >= 2,
               "both sites files to be refused", timeout=15)  # fmt: skip
    alive_for(daemon, 1.0)
    rss_kib = int(Path(f"/proc/{daemon.process.pid}/status").read_text()
                  .split("VmRSS:")[1].split()[0])  # fmt: skip
    assert rss_kib < 400_000, f"the daemon's RSS is {rss_kib} KiB"


# ---- defect 6: names are bounded and logged escaped ------------------------------------------


def test_peer_names_are_bounded_and_logged_escaped(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    probe: Callable[[str], Probe],
) -> None:
    daemon = start_daemon()
    forged = "x\n2099-01-01 00:00:00,000 tapd.daemon WARNING forged line"
    sock = raw_peer(daemon.endpoint)
    sock.send_multipart(encode("hello", {"role": "subscriber", "consumers": [forged],
                                         "window": 1, "name": forged}))  # fmt: skip
    huge = "n" * 100_000
    for _ in range(50):
        raw_peer(daemon.endpoint).send_multipart(
            encode("hello", {"role": "subscriber", "consumers": ["a"], "window": 1, "name": huge})
        )
        raw_peer(daemon.endpoint).send_multipart(
            encode("hello", {"role": "subscriber", "consumers": [huge], "window": 1})
        )
        raw_peer(daemon.endpoint).send_multipart(
            encode("hello", {"role": "emitter", "host": huge, "pid": 5, "process": 0})
        )
    wait_until(lambda: daemon.counters().get("rejected_too_large") == 150, "150 rejections")
    a_normal_tap_arrives(daemon, raw_peer, probe(daemon.endpoint), 2.0)
    log = daemon.log()
    assert not any(line.startswith("2099-01-01") for line in log.splitlines())
    assert "\\n2099-01-01" in log  # logged, escaped
    assert len(log) < 20_000, f"the log grew to {len(log)} bytes"


# ---- defect 8: static metadata too large --------------------------------------------------------


@pytest.mark.fast
def test_static_fields_too_large_are_refused_naming_the_limit() -> None:
    from tapd.protocol.schema import check_static_size, max_static_bytes

    check_static_size("small", {"tree": ["*"], "meta": {"a": "b"}, "transforms": []})
    with pytest.raises(TapDefinitionError, match=str(max_static_bytes())):
        check_static_size("big", {"tree": ["*"], "meta": {"blob": "x" * 2_000_000}})


def test_a_tap_the_daemon_rejects_is_reported_to_its_emitter_and_credited(
    start_daemon: Callable[..., Daemon], raw_peer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    daemon = start_daemon()
    sock = raw_peer(daemon.endpoint)
    sock.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1, "process": 0}))
    big = encode("tap", {**TAP_FIELDS, "meta": {"blob": "x" * 2_000_000}},
                 [np.zeros(4, np.float32)])  # fmt: skip
    sock.send_multipart(big)
    sock.send_multipart(encode("barrier", {"id": 7}))
    replies: list[dict[str, Any]] = []
    while not {"barrier_done", "credit"} <= {r["kind"] for r in replies}:
        assert sock.poll(10_000), f"no barrier_done and credit; got {replies}"
        replies.append(decode(sock.recv_multipart()).header)
    kinds = [r["kind"] for r in replies]
    assert "error" in kinds, replies
    error = next(r for r in replies if r["kind"] == "error")
    assert "too_large" in error["error"] and str(1 << 20) in error["error"]
    credited = sum(r["bytes"] for r in replies if r["kind"] == "credit")
    assert credited == 16  # the rejected tap's array bytes: the window does not shrink
    assert daemon.counters()["rejected_too_large"] == 1


# ---- defect 12: a dict with a tuple key ----------------------------------------------------------


@pytest.mark.fast
def test_a_dict_with_a_tuple_key_is_a_tap_definition_error() -> None:
    with pytest.raises(TapDefinitionError, match=r"\(1, 2\)"):
        flatten({(1, 2): np.zeros(1)})


@pytest.mark.fast
def test_a_tap_of_a_dict_with_a_tuple_key_fails_at_trace_time() -> None:
    jax = pytest.importorskip("jax")
    import tapd

    with pytest.raises(TapDefinitionError, match="cannot be tapped"):
        jax.jit(lambda x: tapd.tap({(1, 2): x}, "tuple_key"))(np.zeros(2))


@pytest.mark.fast
def test_a_tap_whose_metadata_is_too_large_fails_at_trace_time_naming_the_limit() -> None:
    jax = pytest.importorskip("jax")
    import tapd

    with pytest.raises(TapDefinitionError, match="at most 1032192 bytes"):
        jax.jit(lambda x: tapd.tap(x, "big_meta", blob="x" * 2_000_000))(np.zeros(2))


# ---- issue 21: what an upstream tells a forwarder (`wants`) --------------------------------


def test_hostile_wants_from_an_upstream_are_refused_and_counted_and_the_forwarder_serves_on(
    start_daemon: Callable[..., Daemon], runtime_dir: Path
) -> None:
    """A fake upstream welcomes a real forwarding daemon, then sends it `wants` messages
    that break the protocol: each is refused by reason and counted, none changes what
    the forwarder takes; a valid one afterwards is applied."""
    context = zmq.Context()
    upstream = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{runtime_dir}/fake-up.sock"
    upstream.bind(endpoint)
    try:
        daemon = start_daemon("--forward", endpoint, name="fwd.sock")
        assert upstream.poll(10_000), "no hello from the forwarder"
        peer, *frames = upstream.recv_multipart()
        assert decode(frames).header["role"] == "emitter"
        welcome = {"window_bytes": 1 << 20, "daemon": "fake-up"}
        upstream.send_multipart([peer, *encode("welcome", welcome)])
        wait_until(lambda: daemon.stats()["forward"]["upstream"] == "fake-up", "the welcome")
        too_many = [[f"p{i}", 1] for i in range(2000)]
        hostile = [
            {"kind": "wants", "patterns": [["acts", 0]]},
            {"kind": "wants", "patterns": [["acts", 2**32 - 1]]},
            {"kind": "wants", "patterns": [["", 1]]},
            {"kind": "wants", "patterns": "acts"},
            {"kind": "wants", "patterns": [["acts", 1, 1]]},
            {"kind": "wants"},
            {"kind": "wants", "patterns": too_many},
        ]
        for header in hostile:
            upstream.send_multipart([peer, *raw(header)])
        wait_until(
            lambda: (
                daemon.counters().get("rejected_bad_field") == 6
                and daemon.counters().get("rejected_too_large") == 1
            ),
            "seven refusals",
        )
        assert daemon.stats()["forward"]["upstream_wants"] == "everything"
        upstream.send_multipart([peer, *encode("wants", {"patterns": [["acts", 4]]})])
        wait_until(
            lambda: daemon.stats()["forward"]["upstream_wants"] == [["acts", 4]],
            "the valid wants to be applied",
        )
        assert daemon.process.poll() is None
    finally:
        upstream.close(linger=0)
        context.term()
