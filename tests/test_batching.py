"""Small taps reach subscribers in `taps` batches, large ones and old subscribers' alone.

A raw ZeroMQ subscriber (no tapd_client) talks to a real daemon fed by a real JAX
emitter, so the messages on the wire are what is checked.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import zmq

from conftest import BackgroundEmitter, Daemon, InProcessRouter, MakeRouter, native_unavailable
from tapd.daemon.runs import TapRun
from tapd.native.ring import Record, Records
from tapd.native.sites import Site
from tapd.protocol import Message, decode, encode
from tapd.protocol.batch import BatchTap, encode_batch
from tapd.protocol.rules import DEFAULT_LIMITS
from tapd_client import Subscriber
from tapd_client.daemon_link import DaemonLink

TAP_FIELDS = {"consumer": "loss", "seq": 0, "step": None, "device": None, "process": 0,
              "host": "h", "pid": 1, "time": 0, "meta": {}, "tree": ["*"]}  # fmt: skip

TAPS = 200


def receive_while(sock: zmq.Socket[bytes], emitter: threading.Thread) -> list[Any]:
    """Every message until the emitter is done and the socket has gone quiet; acks taps
    as a subscriber must (the emitter's barrier waits for them)."""
    messages = []
    while emitter.is_alive() or sock.poll(500):
        if not sock.poll(100):
            continue
        message = decode(sock.recv_multipart())
        messages.append(message)
        taps = message.batch if message.kind == "taps" else [message]
        if taps and message.kind in ("tap", "taps"):
            upto = max(t.header["tid"] for t in taps)
            sock.send_multipart(encode("ack", {"upto": upto, "errors": []}))
    return messages


@pytest.mark.parametrize(
    ("batch", "columns"),
    [(True, False), (True, True), (False, False)],
    ids=["batching", "columnar-runs", "old-subscriber"],
)
def test_small_taps_are_batched_only_for_subscribers_that_said_so(
    start_daemon: Callable[..., Daemon],
    raw_peer: Callable[[str], zmq.Socket[bytes]],
    batch: bool,
    columns: bool,
) -> None:
    """Rows to a subscriber that batches, columnar runs (the ring's runs) to one that
    also says `columns`, `tap` messages to one that says neither: the same taps, in
    order, whatever the form."""
    daemon = start_daemon()
    sock = raw_peer(daemon.endpoint)
    hello = {"role": "subscriber", "consumers": ["loss"], "window": 64, "name": "raw"}
    if batch:
        hello.update(batch=True, columns=columns)
    sock.send_multipart(encode("hello", hello))
    assert decode(sock.recv_multipart()).kind == "welcome"

    emitter = BackgroundEmitter(daemon.endpoint, "steps", str(TAPS))
    messages = receive_while(sock, emitter)
    assert emitter.outcome()["stats"]["delivered"] == TAPS
    taps = [t for m in messages for t in (m.batch if m.kind == "taps" else [m])]
    assert [(t.header["seq"], float(t.value())) for t in taps] == [
        (i, float(i)) for i in range(TAPS)
    ]
    kinds = {m.kind for m in messages}
    if batch:
        assert kinds == {"taps"} and len(messages) < TAPS
        assert max(len(m.batch) for m in messages) <= 32  # half the window
        if native_unavailable() is None:  # the native ring's records come as runs:
            # as columns to a subscriber that decodes them, never to one that does not
            assert any(m.header.get("runs") for m in messages) == columns
            # (rows: a run's body beside frame 0, the single taps' shared frame)
            assert columns or any(len(m.frames) > 1 for m in messages)
    else:
        assert kinds == {"tap"} and len(messages) == TAPS


def test_large_taps_travel_alone_even_to_a_batching_subscriber(
    start_daemon: Callable[..., Daemon], raw_peer: Callable[[str], zmq.Socket[bytes]]
) -> None:
    daemon = start_daemon()
    sock = raw_peer(daemon.endpoint)
    sock.send_multipart(encode("hello", {"role": "subscriber", "consumers": ["big"],
                                         "window": 8, "name": "raw", "batch": True}))  # fmt: skip
    assert decode(sock.recv_multipart()).kind == "welcome"
    emitter = BackgroundEmitter(daemon.endpoint, "many_bytes", "5", "128")
    messages = receive_while(sock, emitter)
    emitter.outcome()
    assert [m.kind for m in messages] == ["tap"] * 5
    assert [m.arrays()[0].nbytes for m in messages] == [128 * 1024] * 5


def one_subscriber(make: MakeRouter, *, window: int = 64, batch: bool = True) -> InProcessRouter:
    """A Router with one subscriber ("sub") of consumer "x" and one emitter ("em")."""
    peers = make()
    peers.subscribe("sub", ["x"], window=window, name="s", batch=batch)
    peers.emitter("em")
    return peers


@pytest.mark.fast
def test_a_batch_never_exceeds_what_a_subscriber_accepts_whatever_its_window(
    in_process_router: MakeRouter,
) -> None:
    """In-process Router: a subscriber with a huge window still gets batches that
    decode (at most `max_batch` taps each), and a non-forwarding emitter cannot pass
    itself off as another through the tap's `emitter` field."""
    peers = one_subscriber(in_process_router, window=3 * DEFAULT_LIMITS.max_batch)
    router = peers.router
    fields = {"consumer": "x", "step": None, "device": None, "process": 0, "host": "h",
              "pid": 1, "time": 0, "transforms": [], "meta": {}, "tree": ["*"],
              "emitter": "somebody-else:9"}  # fmt: skip
    count = 2 * DEFAULT_LIMITS.max_batch + 5
    for seq in range(count):
        router.tap("em", decode(encode("tap", {**fields, "seq": seq}, [np.zeros(1, np.int8)])))
    router.subscribers.pump()
    batches = peers.to("sub", "taps")
    assert [len(b.batch) for b in batches] == [DEFAULT_LIMITS.max_batch] * 2 + [5]
    taps = [t for b in batches for t in b.batch]
    assert [t.header["seq"] for t in taps] == list(range(count))
    assert {t.header["emitter"] for t in taps} == {"h:1"}


def ring_run(count: int) -> tuple[TapRun, list[np.ndarray]]:
    """A run of `count` ring records of one site (int32[2] each), as the daemon reads
    them: a 48-byte record header before each tap's leaf."""
    entry = {"consumer": "x", "transforms": [], "meta": {}, "tree": ["*"],
             "leaves": [["int32", [2], 8]]}  # fmt: skip
    site = Site(entry, {"process": 0, "host": "h", "pid": 1})
    values = [np.array([i, 10 * i], np.int32) for i in range(count)]
    span = memoryview(b"".join(bytes(48) + v.tobytes() for v in values))
    records = Records(span, 0, header_bytes=48)
    for i in range(count):
        records.append(56 * i, 56 * (i + 1), 0, 100 + i, i, 7, 0)
    assert records[1] == Record(56, 112, 0, 101, 1, 7, 0, span[104:112])
    return TapRun(site, records, span, header_bytes=48), values


@pytest.mark.fast
def test_a_run_is_one_unit_for_the_router_and_count_taps_for_everyone_else(
    in_process_router: MakeRouter,
) -> None:
    peers = one_subscriber(in_process_router)
    router = peers.router
    run, values = ring_run(5)
    router.tap("em", run, credit=False, nbytes=5 * 8)
    router.barrier("em", 1)
    router.subscribers.pump()
    [batch] = peers.to("sub", "taps")
    assert len(batch.frames) == 2  # body 0 (no single taps) and the run's span
    assert [t.header["seq"] for t in batch.batch] == [100, 101, 102, 103, 104]
    assert [t.value().tolist() for t in batch.batch] == [v.tolist() for v in values]
    tids = [t.header["tid"] for t in batch.batch]

    # A partial ack finishes nothing: the barrier waits for the whole run.
    router.subscribers.ack("sub", {"upto": tids[2], "errors": []}, now=1.0)
    assert [m.kind for m in peers.to("em")] == ["welcome"]
    # The rest, with a handler error on the fourth tap: reported with that tap's seq.
    router.subscribers.ack(
        "sub", {"upto": tids[4], "errors": [{"tid": tids[3], "error": "boom"}]}, 2.0
    )
    error, done = peers.to("em")[1:]
    assert (error.kind, error.header["seq"], error.header["error"]) == ("error", 103, "boom")
    assert (done.kind, done.header["delivered"]) == ("barrier_done", 5)
    assert router.counters["deliveries_acked"] == 5 and router.counters["handler_errors"] == 1


@pytest.mark.fast
def test_a_run_goes_tap_by_tap_to_a_subscriber_that_does_not_batch(
    in_process_router: MakeRouter,
) -> None:
    peers = one_subscriber(in_process_router, batch=False)
    router = peers.router
    assert router.run_limit("x", 8) == 1  # so the drain makes no runs for it...
    run, values = ring_run(3)
    router.tap("em", run, credit=False, nbytes=3 * 8)  # ...but one that comes is split
    router.subscribers.pump()
    taps = peers.to("sub", "tap")
    assert [t.arrays()[0].tolist() for t in taps] == [v.tolist() for v in values]
    assert [t.header["tid"] for t in taps] == [0, 1, 2]


@pytest.mark.fast
def test_an_error_acked_inside_a_run_reaches_the_emitter_before_the_run_completes(
    in_process_router: MakeRouter,
) -> None:
    peers = one_subscriber(in_process_router)
    router = peers.router
    run, _ = ring_run(5)
    router.tap("em", run, credit=False, nbytes=5 * 8)
    router.subscribers.pump()
    router.subscribers.ack("sub", {"upto": 2, "errors": [{"tid": 1, "error": "boom"}]}, now=1.0)
    errors = peers.to("em", "error")
    assert [(e.header["seq"], e.header["error"]) for e in errors] == [(101, "boom")]
    assert router.counters["handler_errors"] == 1


@pytest.mark.fast
def test_a_batch_static_the_metadata_parser_chokes_on_is_a_handler_error_not_a_crash() -> None:
    subscriber = Subscriber("ipc:///nonexistent/never-connected.sock")
    handled: list[Any] = []
    subscriber.add_handler("loss", lambda arg, meta: handled.append(arg))
    # (decode refuses such a static now: tapd/protocol/schema.py; the subscriber still
    # must not crash on one that passes the schema and chokes its metadata parser)
    fields = {**TAP_FIELDS, "transforms": []}
    header = decode(encode("tap", fields, [np.zeros(2, np.float32)])).header
    batch = decode(encode_batch([BatchTap(header, [bytes(8)], 0, "h:1")]))
    [run] = batch.runs
    run.static.fields["transforms"] = [1]
    link = DaemonLink("ipc:///nonexistent/never-connected.sock", None)  # type: ignore[arg-type]
    subscriber._handle(link, batch)
    assert (handled, subscriber.failed, link.last_tid) == ([], 1, 0)
    [error] = link.errors
    assert error["tid"] == 0 and "raised TypeError" in error["error"]


def big_tap(seq: int, values: np.ndarray) -> Any:
    """A decoded `tap` message of consumer "x" carrying `values`."""
    fields = {**TAP_FIELDS, "consumer": "x", "seq": seq, "transforms": []}
    return decode(encode("tap", fields, [values]))


@pytest.mark.fast
def test_taps_of_64_KiB_share_a_message_each_in_a_body_frame_of_its_own_uncopied(
    in_process_router: MakeRouter,
) -> None:
    """In-process Router: 64 KiB taps (the largest that are batched) go several to a
    `taps` message, each array the frame it came in, not copied into body 0."""
    peers = one_subscriber(in_process_router)
    router = peers.router
    arrays = [np.full(16 * 1024, seq, np.float32) for seq in range(5)]
    taps = [big_tap(seq, a) for seq, a in enumerate(arrays)]
    for tap in taps:
        router.tap("em", tap)
    router.subscribers.pump()
    [(_, frames)] = [(k, f) for k, f in peers.sent if k == "sub" and len(f) > 3]
    assert [len(f) for f in frames[2:]] == [0] + [64 * 1024] * 5  # body 0 is empty
    assert all(f is tap.frames[0] for f, tap in zip(frames[3:], taps, strict=True))
    [batch] = peers.to("sub", "taps")
    assert [t.value().tolist() for t in batch.batch] == [a.tolist() for a in arrays]


@pytest.mark.fast
def test_small_single_taps_and_unpadded_leaves_are_copied_into_body_0() -> None:
    big, odd = np.arange(4096, dtype=np.float32), np.arange(2049, dtype=np.float32)
    small = np.arange(3, dtype=np.int16)
    taps = [big_tap(seq, a) for seq, a in enumerate([big, odd, small])]
    frames = encode_batch([BatchTap(t.header, t.frames, seq, "h:1") for seq, t in enumerate(taps)])
    assert len(frames) == 4  # body 0 holds the odd-sized and the small tap; big its own
    assert frames[3] is taps[0].frames[0] and len(frames[2]) == 2049 * 4 + 4 + 8
    batch = decode(frames)
    values = [t.value() for t in batch.batch]
    assert [v.tolist() for v in values] == [a.tolist() for a in (big, odd, small)]
    assert [v.dtype for v in values] == [np.float32, np.float32, np.int16]


@pytest.mark.fast
@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_a_run_taps_values_are_read_only_arrays_as_a_tap_messages_are(
    shape: tuple[int, ...],
) -> None:
    """The per-tap path slices a run's stacked leaves: the values must be what a `tap`
    message gives (dtype, shape, 0-d arrays staying arrays, read-only), and metas equal."""
    from tapd_client.meta import MetaTemplate, TapMeta

    entry = {"consumer": "x", "transforms": [], "meta": {"k": 1}, "tree": ["*"],
             "leaves": [["float32", list(shape), 4 * int(np.prod(shape))]]}  # fmt: skip
    site = Site(entry, {"process": 0, "host": "h", "pid": 1})
    size = (4 * int(np.prod(shape)) + 7) & ~7
    values = [np.full(shape, i, np.float32) for i in range(3)]
    span = memoryview(b"".join(bytes(48) + v.tobytes() + bytes(size - v.nbytes) for v in values))
    records = Records(span, 0, header_bytes=48)
    for i in range(3):
        records.append((48 + size) * i, (48 + size) * (i + 1), 0, i, i, 7, 0)
    run = TapRun(site, records, span, header_bytes=48)
    batch = decode(encode_batch([run.batch_piece(0, "h:1")]))
    template = MetaTemplate(batch.batch[0].header)
    for message, expected in zip(batch.batch, values, strict=True):
        plain = Message(message.header, message.frames)  # arrays made from its frames
        value, reference = message.value(), plain.value()
        assert type(value) is np.ndarray and value.shape == shape == reference.shape
        assert value.dtype == reference.dtype and value.tolist() == expected.tolist()
        assert not value.flags.writeable and value.flags.c_contiguous
        assert template.meta(message.header) == TapMeta.from_header(message.header)
    # The subscriber's per-tap loop takes each run's values at once: the same arrays.
    (whole,) = batch.runs
    made_fields = set(vars(whole.message(0))) - {"_leaves", "_index"}  # (made without __init__)
    assert made_fields == {field.name for field in dataclasses.fields(Message)}
    for value, expected in zip(whole.values(), values, strict=True):  # what was tapped
        assert type(value) is np.ndarray and value.shape == shape == expected.shape
        assert value.dtype == expected.dtype and value.tolist() == expected.tolist()
        assert not value.flags.writeable and value.flags.c_contiguous


@pytest.mark.fast
def test_a_meta_made_without_init_has_exactly_tap_meta_s_fields() -> None:
    """MetaTemplate builds TapMeta's __dict__ by hand (the per-tap path): a field added
    to TapMeta must be added there too, or metas would lack it."""
    from tapd_client.meta import MetaTemplate, TapMeta

    header = {"kind": "tap", "consumer": "x", "seq": 3, "step": 2, "device": 0, "time": 5,
              "process": 0, "host": "h", "pid": 1, "transforms": [], "meta": {"k": 1}}  # fmt: skip
    made = MetaTemplate(header).meta(header)
    assert set(vars(made)) == {field.name for field in dataclasses.fields(TapMeta)}
    assert made == TapMeta.from_header(header)


@pytest.mark.fast
@pytest.mark.parametrize(
    "value",
    [(), {"a": np.zeros(2, np.float32), "b": np.zeros(3, np.int16)}, (np.float32(0), None)],
    ids=["no leaves", "two leaves", "a 0-d leaf beside None"],
)
def test_a_run_s_values_rebuild_each_tap_s_tree_as_a_tap_message_does(value: Any) -> None:
    """SiteRun.values(), the per-tap handlers' path: pytrees rebuilt per tap, values
    with no arrays at all (`id_print(())`) one per tap too."""
    from tapd.protocol.tree import flatten

    tree, leaves = flatten(value)
    arrays = [np.asarray(leaf) for leaf in leaves]
    specs = [[str(a.dtype), list(a.shape), a.nbytes] for a in arrays]
    entry = {"consumer": "x", "transforms": [], "meta": {}, "tree": tree, "leaves": specs}
    site = Site(entry, {"process": 0, "host": "h", "pid": 1})

    def body(i: int) -> bytes:
        return b"".join((a + i).tobytes().ljust((a.nbytes + 7) & ~7, b"\0") for a in arrays)

    bodies = [body(i) for i in range(3)]
    span = memoryview(b"".join(bytes(48) + b for b in bodies))
    records = Records(span, 0, header_bytes=48)
    start = 0
    for i, b in enumerate(bodies):
        records.append(start, start + 48 + len(b), 0, i, i, 7, 0)
        start += 48 + len(b)
    run = TapRun(site, records, span, header_bytes=48)
    batch = decode(encode_batch([run.batch_piece(0, "h:1")]))
    (whole,) = batch.runs
    got = whole.values()
    assert len(got) == 3
    for i, (fast, message) in enumerate(zip(got, batch.batch, strict=True)):
        # The references: a `tap` message made from the frames, and what was tapped.
        plain = Message(message.header, message.frames).value()
        assert type(fast) is type(plain) is type(value)
        fast_tree, fast_leaves = flatten(fast)
        plain_tree, plain_leaves = flatten(plain)
        assert fast_tree == plain_tree == tree
        tapped = [(a + i).tolist() for a in arrays]
        assert [np.asarray(a).tolist() for a in fast_leaves] == tapped
        assert [np.asarray(a).tolist() for a in plain_leaves] == tapped
