"""`tapd record`: a subscriber that writes every tap it is given to a recording
(tapd/tools/recording.py, docs/RECORDING.md).

`Recorder` is a batch handler (`sub.add_handler("loss", Recorder(path))` in a program of
one's own, or `tapd record DIR loss`): each TapBatch, the taps of one site that arrived
together, is kept as one group with its leaves stacked, and written as one array per
leaf (tapd/tools/recording.py). It keeps the taps of the chunk being filled in memory,
bounded by `chunk_bytes`, and hands the chunk to a writer thread of its own when it is
full, once a second (from the subscriber's idle tick, `expire`), and at `close()`; at
most one more chunk waits for that thread, so receiving goes on while a chunk is
written. Under `max_bytes` it either removes the oldest chunks (`when_full="rotate"`)
or stops taking taps (`"stop"`: `full` turns true and the taps refused are counted in
`refused`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tapd.tools.recording import ChunkWriter, Group
from tapd_client.batch import TapBatch

WHEN_FULL = ("rotate", "stop")
_OVERHEAD = 1024  # bytes on disk per tap besides its arrays (index line, npz entry), at most


@dataclasses.dataclass
class RecordStats:
    taps: int = 0  # recorded (written, or in the chunk being filled)
    bytes: int = 0  # array bytes of those
    written_bytes: int = 0  # on disk now (after rotation)
    chunks: int = 0  # written
    rotated_chunks: int = 0  # removed by rotation
    refused: int = 0  # not recorded: the recording was full under "stop"
    gaps: int = 0  # taps missing by their seq (per emitter, device, consumer)
    failed: int = 0  # recorded but not written: the disk refused (see Recorder.error)


class Recorder:
    """A handler that records the taps it is given into `directory`."""

    takes_batch = True  # the subscriber passes TapBatches

    def __init__(
        self,
        directory: str | Path,
        *,
        consumers: tuple[str, ...] = (),
        chunk_bytes: int = 64 * 2**20,
        flush_every: float = 1.0,
        max_bytes: int | None = None,
        when_full: str = "rotate",
        on_full: Callable[[], None] | None = None,
    ) -> None:
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        if max_bytes is not None:
            if max_bytes <= 0:
                raise ValueError(f"max_bytes must be positive, got {max_bytes}")
            chunk_bytes = max(1, min(chunk_bytes, max_bytes // 4))
        self.writer = ChunkWriter(Path(directory), consumers=consumers)
        self.chunk_bytes = chunk_bytes
        self.flush_every = flush_every
        self.max_bytes = max_bytes
        self.when_full = when_full
        self.on_full = on_full
        self.full = False
        self.stats = RecordStats(written_bytes=self.writer.size())
        self._chunk: list[Group] = []
        self._chunk_bytes = 0
        self._chunk_started = time.monotonic()
        self._next_seq: dict[tuple[str, int | None, str], int] = {}
        self.error: Exception | None = None
        self._accepted_bytes = self.stats.written_bytes  # (stop: array bytes, index aside)
        self._lock = threading.Lock()
        self._writing: queue.Queue[list[Group] | None] = queue.Queue(maxsize=1)
        self._thread = threading.Thread(
            target=self._write_chunks, name="tapd-record-writer", daemon=True
        )
        self._thread.start()

    def __call__(self, batch: TapBatch) -> None:
        count = len(batch)
        leaves = batch.leaves
        per_tap = sum(leaf.nbytes for leaf in leaves) // count  # (one site: all alike)
        taken = count
        if self.full:
            taken = 0
        elif self.when_full == "stop" and self.max_bytes is not None:
            # Tap i (from 0) fits if accepted + i * (per_tap + overhead) + per_tap <= max,
            # as when taps came one at a time.
            room = self.max_bytes - self._accepted_bytes - per_tap
            taken = 0 if room < 0 else min(count, room // (per_tap + _OVERHEAD) + 1)
        if taken:
            self._keep(batch, taken, per_tap)
        if taken < count:
            self.stats.refused += count - taken
            if not self.full:
                self.full = True
                self.flush()
                if self.on_full is not None:
                    self.on_full()

    def _keep(self, batch: TapBatch, count: int, per_tap: int) -> None:
        """Keep the first `count` taps of `batch` in the chunk being filled."""
        emitter, consumer = batch.meta.emitter, batch.consumer
        for seq, device in zip(
            batch.seq[:count].tolist(), batch.device[:count].tolist(), strict=True
        ):
            key = (emitter, device, consumer)
            expected = self._next_seq.get(key, seq)
            if seq > expected:
                self.stats.gaps += seq - expected
            self._next_seq[key] = max(expected, seq + 1)
        headers = batch.headers()[:count]
        for header in headers:
            header["emitter"] = emitter  # (a tap that came alone may lack it)
        # A chunk holds at most chunk_bytes, or one tap if a tap is larger: a batch (up
        # to many MiB of a same-host subscriber's ring taps) is cut to fit, so that
        # rotation, which keeps whole chunks within max_bytes, always keeps the newest.
        start = 0
        while start < count:
            room = max(1, (self.chunk_bytes - self._chunk_bytes) // max(per_tap, 1))
            stop = min(count, start + room)
            # The leaves view the received message; the chunk keeps them until written.
            self._chunk.append((headers[start:stop], [leaf[start:stop] for leaf in batch.leaves]))
            nbytes = per_tap * (stop - start)
            self._chunk_bytes += nbytes
            self.stats.taps += stop - start
            self.stats.bytes += nbytes
            self._accepted_bytes += nbytes + _OVERHEAD * (stop - start)
            if self._chunk_bytes >= self.chunk_bytes:
                self.flush()
            start = stop

    def expire(self) -> None:
        """The subscriber's idle tick: write a chunk that has waited `flush_every`."""
        if self._chunk and time.monotonic() - self._chunk_started >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Hand the chunk being filled (if any) to the writer thread, which writes it and
        then rotates under `max_bytes`. At most one chunk waits for it: the next flush
        waits for that one, so memory stays within two chunks."""
        if self._chunk:
            self._writing.put(self._chunk)  # (blocks while one chunk already waits)
        self._chunk = []
        self._chunk_bytes = 0
        self._chunk_started = time.monotonic()

    def _write_chunks(self) -> None:
        while (chunk := self._writing.get()) is not None:
            try:
                written = self.writer.write(chunk)
                with self._lock:
                    self.stats.written_bytes += written
                    self.stats.chunks += 1
                if self.when_full == "rotate" and self.max_bytes is not None:
                    self._rotate(self.max_bytes)
            except Exception as exc:  # e.g. the disk is full: said by close(), and counted
                with self._lock:
                    self.stats.failed += len(chunk)
                    self.error = self.error or exc
            finally:
                self._writing.task_done()

    def _rotate(self, limit: int) -> None:
        while self.stats.written_bytes > limit and self.stats.chunks > 1:
            freed = self.writer.remove_oldest()
            if not freed:
                break
            with self._lock:
                self.stats.written_bytes -= freed
                self.stats.rotated_chunks += 1

    def sync(self) -> None:
        """Return once every chunk handed over so far is on disk."""
        self._writing.join()

    def close(self) -> None:
        """Write what is held, wait for it, and stop the writer thread. Raises OSError if
        a chunk could not be written."""
        self.flush()
        self._writing.put(None)
        self._thread.join()
        if self.error is not None:
            raise OSError(
                f"tapd record: {self.stats.failed} taps could not be written to "
                f"{self.writer.directory}: {self.error}"
            ) from self.error


class Progress:
    """The live line `tapd record` keeps on stderr: taps, MB, rate, drops."""

    def __init__(self, write: Callable[[str], Any], *, tty: bool, every: float = 1.0) -> None:
        self._write = write
        self._tty = tty
        self._every = every
        self._last = time.monotonic()
        self._last_bytes = 0
        self._rate = 0.0
        self._width = 0

    def due(self) -> bool:
        return time.monotonic() - self._last >= self._every

    def show(self, stats: RecordStats, dropped: int | None, *, final: bool = False) -> None:
        now = time.monotonic()
        if now > self._last:
            self._rate = (stats.bytes - self._last_bytes) / (now - self._last)
        self._last, self._last_bytes = now, stats.bytes
        drops = "?" if dropped is None else str(dropped)
        line = (
            f"recorded {stats.taps} taps, {stats.bytes / 1e6:.1f} MB "
            f"({stats.written_bytes / 1e6:.1f} MB on disk, {stats.chunks} chunks), "
            f"{self._rate / 1e6:.1f} MB/s, dropped {drops}, seq gaps {stats.gaps}"
        )
        if stats.rotated_chunks:
            line += f", rotated out {stats.rotated_chunks} chunks"
        if stats.refused:
            line += f", full: {stats.refused} taps not recorded"
        if self._tty:
            pad = max(0, self._width - len(line))
            self._width = len(line)
            self._write("\r" + line + " " * pad + ("\n" if final else ""))
        else:
            self._write(line + "\n")
