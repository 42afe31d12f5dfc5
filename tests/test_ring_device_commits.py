"""The ring's side of commits a CUDA stream writes itself (tapd/native/ffi_cuda.cc,
"stream write"), and of a tap that waits for ring space explaining itself. Both run on
a CPU: the device's half of a commit is a 32-bit store of the commit tag's low half
(`device_store_for_test`), exactly what cuStreamWriteValue32 does to the ring.

The waiting-tap message is what `bench/gpu-check` hit on its first GPU run ("a tap has
waited 5 s for ring space", and nothing else): it now names the ring's positions, the
oldest unreleased record and who holds it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_ring_format import layout

from conftest import Daemon, SubscriberProcess, run_emitter, tapd_cmd, wait_until
from tapd.native import library
from tapd.native import ring as ring_module
from tapd.native.ring import Ring
from tapd.protocol.ring_format import HELD_REASONS

if library.load() is None:
    pytest.skip(f"native library unavailable: {library.unavailable_reason()}",
                allow_module_level=True)  # fmt: skip

PAGE = 4096


def held_reason(path: Path) -> str | None:
    """Why the daemon says it holds the ring (RingControl::held_reason), read from the
    ring's file where ring.h puts it."""
    offset, size, _ = layout("RingControl")["held_reason"]
    fd = os.open(path, os.O_RDONLY)
    try:
        code = int.from_bytes(os.pread(fd, size, offset), "little")
    finally:
        os.close(fd)
    return next((name for name, value in HELD_REASONS.items() if value == code), None)


@pytest.fixture
def rings(tmp_path: Path) -> Iterator[Callable[..., Ring]]:
    made: list[Ring] = []

    def create(name: str = "ring", capacity: int = 16 * PAGE) -> Ring:
        ring = Ring.create(tmp_path / name, capacity, "block")
        made.append(ring)
        return ring

    yield create
    for ring in made:
        ring.close()


@pytest.mark.fast
def test_a_stream_written_tag_commits_the_record_and_its_int32_step_is_sign_extended(
    rings: Callable[..., Ring],
) -> None:
    ring = rings()
    reader = Ring.open(ring.path)
    try:
        positions = []
        for i, step in enumerate((-5, 7, -(2**31))):
            position = ring.reserve_for_test(3, bytes([i]) * 8, step=0)
            assert position is not None
            ring.device_enqueue_for_test(position, step32=step)
            positions.append(position)
        assert reader.read(0) == []  # reserved: nothing readable
        for position in positions:
            ring.device_store_for_test(position)
        records = reader.read(0)
        # A device cannot sign-extend or clear the flag: the reader does.
        assert [r.step for r in records] == [-5, 7, -(2**31)]
        assert [bytes(r.payload) for r in records] == [bytes([i]) * 8 for i in range(3)]
        assert ring.counters().taps == 3  # counted by the host half, when enqueued
    finally:
        reader.close()


@pytest.mark.fast
def test_uniform_runs_of_stream_committed_records_get_their_steps_too(
    rings: Callable[..., Ring],
) -> None:
    """Many records of one length are read as numpy columns (ring.py `_read_uniform`):
    there too an int32 step left by a device is sign-extended, a host one untouched."""
    ring = rings()
    reader = Ring.open(ring.path)
    try:
        steps = [(i + 1) * (-1 if i % 2 == 0 else 1) for i in range(2 * ring_module.COLUMNS_FROM)]
        for i, step in enumerate(steps):
            position = ring.reserve_for_test(1, b"x" * 16, step=0 if i % 2 == 0 else step)
            assert position is not None
            if i % 2 == 0:
                ring.device_enqueue_for_test(position, step32=step)
                ring.device_store_for_test(position)
            else:
                ring.commit_for_test(position)
        assert [r.step for r in reader.read(0)] == steps
    finally:
        reader.close()


@pytest.mark.fast
def test_a_reader_does_not_sleep_while_the_next_commit_is_a_devices(
    rings: Callable[..., Ring],
) -> None:
    """No host code runs when a device writes a tag, so nothing would wake a sleeping
    reader: it keeps polling while the first unread record awaits a device's commit, and
    sleeps again once it is read."""
    ring = rings()
    reader = Ring.open(ring.path)
    try:
        position = ring.reserve_for_test(1, b"y" * 8)
        assert position is not None
        assert reader.sleep(0) is True  # a host writer's record: it will wake us
        ring.device_enqueue_for_test(position)
        assert reader.sleep(0) is False  # a device's: poll
        ring.device_store_for_test(position)
        (record,) = reader.read(0)
        assert reader.sleep(record.end) is True
    finally:
        reader.close()


@pytest.mark.fast
def test_close_waits_for_a_tag_a_device_will_still_write(rings: Callable[..., Ring]) -> None:
    """A tag a device will write is never given up while its process lives: closing the
    ring waits for it (the device is still writing into that memory)."""
    ring = rings()
    position = ring.reserve_for_test(1, b"z" * 8)
    assert position is not None
    ring.device_enqueue_for_test(position)
    closing = threading.Thread(target=ring.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # waiting for the device
    ring.device_store_for_test(position)
    closing.join(10)
    assert not closing.is_alive()


@pytest.mark.fast
def test_a_barrier_position_covers_commits_still_on_their_way(
    rings: Callable[..., Ring], capfd: pytest.CaptureFixture[str]
) -> None:
    """A CUDA commit (a side stream's host function, a device's tag) can land after the
    computation's token is ready: the position a barrier covers waits for every record
    reserved before it, and, past its timeout, says which one it gave up on."""
    ring = rings()
    first = ring.reserve_for_test(1, b"a" * 8)
    assert first is not None
    ring.device_enqueue_for_test(first)
    timer = threading.Timer(0.3, ring.device_store_for_test, args=(first,))
    timer.start()
    try:
        assert ring.settled(timeout=20) == 64  # the whole record: 56 + 8 bytes
    finally:
        timer.join()
    second = ring.reserve_for_test(1, b"b" * 8)
    assert second is not None
    assert ring.settled(timeout=0.2) == 64  # not committed: not covered, and said
    assert "a barrier waited 200 ms for the record at ring position 64" in capfd.readouterr().err
    ring.commit_for_test(second)
    assert ring.settled(timeout=0.2) == 128


# ---- a tap waiting for ring space explains itself ------------------------------------


def _fill_and_wait(ring: Ring, capfd: pytest.CaptureFixture[str]) -> tuple[str, threading.Thread]:
    """Fill `ring` with 64-byte records, start one more write (which waits), and
    return the message it writes once it has waited, and its thread."""
    payload = b"p" * (PAGE // 4 - 56)  # four records a page
    records = 0
    while ring.counters().head + len(payload) + 56 <= ring.counters().capacity:
        assert ring.write(9, payload, consumer=1)
        records += 1
    waiting = threading.Thread(target=ring.write, args=(9, payload), kwargs={"consumer": 1})
    waiting.start()
    said = ""

    def waited() -> bool:
        nonlocal said
        said += capfd.readouterr().err
        return "ring space" in said

    wait_until(waited, "the waiting tap to explain itself", 30)
    return said, waiting


def _release_all(ring: Ring) -> None:
    reader = Ring.open(ring.path)
    try:
        while records := reader.read(reader.counters().tail):
            reader.release(records[-1].end)
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("reader", "reason", "expected"),
    [
        (None, None, "no daemon attached to this ring"),
        ("self", "unacked", "held for a subscriber that has not acknowledged it"),
        ("self", "grace", "during its startup grace"),
        ("self", "detached", "the daemon let go of this ring"),
        ("gone", None, "is gone"),
    ],
)
def test_a_waiting_tap_names_the_ring_positions_and_why_the_oldest_record_is_held(
    rings: Callable[..., Ring],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    reader: str | None,
    reason: str | None,
    expected: str,
) -> None:
    monkeypatch.setenv("TAPD_RING_WAIT_WARNING_S", "0.2")
    ring = rings(capacity=PAGE)
    if reader == "self":
        ring.set_reader(os.getpid())
    elif reader == "gone":
        child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                               capture_output=True, text=True, check=True)  # fmt: skip
        ring.set_reader(int(child.stdout))  # a pid that has exited
    if reason is not None:
        ring.set_held_reason(reason)
        assert held_reason(ring.path) == reason
    said, waiting = _fill_and_wait(ring, capfd)
    try:
        assert re.search(r"of 1024 bytes has waited \d+\.\d s for ring space \(policy", said)
        assert f"Ring: {PAGE} bytes, head {PAGE}, committed {PAGE}, tail 0" in said
        assert "oldest unreleased record, at 0 (1024 bytes, site 9, seq 0, committed)" in said
        assert expected in said, said
    finally:
        _release_all(ring)
        waiting.join(10)
    assert not waiting.is_alive()


@pytest.mark.fast
def test_a_waiting_tap_behind_its_own_uncommitted_record_says_so(
    rings: Callable[..., Ring],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The oldest record is this process's own, reserved and not committed (a CUDA
    stream that has not reached the tap's commit): no daemon can free anything."""
    monkeypatch.setenv("TAPD_RING_WAIT_WARNING_S", "0.2")
    ring = rings(capacity=PAGE)
    position = ring.reserve_for_test(9, b"q" * (PAGE // 2))
    assert position == 0
    said, waiting = _fill_and_wait(ring, capfd)
    try:
        assert "committed 0, tail 0" in said
        assert "site 9, seq 0, reserved, not committed" in said
        assert "has not committed it yet" in said
    finally:
        ring.commit_for_test(position)
        _release_all(ring)
        waiting.join(10)
    assert not waiting.is_alive()


def test_a_tap_waiting_on_a_subscriber_that_has_not_acked_says_so(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
) -> None:
    """End to end: a real daemon, a subscriber that takes 300 ms a tap, an emitter whose
    ring holds two taps. Its waiting taps say the daemon holds the oldest record for a
    subscriber that has not acknowledged it (the reason the daemon wrote to the ring)."""
    daemon = start_daemon("--policy", "block", "--startup-grace", "0")
    subscriber = start_subscriber(daemon, "big", sleep_ms=300, window=1)
    result = run_emitter(daemon.endpoint, "many_bytes", "8", "16",
                         env={"TAPD_BUFFER_BYTES": "40000", "TAPD_RING_WAIT_WARNING_S": "0.25",
                              "TAPD_EXIT_TIMEOUT": "60"})  # fmt: skip
    assert "has waited" in result["stderr"], result["stderr"]
    explained = [line for line in result["stderr"].splitlines() if "ring space" in line]
    assert all(f"daemon pid {daemon.process.pid}" in line for line in explained), explained
    assert any("held for a subscriber that has not acknowledged it" in line
               for line in explained), explained  # fmt: skip
    wait_until(lambda: len(subscriber.records()) >= 8, "every tap to be handled", 60)


def test_the_gpu_benchmark_setup_that_hung_runs_through_on_cpu(
    start_daemon: Callable[..., Daemon],
) -> None:
    """The setup bench/gpu_bench.py hung in on the first GPU run (1 MiB taps, the
    native tap, portable tap and callback loops interleaved, no subscriber, a barrier
    after each tapped run), on the CPU with a ring of the benchmark's shape (its runs
    fill 80 % of it): it must run through without a tap waiting 2 s for space."""
    daemon = start_daemon("--policy", "block")
    ring = 64 * 2**20
    steps = min(200, int(ring * 0.8) // (2**20 + 64))
    app = Path(__file__).parent / "gpu" / "gpu_emitter_app.py"
    # (TAPD_DORMANT=0: no subscriber, yet every tap is to be copied, as on the GPU run)
    env = {**os.environ, "TAPD_ENDPOINT": daemon.endpoint, "JAX_PLATFORMS": "cpu",
           "TAPD_BUFFER_BYTES": str(ring), "TAPD_RING_WAIT_WARNING_S": "2",
           "TAPD_DORMANT": "0"}  # fmt: skip
    result = subprocess.run([sys.executable, str(app), "interleaved", str(steps)], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "for ring space" not in result.stderr, result.stderr
    output = json.loads(result.stdout.splitlines()[-1])
    assert output["backend"] == "native" and output["stats"]["dropped"] == 0, output
    # every tap of the native and portable loops went into the ring: 1 + 3 runs each
    assert output["stats"]["sent"] == 2 * 4 * steps, output["stats"]


def test_doctor_says_which_commit_cuda_taps_get(runtime_dir: Path) -> None:
    """`tapd doctor` names the CUDA commit (ffi_cuda.cc) and why: here, without a GPU,
    none, and that there is no device; library.cuda_commit() says the same."""
    if not library.has_handler("cuda"):
        pytest.skip(f"no CUDA handler built here: {library.handler_reason('cuda')}")
    variant, why = library.cuda_commit(0)
    result = tapd_cmd("doctor", "--endpoint", f"ipc://{runtime_dir}/none.sock")
    assert result.returncode == 0, result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("CUDA commit")]
    assert f"{variant} ({why})" in line
    if variant == "none":
        assert "no CUDA device" in why
    else:  # a GPU here: one of the three, with the reason
        assert variant in ("stream write", "side-stream host function", "host function"), line
