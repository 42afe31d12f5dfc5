"""Property-based fuzzing of a live daemon (issue 10): structured and mutated messages
of every kind a daemon accepts (emitter and subscriber hellos, taps, batches, credits,
acks, barriers, heartbeats, byes, control requests), and rings with mutated sites files
and records. The daemon must stay up, count each rejection by its reason (the same one
`tapd.protocol.decode` gives here), hand every ring record on or refuse it, and still
deliver a normal tap afterwards. Bounded for CI: a few hundred messages, a few rings."""

from __future__ import annotations

import collections
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_input import Probe, a_normal_tap_arrives

from conftest import Daemon, native_unavailable, rings_of, wait_until
from tapd.errors import ProtocolError
from tapd.protocol import MAGIC, decode, encode
from tapd.protocol.batch import BatchTap, encode_batch

FUZZ = settings(
    max_examples=int(os.environ.get("TAPD_FUZZ_EXAMPLES", "300")),
    deadline=None,
    database=None,
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=list(HealthCheck),
)
# Kinds a daemon answers as "not something peers send to a daemon".
NOT_FOR_DAEMONS = {
    "welcome", "rehello", "credit", "error", "barrier_done", "stats_reply", "taps", "wants"
}  # fmt: skip

# ---- values and messages ---------------------------------------------------------------

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=12) | st.binary(max_size=12)
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# (this host's name: an emitter "here" has its pid checked with os.kill)
names = st.text(max_size=16) | st.sampled_from(
    ["", "x" * 300, "a\nb", "*", "loss", "probe", socket.gethostname()]
)
small_ints = st.integers(-5, 2**31 + 5) | st.sampled_from([2**40, 2**63 - 1, -(2**63)])


# Tree specs with every node kind, and keys of any type (lists and maps among them).
tree_keys = (
    st.text(max_size=3) | st.integers(-1, 3) | st.lists(st.integers(0, 2), max_size=1)
    | st.dictionaries(st.text(max_size=2), st.integers(0, 2), max_size=1)
)  # fmt: skip


def _node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    def keyed(kids: list[Any]) -> st.SearchStrategy[Any]:
        keys = st.lists(tree_keys, min_size=len(kids), max_size=len(kids))
        return st.tuples(st.sampled_from(["d", "nt", "k"]), st.text(max_size=3), keys).map(
            lambda t: [t[0], t[2], kids] if t[0] == "d" else [t[0], t[1], t[2], kids]
        )

    return st.lists(children, max_size=2).map(lambda kids: ["t", kids]) | st.lists(
        children, min_size=1, max_size=2
    ).flatmap(keyed)


trees = st.recursive(st.sampled_from([["*"], ["n"]]), _node, max_leaves=4)


def tap_fields(draw: st.DrawFn) -> dict[str, Any]:
    tree = draw(trees)
    return {"consumer": draw(names), "seq": draw(small_ints), "step": draw(st.none() | small_ints),
            "device": draw(st.none() | small_ints), "process": draw(small_ints),
            "host": draw(names), "pid": draw(small_ints), "time": draw(small_ints),
            "transforms": draw(st.sampled_from([[], [["batch", {"batch_dims": [0]}]], [1]])),
            "meta": draw(st.dictionaries(st.text(max_size=4), scalars, max_size=3)),
            "tree": tree}  # fmt: skip


# What the generator draws from: the kinds with the most fields, more often.
KINDS = ["hello_emitter"] * 3 + ["hello_subscriber"] * 2 + ["tap"] * 3 + ["taps"] * 2 + [
    "credit", "ack", "ack", "barrier", "heartbeat", "bye", "stats", "welcome", "wants"]  # fmt: skip
# `every` pairs (a subscriber's sampling, a forwarder's wants), near their valid ones.
every_pairs = st.lists(
    st.tuples(names, st.integers(-1, 3) | st.sampled_from([2**32 - 2, 2**32 - 1, 2**64 - 1])).map(
        list
    )
    | values,
    max_size=3,
)


@st.composite
def structured(draw: st.DrawFn) -> list[bytes]:
    """A message of a kind the daemon accepts, its fields drawn near their valid ones."""
    kind = draw(st.sampled_from(KINDS))
    arrays = [np.arange(draw(st.integers(0, 4)), dtype=np.float32)]
    if kind == "hello_emitter":
        fields: dict[str, Any] = {"role": "emitter", "host": draw(names), "pid": draw(small_ints),
                                  "process": draw(small_ints)}  # fmt: skip
        if draw(st.booleans()):
            stem = draw(st.sampled_from(["/nowhere/1-ab", "", "/nowhere/x", "1-ab"]))
            fields["ring"] = draw(st.sampled_from([f"{stem}.ring", ""]))
            fields["sites"] = draw(st.sampled_from([f"{stem}.sites", "/dev/zero", "/etc/passwd"]))
        kind = "hello"
    elif kind == "hello_subscriber":
        fields = {"role": "subscriber", "consumers": draw(st.lists(names, max_size=3)),
                  "window": draw(small_ints), "name": draw(names),
                  "batch": draw(st.booleans())}  # fmt: skip
        if draw(st.booleans()):
            fields["every"] = draw(every_pairs)
        kind = "hello"
    elif kind in ("tap", "taps"):
        fields = tap_fields(draw)
    elif kind == "credit":
        fields = {"bytes": draw(small_ints)}
    elif kind == "ack":
        fields = {
            "upto": draw(small_ints),
            "errors": draw(
                st.lists(
                    st.fixed_dictionaries({"tid": small_ints, "error": names}) | values, max_size=3
                )
            ),
        }
    elif kind == "barrier":
        fields = {"id": draw(small_ints), "ring_position": draw(small_ints)}
    elif kind == "welcome":
        fields = {"window_bytes": 1, "daemon": "d"}
    elif kind == "wants":
        fields = {"patterns": draw(every_pairs), "everything": draw(st.booleans())}
    else:
        fields = {}
    mutation = draw(st.sampled_from(["none", "drop", "replace", "extra"]))
    if fields and mutation == "drop":
        fields.pop(draw(st.sampled_from(sorted(fields))))
    elif fields and mutation == "replace":
        fields[draw(st.sampled_from(sorted(fields)))] = draw(values)
    elif mutation == "extra":
        fields[draw(st.text(max_size=6))] = draw(values)
    header = {**fields, "kind": kind}
    if kind == "tap":
        frames = [bytes(memoryview(a).cast("B")) for a in arrays]
        header["leaves"] = [["float32", [a.size], a.nbytes] for a in arrays]
        return [MAGIC, msgpack.packb(header, use_bin_type=True), *frames]
    if kind == "taps":
        try:
            tap = decode(encode("tap", {**fields}, arrays))
        except (ProtocolError, ValueError, TypeError, OverflowError):
            return [MAGIC, msgpack.packb(header, use_bin_type=True), b""]
        return [bytes(f) for f in encode_batch([BatchTap(tap.header, tap.frames, 0, "h:1")])]
    return [MAGIC, msgpack.packb(header, use_bin_type=True)]


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    """A structured message, then its bytes mutated: flipped, cut, frames added or lost."""
    frames = [bytearray(f) for f in draw(structured())]
    for _ in range(draw(st.integers(1, 3))):
        index = draw(st.integers(0, len(frames) - 1))
        frame = frames[index]
        action = draw(st.sampled_from(["flip", "cut", "add_frame", "drop_frame", "grow"]))
        if action == "flip" and frame:
            position = draw(st.integers(0, len(frame) - 1))
            frame[position] ^= draw(st.integers(1, 255))
        elif action == "cut" and frame:
            del frame[draw(st.integers(0, len(frame) - 1)) :]
        elif action == "add_frame":
            frames.append(bytearray(draw(st.binary(max_size=16))))
        elif action == "drop_frame" and len(frames) > 1:
            frames.pop(index)
        elif action == "grow":
            frame += draw(st.binary(min_size=1, max_size=32))
    return [bytes(f) for f in frames]


def expected_reason(frames: list[bytes]) -> str | None:
    """What the daemon must count for `frames`: decode's reason, or its own refusals of
    well-formed messages (kinds it does not take; a ring outside its ring directory)."""
    try:
        message = decode(frames)
    except ProtocolError as exc:
        return exc.reason
    if message.kind in NOT_FOR_DAEMONS:
        return "bad_header"
    if message.kind == "hello" and "ring" in message.header:
        return "bad_field"  # (the fuzzed rings are never in the daemon's ring directory)
    return None


# ---- the tests ---------------------------------------------------------------------------


def rejections(daemon: Daemon) -> dict[str, int]:
    counters = daemon.counters()
    return {
        k.removeprefix("rejected_"): v for k, v in counters.items() if k.startswith("rejected_")
    }


def test_fuzzed_messages_are_counted_by_reason_and_the_daemon_serves_on(
    start_daemon: Callable[..., Daemon], raw_peer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    daemon = start_daemon("--policy", "drop_newest", "--subscriber-timeout", "1")
    peers = [raw_peer(daemon.endpoint) for _ in range(6)]
    expected: collections.Counter[str] = collections.Counter()
    sent = 0

    @FUZZ
    @given(frames=structured() | mutated(), peer=st.integers(0, len(peers) - 1))
    def send(frames: list[bytes], peer: int) -> None:
        nonlocal sent
        if any(len(f) >= 5 and f[:5] == MAGIC and b"shutdown" in f for f in frames[1:2]):
            return  # (a well-formed shutdown would end the test, as it should)
        reason = expected_reason(frames)
        if reason is not None:
            expected[reason] += 1
        peers[peer].send_multipart(frames)
        sent += 1
        if sent % 50 == 0:  # alive all along, not only at the end
            assert daemon.process.poll() is None, daemon.log()[-3000:]

    started = time.monotonic()
    send()
    wait_until(lambda: rejections(daemon) == dict(expected),
               f"the daemon to count {dict(expected)}")  # fmt: skip
    assert "internal_error" not in rejections(daemon)
    assert daemon.process.poll() is None
    wait_until(lambda: daemon.subscriber_count() == 0, "the fuzzed subscribers to time out")
    probe = Probe(daemon.endpoint)
    try:
        a_normal_tap_arrives(daemon, raw_peer, probe, 3.0)
    finally:
        probe.close()
    assert sum(expected.values()) > sent // 4, (sent, expected)  # the fuzz did reach the checks
    assert time.monotonic() - started < 120


RING_WRITER = """
import os, secrets, struct, sys
from pathlib import Path
from tapd.native.ring import Ring
directory, sites_hex, records = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
stem = directory / f"{os.getpid()}-{secrets.token_hex(4)}"
stem.with_suffix(".sites").write_bytes(bytes.fromhex(sites_hex))
ring = Ring.create(stem.with_suffix(".ring"), 1 << 16)
for item in records.split(",") if records else []:
    site, size = item.split(":")
    ring.write(int(site), bytes(int(size)))
print(stem.with_suffix(".ring"))
"""


def site_entry(site: int, leaves: Any, consumer: Any = "ring", **extra: Any) -> bytes:
    entry = {"site": site, "consumer": consumer, "consumer_id": 0, "tree": ["*"], "meta": {},
             "transforms": [], "leaves": leaves, **extra}  # fmt: skip
    packed = msgpack.packb(entry, use_bin_type=True)
    return struct.pack("<I", len(packed)) + packed


@st.composite
def sites_files(draw: st.DrawFn) -> bytes:
    """A sites file: good entries, entries with mutated fields, junk and bad lengths."""
    parts = []
    for site in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["good", "bad_leaves", "bad_consumer", "junk", "mutated"]))
        if kind == "good":
            parts.append(site_entry(site, [["float32", [2], 8]]))
        elif kind == "bad_leaves":
            parts.append(site_entry(site, draw(values)))
        elif kind == "bad_consumer":
            parts.append(site_entry(site, [["float32", [2], 8]], consumer=draw(values)))
        elif kind == "junk":
            parts.append(struct.pack("<I", 6) + draw(st.binary(min_size=6, max_size=6)))
        else:
            good = bytearray(site_entry(site, [["float32", [2], 8]]))
            good[draw(st.integers(0, len(good) - 1))] ^= draw(st.integers(1, 255))
            parts.append(bytes(good))
    if draw(st.booleans()):
        parts.append(struct.pack("<I", draw(st.integers(0, 2**32 - 1))))  # a length, cut off
    return b"".join(parts)


@pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))
def test_fuzzed_sites_files_and_ring_records_are_handed_on_or_refused(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    runtime_dir: Path,
) -> None:
    daemon = start_daemon("--policy", "drop_newest")
    directory = rings_of(runtime_dir)
    written = 0

    @settings(FUZZ, max_examples=int(os.environ.get("TAPD_FUZZ_RINGS", "12")))
    @given(
        sites=sites_files(),
        records=st.lists(
            st.tuples(st.integers(0, 4), st.sampled_from([0, 3, 8, 16, 100])), max_size=4
        ),
    )
    def ring(sites: bytes, records: list[tuple[int, int]]) -> None:
        nonlocal written
        spec = ",".join(f"{s}:{n}" for s, n in records)
        out = subprocess.run([sys.executable, "-c", RING_WRITER, str(directory), sites.hex(),
                              spec], capture_output=True, text=True, check=True)  # fmt: skip
        path = out.stdout.strip()
        raw_peer(daemon.endpoint).send_multipart(
            encode(
                "hello", {"role": "emitter", "host": "fuzz", "pid": 1, "process": 0, "ring": path}
            )
        )
        written += len(records)
        wait_until(lambda: not Path(path).exists(), f"ring {path} to be finished and removed")
        assert daemon.process.poll() is None, daemon.log()[-3000:]

    ring()
    counters = daemon.counters()
    assert counters.get("taps_received", 0) + counters.get("taps_refused", 0) == written, counters
    assert "rejected_internal_error" not in counters
