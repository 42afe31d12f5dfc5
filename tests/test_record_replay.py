"""`tapd record` and `tapd replay` end to end: a real daemon, a JAX emitter process, the
record and replay commands as processes, and subscribers of the real library."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import (
    APPS,
    PROCESS_TIMEOUT,
    Daemon,
    run_emitter,
    stop_process,
    tapd_cmd,
    wait_until,
)
from tapd.tools.recording import read_recording
from tapd_client import Subscriber, TapMeta

DOCS = Path(__file__).parent.parent / "docs" / "RECORDING.md"


class Collector:
    """A subscriber of the real library, in a thread of the test: keeps (value, meta)."""

    def __init__(self, endpoint: str, *names: str) -> None:
        self.taps: list[tuple[Any, TapMeta]] = []
        self.subscriber = Subscriber(endpoint, heartbeat=0.2)
        for name in names or ("*",):
            self.subscriber.add_handler(name, lambda arg, meta: self.taps.append((arg, meta)))
        self.subscriber.connect()
        self.thread = threading.Thread(target=self.subscriber.run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.subscriber.stop()
        self.thread.join(10)
        self.subscriber.close()


@pytest.fixture
def collector() -> Iterator[Callable[..., Collector]]:
    made: list[Collector] = []

    def make(endpoint: str, *names: str) -> Collector:
        made.append(Collector(endpoint, *names))
        return made[-1]

    yield make
    for one in made:
        one.close()


def start_record(daemon: Daemon, directory: Path, *args: str) -> subprocess.Popen[str]:
    before = daemon.subscriber_count()
    process = subprocess.Popen(
        [sys.executable, "-m", "tapd", "record", str(directory), *args,
         "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_until(lambda: daemon.subscriber_count() > before or process.poll() is not None,
               "tapd record to subscribe")  # fmt: skip
    assert process.poll() is None, process.communicate()
    return process


def finish(process: subprocess.Popen[str], signum: int = signal.SIGINT) -> tuple[int, str]:
    if process.poll() is None:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=PROCESS_TIMEOUT)
    return process.returncode, stderr


def record_emitter(endpoint: str) -> dict[str, Any]:
    result = subprocess.run([sys.executable, str(APPS / "record_emitter.py")],
                            env={**os.environ, "TAPD_ENDPOINT": endpoint},
                            capture_output=True, text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    output: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return output


def same_tree(a: Any, b: Any) -> None:
    """Equal values of equal pytree structure, leaf dtypes and shapes."""
    assert type(a) is type(b) or (type(a).__name__ == type(b).__name__ and
                                  isinstance(a, tuple)), (a, b)  # fmt: skip
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same_tree(a[key], b[key])
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same_tree(x, y)
    elif a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


STATIC = ("consumer", "seq", "step", "device", "process", "host", "pid", "transforms",
          "time", "shard")  # fmt: skip


def test_record_then_replay_keeps_values_and_meta(
    start_daemon: Callable[..., Daemon], collector: Callable[..., Collector], tmp_path: Path
) -> None:
    daemon = start_daemon()
    live = collector(daemon.endpoint)
    recording = tmp_path / "run"
    record = start_record(daemon, recording)
    emitted = record_emitter(daemon.endpoint)
    assert emitted["devices"] == 2
    rc, stderr = finish(record)
    assert rc == 0, stderr
    # The progress line, and nothing lost.
    assert re.search(r"recorded 9 taps, [0-9.]+ MB .* dropped 0, seq gaps 0", stderr), stderr

    recorded = list(read_recording(recording))
    assert len(live.taps) == len(recorded) == 9
    by_key = {(m.consumer, m.seq, m.device): (v, m) for v, m in live.taps}
    for tap in recorded:
        header = tap.header
        value, meta = by_key[(header["consumer"], header["seq"], header["device"])]
        same_tree(value, tap.value())
        assert header["emitter"] == meta.emitter
        assert TapMeta.from_header(header) == meta
    params = next(t for t in recorded if t.header["consumer"] == "params")
    assert str(params.value()["w"].dtype) == "bfloat16"
    assert type(params.value()["p"]).__name__ == "Point"
    assert {t.header["consumer"] for t in recorded if t.header["shard"]} == {"shard"}

    replayed = collector(daemon.endpoint)
    result = tapd_cmd("replay", str(recording), "--as-fast-as-possible",
                      "--endpoint", daemon.endpoint)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "replayed 9 taps" in result.stdout and "0 handler errors" in result.stdout
    # Both subscribers still connected see the replay; compare the new one with the live run.
    wait_until(lambda: len(replayed.taps) == 9, "the replayed taps")
    for value, meta in replayed.taps:
        original_value, original = by_key[(meta.consumer, meta.seq, meta.device)]
        same_tree(original_value, value)
        for field in STATIC:
            assert getattr(meta, field) == getattr(original, field), field
        assert meta.meta == {**original.meta, "replayed": True,
                             "recorded_emitter": original.emitter}  # fmt: skip
        assert meta.emitter != original.emitter  # the replayer's, as the daemon names it


def test_replay_only_names_and_at_speed(
    start_daemon: Callable[..., Daemon], collector: Callable[..., Collector], tmp_path: Path
) -> None:
    daemon = start_daemon()
    record = start_record(daemon, tmp_path / "run", "loss")
    run_emitter(daemon.endpoint, "paced", "6", "100")  # six taps over ~0.6 s
    rc, stderr = finish(record, signal.SIGTERM)
    assert rc == 0, stderr
    times = [t.header["time"] for t in read_recording(tmp_path / "run")]
    assert len(times) == 6
    span = (times[-1] - times[0]) / 1e9
    seen = collector(daemon.endpoint, "loss")
    result = tapd_cmd("replay", str(tmp_path / "run"), "loss", "--speed", "0.5",
                      "--endpoint", daemon.endpoint)  # fmt: skip
    assert result.returncode == 0, result.stderr
    seconds = float(re.search(r"in ([0-9.]+) s", result.stdout).group(1))  # type: ignore[union-attr]
    assert seconds >= 1.8 * span, (seconds, span)
    assert [m.seq for _, m in seen.taps] == list(range(6))
    # A name the recording does not have: nothing sent, still a clean exit.
    result = tapd_cmd("replay", str(tmp_path / "run"), "other", "--endpoint", daemon.endpoint)
    assert result.returncode == 0 and "replayed 0 taps" in result.stdout, result.stdout


def test_max_bytes_rotate_keeps_the_newest(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon()
    record = start_record(daemon, tmp_path / "run", "big", "--max-bytes", "2M")
    run_emitter(daemon.endpoint, "steps", "1")  # (compiles JAX once; one unrelated tap)
    run_emitter(daemon.endpoint, "many_bytes", "40", "256")  # 10 MiB in 256 KiB taps
    wait_until(lambda: daemon.stats()["subscribers"][0]["delivered"] >= 40, "40 taps")
    rc, stderr = finish(record)
    assert rc == 0, stderr
    steps = [t.header["step"] for t in read_recording(tmp_path / "run")]
    assert steps == list(range(40 - len(steps), 40)) and 2 <= len(steps) < 40
    on_disk = sum(p.stat().st_size for p in (tmp_path / "run").iterdir())
    assert on_disk <= 2 * 2**20 + 2**20 // 2 + 8192  # the bound, plus a chunk (a quarter)
    assert "rotated out" in stderr


def test_max_bytes_stop_ends_the_recording(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon()
    record = start_record(daemon, tmp_path / "run", "big", "--max-bytes", "2M",
                          "--when-full", "stop")  # fmt: skip
    run_emitter(daemon.endpoint, "many_bytes", "40", "256")
    rc, stderr = finish(record)  # (it stopped by itself: no signal needed)
    assert rc == 0, stderr
    assert "recording stopped" in stderr
    steps = [t.header["step"] for t in read_recording(tmp_path / "run")]
    assert steps == list(range(len(steps))) and 4 <= len(steps) < 8  # the first 2 MiB
    assert sum(p.stat().st_size for p in (tmp_path / "run").iterdir()) <= 2 * 2**20 + 8192


def test_kill_leaves_every_file_readable(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon()
    record = start_record(daemon, tmp_path / "run", "big", "--chunk-bytes", "300K")
    emitter = subprocess.Popen([sys.executable, str(APPS / "emitter_app.py"), "many_bytes",
                                "400", "64"], env={**os.environ, "TAPD_ENDPOINT":
                                daemon.endpoint})  # fmt: skip
    wait_until(lambda: len(list((tmp_path / "run").glob("*.npz"))) >= 3, "some chunks")
    record.send_signal(signal.SIGKILL)  # in the middle of the stream, maybe of a write
    record.communicate(timeout=PROCESS_TIMEOUT)
    stop_process(emitter)  # type: ignore[arg-type]
    taps = list(read_recording(tmp_path / "run"))
    assert len(taps) >= 3
    assert [t.header["step"] for t in taps] == list(range(len(taps)))
    for npz in (tmp_path / "run").glob("*.npz"):  # numpy alone opens every complete one
        with np.load(npz) as arrays:
            assert all(arrays[name].nbytes for name in arrays.files)
    # Recording again into the same directory: numbering goes on, a cut write is swept.
    (tmp_path / "run" / ".000999.npz.tmp").write_bytes(b"PK\x03")
    again = start_record(daemon, tmp_path / "run", "loss")
    run_emitter(daemon.endpoint, "steps", "3")
    assert finish(again)[0] == 0
    after = list(read_recording(tmp_path / "run"))
    assert [t.header["step"] for t in after[: len(taps)]] == list(range(len(taps)))
    assert [t.header["consumer"] for t in after[len(taps) :]] == ["loss"] * 3
    assert not list((tmp_path / "run").glob(".*.tmp"))


def test_docs_snippet_reads_a_recording_without_tapd(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = start_daemon()
    record = start_record(daemon, tmp_path / "run")
    record_emitter(daemon.endpoint)
    assert finish(record)[0] == 0
    snippet = DOCS.read_text().split("```python\n")[1].split("```")[0]
    # tapd cannot be imported by the snippet's process: it reads with numpy (and json) alone.
    program = ("import sys\nsys.modules['tapd'] = sys.modules['tapd_client'] = None\n"
               + snippet.replace("runs/exp1", str(tmp_path / "run"))
               + "\nprint(len(taps), taps[-1]['consumer'], sorted(taps[0]))\n")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("9 shard"), result.stdout
