"""The small-tap path of a subscriber (issue 63): a per-tap handler's meta is a
`ColumnMeta` read from its batch's columns, its value a row of the batch's stacked
leaves. Pinned here: such a meta is the eager `TapMeta` in every field and behaviour,
a handler may keep values and metas past its call (the next message does not clobber
them), and sampling, failures and counts stay exact.

The end-to-end test runs this file as its subscriber process (`python
test_column_meta.py sub ...`, at the bottom).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest
import zmq

from conftest import PROCESS_TIMEOUT, Daemon, stop_process, wait_until
from tapd.errors import ProtocolError
from tapd.protocol import decode
from tapd.protocol.batch import BatchRun, encode_batch
from tapd.protocol.tree import flatten
from tapd_client import ShardInfo, Subscriber, TapBatch, TapMeta
from tapd_client.batch import single_value
from tapd_client.daemon_link import DaemonLink

HERE = Path(__file__).resolve()
NOWHERE = "ipc:///nonexistent/never-connected.sock"
SHARD = {"axes": ["a", "b"], "sizes": [2, 2], "layout": [[[4, 6], [["a"], ["b"]]]]}
STATIC: dict[str, Any] = {
    "consumer": "x", "process": 3, "host": "h", "pid": 7, "meta": {"unit": "m"},
    "tree": ["*"], "transforms": [["batch", {"batch_dims": [0]}]],
    "leaves": [["float32", [2, 3], 24]],
}  # fmt: skip
STRIDE = 48  # a record header (16 bytes) and a leaf padded to 32


def run_of(
    count: int,
    *,
    sharded: bool = False,
    first: int = 0,
    first_tid: int = 100,
    devices: bool = False,
) -> BatchRun:
    """`count` taps of one site laid out as ring records, tap i holding `i + first` in
    each element; steps None for every third, and devices too unless `devices` (a
    run with a device None goes as rows, never as a columnar run)."""
    body = bytearray(count * STRIDE)
    for i in range(count):
        np.frombuffer(body, np.float32, 6, i * STRIDE + 16)[:] = i + first
    seqs = list(range(first, first + count))
    return BatchRun(
        {**STATIC, "shard": SHARD} if sharded else STATIC, bytes(body),
        [i * STRIDE + 16 for i in range(count)], first_tid, "h:7", "site", seqs,
        steps=[None if s % 3 == 0 else 10 * s for s in seqs],
        devices=[None if s % 3 == 1 and not devices else s % 4 for s in seqs],
        times=[1_700_000_000_000_000_000 + 1000 * s for s in seqs],
        coords=[[s % 2, (s // 2) % 2] for s in seqs] if sharded else None,
    )  # fmt: skip


def subscriber_of(handler: Callable[..., Any], **options: Any) -> tuple[Subscriber, DaemonLink]:
    subscriber = Subscriber(NOWHERE)
    subscriber.add_handler("x", handler, **options)
    return subscriber, DaemonLink(NOWHERE, None)  # type: ignore[arg-type]


# How a run travels: as rows (devices None among them, or a sharded site's), or as a
# columnar run (docs/PROTOCOL.md, "taps"), whose columns the subscriber reads as arrays.
WIRES = {
    "rows": {},
    "sharded-rows": {"sharded": True},
    "columnar": {"devices": True},
}


def encoded(run: BatchRun) -> list[Any]:
    """A message of `run`: columnar wherever it can be."""
    return encode_batch([run], columns=True)


@pytest.mark.fast
@pytest.mark.parametrize("wire", list(WIRES))
def test_a_column_meta_is_the_eager_meta_in_every_field_and_behaviour(wire: str) -> None:
    sharded = wire == "sharded-rows"
    got: list[tuple[Any, TapMeta]] = []
    subscriber, link = subscriber_of(lambda value, meta: got.append((value, meta)))
    message = decode(encoded(run_of(6, **WIRES[wire])))
    [run] = message.runs
    assert (run.columns is not None) == (wire == "columnar")
    subscriber._handle(link, message)
    assert len(got) == 6 and subscriber.processed == 6 and link.last_tid == 105
    for i, (value, meta) in enumerate(got):
        eager = TapMeta.from_header(run.header(i))
        assert type(meta) is not TapMeta  # the lazy one, which must not show it:
        assert isinstance(meta, TapMeta) and dataclasses.is_dataclass(meta)
        for field in dataclasses.fields(TapMeta):
            assert getattr(meta, field.name) == getattr(eager, field.name), field.name
            assert type(getattr(meta, field.name)) is type(getattr(eager, field.name))
        assert meta == eager and eager == meta and not (meta != eager)  # noqa: SIM202
        assert repr(meta) == repr(eager)
        assert dataclasses.asdict(meta) == dataclasses.asdict(eager)
        assert vars(meta) == vars(eager)
        assert meta.__replace__(seq=9) == dataclasses.replace(eager, seq=9)  # (copy.replace)
        assert (meta.shard_index, meta.global_shape) == (eager.shard_index, eager.global_shape)
        assert (meta.shard_index is not None) == sharded
        for twin in (copy.copy(meta), copy.deepcopy(meta), dataclasses.replace(meta)):
            assert type(twin) is TapMeta and twin == eager
        moved = dataclasses.replace(meta, seq=99)
        assert type(moved) is TapMeta and moved.seq == 99 and moved.step == eager.step
        with pytest.raises(TypeError):  # unhashable, as TapMeta is (its `meta` dict)
            hash(meta)
        with pytest.raises(AttributeError):  # read-only, as TapMeta is
            meta.seq = 5  # type: ignore[misc]
        np.testing.assert_array_equal(value, np.full((2, 3), i, np.float32))
        assert not value.flags.writeable
    # Each tap's `meta` dict is its own and stays what the handler made of it.
    first, second = got[0][1], got[1][1]
    first.meta["seen"] = True
    assert first.meta == {"unit": "m", "seen": True} and second.meta == {"unit": "m"}
    assert first != TapMeta.from_header(run.header(0)) and got[2][1].meta == {"unit": "m"}
    if sharded:
        shard = got[3][1].shard
        assert isinstance(shard, ShardInfo) and shard is got[3][1].shard  # made once
        assert (shard.coords, shard.index, shard.block(0)) == (
            (1, 1),
            3,
            (slice(2, 4), slice(3, 6)),
        )


@pytest.mark.fast
@pytest.mark.parametrize("wire", list(WIRES))
def test_a_batch_s_metas_and_columns_are_the_per_tap_path_s(wire: str) -> None:
    batches: list[TapBatch] = []
    per_tap: list[tuple[Any, TapMeta]] = []
    frames = encoded(run_of(5, **WIRES[wire]))
    for handler, options in ((batches.append, {"batch": True}),
                             (lambda v, m: per_tap.append((v, m)), {})):  # fmt: skip
        subscriber, link = subscriber_of(handler, **options)
        subscriber._handle(link, decode(frames))
        assert (subscriber.processed, link.last_tid) == (5, 104)
    [batch] = batches
    assert batch.metas() == [meta for _, meta in per_tap] and batch.meta == per_tap[0][1]
    assert batch.seq.tolist() == [0, 1, 2, 3, 4]
    assert batch.step.tolist() == [-1, 10, 20, -1, 40]
    devices = [0, 1, 2, 3, 0] if wire == "columnar" else [0, -1, 2, 3, -1]
    assert batch.device.tolist() == devices and batch.process.tolist() == [3] * 5
    for column in (batch.seq, batch.step, batch.device, batch.process):
        assert column.dtype == np.int64
    assert batch.time.tolist() == [m.time for _, m in per_tap]
    if wire == "sharded-rows":
        assert batch.shard_index is not None and batch.shard_index.tolist() == [0, 2, 1, 3, 0]
    else:
        assert batch.shard_index is None
    assert batch.tids == [100, 101, 102, 103, 104] and len(batch) == 5
    assert [h["seq"] for h in batch.headers()] == [0, 1, 2, 3, 4]
    for (value, meta), (want, want_meta) in zip(batch, per_tap, strict=True):
        assert meta == want_meta and value.tolist() == want.tolist()


@pytest.mark.fast
@pytest.mark.parametrize("wire", list(WIRES))
def test_sampling_and_a_failing_handler_within_a_run_count_exactly(wire: str) -> None:
    """every=3 over seqs 0..9 keeps 0, 3, 6, 9; the handler fails on 6: three taps
    handled, one failed and acknowledged with its error, its delivery id the run's."""
    seen: list[int] = []

    def handler(value: Any, meta: TapMeta) -> None:
        if meta.seq == 6:
            raise ValueError("six")
        seen.append(meta.seq)
        assert value[0, 0] == meta.seq

    subscriber, link = subscriber_of(handler, every=3)
    subscriber._handle(link, decode(encoded(run_of(10, **WIRES[wire]))))
    assert seen == [0, 3, 9] and (subscriber.processed, subscriber.failed) == (3, 1)
    assert [e["tid"] for e in link.errors] == [106] and "ValueError: six" in link.errors[0]["error"]
    assert link.last_tid == 109  # the sampled-out taps are acknowledged too


@pytest.mark.fast
@pytest.mark.parametrize("wire", ["rows", "columnar"])
@pytest.mark.parametrize("batch", [False, True], ids=["per-tap", "batch"])
def test_kept_values_and_metas_outlive_the_messages_that_brought_them(
    batch: bool, wire: str
) -> None:
    """Through a real ZeroMQ socket, received as the subscriber receives (uncopied
    frames): what handlers keep of 50 messages is, after all of them, what was sent."""
    kept: list[Any] = []
    handler = kept.append if batch else (lambda value, meta: kept.append((value, meta)))
    subscriber, link = subscriber_of(handler, batch=batch)
    context = zmq.Context.instance()
    receiver, sender = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        receiver.bind("inproc://column-meta-kept")
        sender.connect("inproc://column-meta-kept")
        link.sock = receiver
        for message in range(50):
            first = 40 * message
            run = run_of(40, first=first, first_tid=first, devices=wire == "columnar")
            sender.send_multipart(encoded(run))
            assert receiver.poll(5000)
            subscriber._handle(link, link.receive())  # type: ignore[arg-type]
    finally:
        receiver.close(linger=0)
        sender.close(linger=0)
    pairs = [pair for b in kept for pair in b] if batch else kept
    assert [meta.seq for _, meta in pairs] == list(range(2000))
    for value, meta in pairs:
        assert value.tolist() == np.full((2, 3), meta.seq, np.float32).tolist()
    assert subscriber.processed == 2000 and link.last_tid == 1999


@pytest.mark.fast
@pytest.mark.parametrize(
    "value",
    [np.float32(3), np.arange(6, dtype=np.int16).reshape(2, 3),
     {"a": np.zeros((0, 2), np.float32), "b": (np.ones(3, ml_dtypes.bfloat16), None)}],
    ids=["0-d", "2-d", "a tree with an empty leaf"],
)  # fmt: skip
def test_a_run_of_one_tap_has_the_value_a_longer_run_would_give(value: Any) -> None:
    """Sites that take turns in a loop come as runs of one tap, whose value is made
    without stacking (batch.single_value): the same arrays, read-only, the same tree."""
    tree, leaves = flatten(value)
    arrays = [np.asarray(leaf) for leaf in leaves]
    body = bytes(16) + b"".join(a.tobytes() + bytes(-a.nbytes % 8) for a in arrays)
    static = {**STATIC, "tree": tree,
              "leaves": [[str(a.dtype), list(a.shape), a.nbytes] for a in arrays]}  # fmt: skip
    run_piece = BatchRun(static, body, [16], 0, "h:7", "s", [0], [None], [0], [0])
    [run] = decode(encode_batch([run_piece])).runs
    alone, stacked = single_value(run), run.values()[0]
    got, want = flatten(alone), flatten(stacked)
    assert got[0] == want[0] == tree and len(got[1]) == len(arrays)
    for mine, theirs, tapped in zip(got[1], want[1], arrays, strict=True):
        assert type(mine) is np.ndarray and mine.dtype == theirs.dtype == tapped.dtype
        assert mine.shape == theirs.shape == tapped.shape and not mine.flags.writeable
        assert mine.tobytes() == tapped.tobytes()


class Body(bytearray):
    """A body frame that can be watched (weakref) for being freed."""


@pytest.mark.fast
@pytest.mark.parametrize("wire", ["rows", "columnar"])
def test_a_kept_meta_does_not_keep_its_message_s_body_alive(wire: str) -> None:
    """A handler that keeps only metas keeps their columns, a few bytes a tap, not the
    body frame that brought the values (which a kept value does keep)."""
    metas: list[TapMeta] = []
    values: list[Any] = []
    frames = encoded(run_of(8, devices=wire == "columnar"))
    for keep_value in (False, True):
        frames[-1] = Body(frames[-1])
        body = weakref.ref(frames[-1])
        subscriber, link = subscriber_of(
            lambda v, m, keep=keep_value: (metas.append(m), keep and values.append(v))
        )
        subscriber._handle(link, decode(frames))
        frames[-1] = bytes(frames[-1])
        gc.collect()
        assert (body() is None) == (not keep_value)
    assert [m.seq for m in metas] == list(range(8)) * 2 and len(values) == 8
    assert values[3].tolist() == np.full((2, 3), 3, np.float32).tolist()


@pytest.mark.fast
def test_a_columnar_message_that_does_not_decode_fails_each_tap_it_names() -> None:
    """As for rows (tests/test_subscriber_faults.py): its delivery ids, read from the
    runs' first tid and count, are acknowledged with the reason, so that the emitter's
    barrier raises rather than waits."""
    frames = encoded(run_of(4, devices=True, first_tid=20))
    header = msgpack.unpackb(frames[1])
    header["runs"][0][5] = header["runs"][0][5][:-8]  # the seqs column a value short
    frames[1] = msgpack.packb(header)
    link = DaemonLink(NOWHERE, None)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as refused:
        decode(frames)
    link._refuse(frames, refused.value)
    assert [e["tid"] for e in link.errors] == [20, 21, 22, 23] and link.last_tid == 23
    assert "could not decode" in link.errors[0]["error"]


# ---- end to end: a JAX loop's small taps, kept by the handler -------------------------------


def subscriber_main(argv: list[str]) -> None:
    """Keeps every (value, meta) of "loss" taps (or every batch); at SIGTERM checks each
    kept value against its seq and writes what it found."""
    endpoint, record, mode = argv
    kept: list[Any] = []
    subscriber = Subscriber(endpoint, heartbeat=0.2)
    if mode == "batch":
        subscriber.add_handler("loss", kept.append, batch=True)
    else:
        every = 7 if mode == "every" else 1
        subscriber.add_handler("loss", lambda v, m: kept.append((v, m)), every=every)
    signal.signal(signal.SIGTERM, lambda *_: subscriber.stop())
    with subscriber:
        subscriber.run()
    pairs = [pair for b in kept for pair in b] if mode == "batch" else kept
    ramp = np.arange(16, dtype=np.float32)
    result = {
        "seqs": [meta.seq for _, meta in pairs],
        "steps_match": all(meta.step == meta.seq for _, meta in pairs),
        "values_match": all(np.array_equal(value, ramp + meta.seq) for value, meta in pairs),
        "processed": subscriber.processed,
    }
    Path(record).write_text(json.dumps(result))


def emitter_main(argv: list[str]) -> None:
    """One jitted fori_loop tapping 16 float32 (64 B: issue 63's tap) `count` times."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    import tapd

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x + i.astype(jnp.float32), "loss", step=i)
        return x

    loop = jax.jit(lambda x: lax.fori_loop(0, int(argv[0]), body, x))
    loop(jnp.arange(16, dtype=jnp.float32)).block_until_ready()
    tapd.barrier_wait(timeout=120)
    print(json.dumps({"stats": tapd.stats()}), flush=True)


@pytest.mark.parametrize("mode", ["per-tap", "every", "batch"])
def test_a_loop_s_small_taps_kept_by_the_handler_stay_intact(
    start_daemon: Callable[..., Daemon], runtime_dir: Path, mode: str
) -> None:
    daemon = start_daemon()
    record = runtime_dir / f"kept-{mode}.json"
    argv = [sys.executable, str(HERE), "sub", daemon.endpoint, str(record), mode]
    process = subprocess.Popen(argv, env=dict(os.environ))
    try:
        wait_until(lambda: daemon.subscriber_count() > 0 or process.poll() is not None,
                   "the subscriber to connect")  # fmt: skip
        count = 3000
        emitter = subprocess.run(
            [sys.executable, str(HERE), "emit", str(count)], capture_output=True, text=True,
            env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint}, timeout=PROCESS_TIMEOUT,
        )  # fmt: skip
        assert emitter.returncode == 0, emitter.stderr
        stats = json.loads(emitter.stdout.splitlines()[-1])["stats"]  # (its barrier returned)
        want = list(range(0, count, 7)) if mode == "every" else list(range(count))
        assert stats["delivered"] == len(want)  # (every=7: the emitter copies no others)
    finally:
        assert stop_process(process) == 0
    result = json.loads(record.read_text())
    assert result["seqs"] == want and result["processed"] == len(want)
    assert result["steps_match"] and result["values_match"]


if __name__ == "__main__":
    {"sub": subscriber_main, "emit": emitter_main}[sys.argv[1]](sys.argv[2:])
