"""Batch handlers (`@sub.on(name, batch=True)`): runs of taps of one site as one
`TapBatch` of stacked leaves and meta columns.

The reference is the per-tap handler: a batch must hold exactly the values and meta
that the per-tap path gives for the same taps, whichever way the taps travelled
(evenly spaced ring records: views; uneven ones: gathered; single taps; one large tap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from conftest import Daemon, SubscriberProcess, run_emitter
from tapd.protocol import decode, encode
from tapd.protocol.batch import BatchRun, BatchTap, encode_batch
from tapd_client import Subscriber, TapBatch, TapMeta
from tapd_client.daemon_link import DaemonLink

FIELDS: dict[str, Any] = {
    "consumer": "tree", "seq": 0, "step": None, "device": None, "process": 3, "host": "h",
    "pid": 7, "time": 1_700_000_000_000_000_000, "transforms": [], "meta": {"unit": "m"},
    "tree": ["d", ["half", "w"], [["*"], ["*"]]],
}  # fmt: skip


def tree_tap(i: int) -> tuple[dict[str, Any], list[np.ndarray]]:
    half = np.full(3, i / 2, ml_dtypes.bfloat16)
    w = np.arange(6, dtype=np.float32).reshape(2, 3) + i
    return {**FIELDS, "seq": i, "step": 10 + i, "device": i % 2}, [half, w]


def ring_run(count: int, gaps: list[int]) -> BatchRun:
    """`count` tree taps laid out as ring records: a gap (a record header) before each."""
    header, _ = tree_tap(0)
    header = decode(encode("tap", header, tree_tap(0)[1])).header
    body, offsets = b"", []
    for i in range(count):
        body += bytes(gaps[i % len(gaps)])
        offsets.append(len(body))
        half, w = tree_tap(i)[1]
        body += half.tobytes() + bytes(2) + w.tobytes()  # leaves padded to 8 bytes
    return BatchRun(header, body, offsets, first_tid=100, emitter="h:7", site="s",
                    seqs=list(range(count)), steps=[10 + i for i in range(count)],
                    devices=[i % 2 for i in range(count)],
                    times=[FIELDS["time"] + i for i in range(count)])  # fmt: skip


def handled(frames: list[Any], batch: bool) -> tuple[list[Any], Subscriber, DaemonLink]:
    """What a subscriber's handler gets for one message: TapBatches or (value, meta)."""
    got: list[Any] = []
    subscriber = Subscriber("ipc:///nonexistent/never-connected.sock")
    if batch:
        subscriber.add_handler("tree", got.append, batch=True)
    else:
        subscriber.add_handler("tree", lambda value, meta: got.append((value, meta)))
    subscriber.add_handler("other", lambda value, meta: got.append(("other", meta.seq)))
    link = DaemonLink("ipc:///nonexistent/never-connected.sock", None)  # type: ignore[arg-type]
    subscriber._handle(link, decode(frames))
    return got, subscriber, link


def per_tap_of(batches: list[TapBatch]) -> list[tuple[Any, TapMeta]]:
    return [pair for batch in batches for pair in batch]


def assert_same_taps(got: list[tuple[Any, TapMeta]], want: list[tuple[Any, TapMeta]]) -> None:
    assert [meta for _, meta in got] == [meta for _, meta in want]
    for (value, _), (reference, _) in zip(got, want, strict=True):
        assert value.keys() == reference.keys()
        for key in value:
            assert value[key].dtype == reference[key].dtype
            np.testing.assert_array_equal(value[key], reference[key])


@pytest.mark.fast
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columnar"])
@pytest.mark.parametrize("gaps", [[48], [48, 16, 8]], ids=["even", "uneven"])
def test_a_run_of_ring_records_is_one_batch_equal_to_its_taps(
    gaps: list[int], columns: bool
) -> None:
    """Sent as rows or as a columnar run (docs/PROTOCOL.md, "taps"), a run is the same
    batch, and the same taps to a per-tap handler."""
    frames = encode_batch([ring_run(5, gaps)], columns=columns)
    assert bool(decode(frames).header.get("runs")) == columns
    [batch], subscriber, link = handled(frames, batch=True)
    reference, _, _ = handled(frames, batch=False)
    assert isinstance(batch, TapBatch) and len(batch) == 5 and batch.consumer == "tree"
    assert batch.value["w"].shape == (5, 2, 3) and batch.value["half"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(batch.value["w"][:, 0, 0], np.arange(5, dtype=np.float32))
    assert batch.seq.tolist() == [0, 1, 2, 3, 4] and batch.step.tolist() == [10, 11, 12, 13, 14]
    assert batch.device.tolist() == [0, 1, 0, 1, 0] and batch.process.tolist() == [3] * 5
    assert batch.time.tolist() == [m.time for m in batch.metas()]
    assert batch.shard_index is None and batch.meta.meta == {"unit": "m"}
    assert not batch.value["w"].flags.writeable  # it views the message
    # Evenly spaced records are a strided view of the body (their record headers between
    # them), uneven ones a gathered copy, contiguous.
    assert batch.value["w"].flags.c_contiguous == (len(gaps) > 1)
    assert_same_taps(per_tap_of([batch]), reference)
    assert (subscriber.processed, link.last_tid, link.errors) == (5, 104, [])


@pytest.mark.fast
def test_a_sites_taps_in_a_message_are_one_batch_where_the_first_is() -> None:
    """A message mixing single taps (copied into body 0), a run of another site of the
    same consumer, and another consumer's tap between them: the batch handler gets one
    batch per site, in seq order, run where the site's first tap is."""

    def single(i: int, tid: int, consumer: str = "tree") -> BatchTap:
        header, leaves = tree_tap(i)
        header = decode(encode("tap", {**header, "consumer": consumer}, leaves)).header
        return BatchTap(header, [leaf.tobytes() for leaf in leaves], tid, "h:7", site=consumer)

    run = ring_run(3, [48])
    frames = encode_batch([single(7, 90), single(9, 91, "other"), single(8, 92), run])
    got, subscriber, link = handled(frames, batch=True)
    assert [type(x).__name__ for x in got] == ["TapBatch", "tuple", "TapBatch"]
    assert got[0].seq.tolist() == [7, 8] and got[1] == ("other", 9)
    assert got[2].seq.tolist() == [0, 1, 2]
    reference, _, _ = handled(frames, batch=False)
    want = [r for r in reference if r[0] != "other"]
    assert_same_taps(per_tap_of([got[0], got[2]]), [want[0], want[1], *want[2:]])
    assert subscriber.processed == 6 and link.last_tid == 102


@pytest.mark.fast
def test_a_large_tap_is_a_batch_of_one() -> None:
    header, leaves = tree_tap(4)
    got, subscriber, _ = handled(encode("tap", {**header, "tid": 5}, leaves), batch=True)
    [batch] = got
    assert len(batch) == 1 and batch.value["w"].shape == (1, 2, 3) and batch.seq.tolist() == [4]
    [(value, meta)] = list(batch)
    np.testing.assert_array_equal(value["w"], leaves[1])
    assert meta.step == 14 and subscriber.processed == 1


@pytest.mark.fast
def test_a_failing_batch_handler_fails_each_of_its_taps() -> None:
    subscriber = Subscriber("ipc:///nonexistent/never-connected.sock")

    @subscriber.on("tree", batch=True)
    def broken(batch: TapBatch) -> None:
        raise RuntimeError(f"cannot write {len(batch)} taps")

    link = DaemonLink("ipc:///nonexistent/never-connected.sock", None)  # type: ignore[arg-type]
    subscriber._handle(link, decode(encode_batch([ring_run(3, [48])])))
    assert (subscriber.processed, subscriber.failed) == (0, 3)
    assert [e["tid"] for e in link.errors] == [100, 101, 102]
    assert all("cannot write 3 taps" in e["error"] for e in link.errors)


@pytest.mark.fast
def test_a_handler_object_that_takes_batches_is_registered_as_one() -> None:
    class Sink:
        takes_batch = True

        def __init__(self) -> None:
            self.seqs: list[int] = []

        def __call__(self, batch: TapBatch) -> None:
            self.seqs += batch.seq.tolist()

    subscriber = Subscriber("ipc:///nonexistent/never-connected.sock")
    sink = Sink()
    subscriber.add_handler("tree", sink)
    link = DaemonLink("ipc:///nonexistent/never-connected.sock", None)  # type: ignore[arg-type]
    subscriber._handle(link, decode(encode_batch([ring_run(4, [48])])))
    assert sink.seqs == [0, 1, 2, 3]


# ---- end to end: a JAX loop, the daemon, a batch subscriber beside a per-tap one ----------


def records_by_seq(subscriber: SubscriberProcess, consumer: str) -> list[dict[str, Any]]:
    rows = [r for r in subscriber.records() if r["consumer"] == consumer]
    return sorted(rows, key=lambda r: (r["device"] or 0, r["seq"]))


def test_batch_subscriber_gets_what_a_per_tap_subscriber_gets(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon()
    per_tap = start_subscriber(daemon, "tree", "loss")
    batched = start_subscriber(daemon, "tree", "loss", batch=True)
    count = 400
    run_emitter(daemon.endpoint, "loop_pytree", str(count))  # (its barrier: all handled)
    for consumer in ("tree", "loss"):
        want = records_by_seq(per_tap, consumer)
        got = records_by_seq(batched, consumer)
        assert [r["seq"] for r in want] == list(range(count))
        assert all(r.pop("time_matches") for r in got)
        sizes = [r.pop("batch_size") for r in got]
        assert got == want
        assert max(sizes) > 1  # the loop's taps did arrive in runs
    assert got[5]["meta"] == {"unit": "nats"} and got[5]["step"] == 5


def test_batch_subscriber_of_sharded_taps_has_their_shard_indices(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon()
    per_tap = start_subscriber(daemon, "shard")
    batched = start_subscriber(daemon, "shard", batch=True)
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run_emitter(daemon.endpoint, "pmap", "30", env=env)
    want = records_by_seq(per_tap, "shard")
    got = records_by_seq(batched, "shard")
    for row in got:
        row.pop("batch_size"), row.pop("time_matches")
    assert len(want) == 120 and got == want
    assert sorted({r["shard_index"] for r in got}) == [0, 1, 2, 3]


def test_a_failing_batch_handler_raises_in_the_emitters_barrier_wait(
    start_daemon: Callable[..., Daemon], start_subscriber: Callable[..., SubscriberProcess]
) -> None:
    daemon = start_daemon()
    start_subscriber(daemon, "bad", "good", raise_on="bad", batch=True)
    result = run_emitter(daemon.endpoint, "raising")
    assert result["raised"] is not None, "barrier_wait did not raise TapFunctionException"
    assert "handle_batch raised ValueError('deliberate failure at seqs [0]')" in result["raised"]
    assert result["errors"][0].startswith("bad#0:")
    assert daemon.counters()["handler_errors"] == 1
