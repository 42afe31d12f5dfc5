"""A child process that renders `id_print`'s arrays for this process's receiver thread.

`id_print` in a hot loop spends ~70 µs of Python a tap in `numpy.array2string` (16
floats). On the receiver thread that time is taken from the loop through the GIL: a
3.8 µs step printed every call ran 16x slower (bench/RESULTS.md §9). The receiver
therefore sends a long run of one site's taps (their stacked array and numpy's print
options) to this worker, which renders each tap's text as `tapd.printing.render` would
in the JAX process, on another core. The receiver then writes the lines itself, in
order, to the site's stream (or stdout, or a notebook cell), as if it had rendered them.

Only what renders alike in both processes comes here: one array per tap, at most
`MAX_TAP_BYTES` of it, under print options that can be sent (no `formatter`). A few taps
at a time are rendered in the JAX process (starting the worker, ~0.2 s, pays only for a
loop), and so is everything while it starts and everything after it failed once
(logged). `TAPD_PRINT_WORKER` (docs/SETTINGS.md) says when it is used. The worker runs
at nice 10: where the JAX process wants every core, the step comes first.

The pipe carries length-prefixed msgpack messages, arrays as raw bytes; no pickle. The
worker imports numpy and tapd.printing, not JAX, and exits when the JAX process does
(its stdin closes).
"""

from __future__ import annotations

import logging
import os
import select
import struct
import subprocess
import sys
import time
from typing import Any

import msgpack
import numpy as np

from tapd.protocol.dtypes import dtype_from_name, dtype_name

logger = logging.getLogger("tapd.emitter")

MAX_TAP_BYTES = 16 * 1024  # larger arrays are summarized by numpy: cheap to render here
_LENGTH = struct.Struct("<I")
_READY = b"tapd-print-worker ready\n"
_REPLY_TIMEOUT = 60.0  # s: a worker this late is killed (its runs are rendered here)


def _unsendable(options: dict[str, Any]) -> bool:
    """Print options the worker could not apply as this process does (callables)."""
    return options.get("formatter") is not None or options.get("override_repr") is not None


class PrintWorker:
    """The JAX process's side: starts the worker at the first run that asks, then asks
    it for runs' texts; None wherever the run is to be rendered here."""

    def __init__(self, mode: str) -> None:
        self.mode = mode  # "auto", "always" or "never" (TAPD_PRINT_WORKER)
        self._process: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._broken = mode == "never"
        self._options: dict[str, Any] | None = None  # the last sent
        self.rendered = 0  # taps whose text the worker rendered

    def texts(self, leaf: np.ndarray, threshold: int | None, *, many: bool) -> list[str] | None:
        """Each row of `leaf` (one tap's array each) as `tapd.printing.render` gives
        it, rendered by the worker; None: render them here (`many`: whether the run is
        long enough to be worth the worker, under `auto`)."""
        if self._broken or not (many or self.mode == "always"):
            return None
        if leaf.dtype.hasobject or leaf[0].nbytes > MAX_TAP_BYTES:
            return None
        options: dict[str, Any] = dict(np.get_printoptions())
        if _unsendable(options):
            return None
        try:
            if not self._started():
                return None
            request = {
                "options": options if options != self._options else None,
                "threshold": threshold,
                "dtype": dtype_name(leaf.dtype),
                "shape": list(leaf.shape),
                "data": np.ascontiguousarray(leaf).tobytes(),
            }
            self._send(request)
            self._options = options
            reply = self._receive()
        except Exception as exc:
            self._give_up(f"{type(exc).__name__}: {exc}")
            return None
        texts: list[str] = reply.get("texts", [])
        if len(texts) != len(leaf):
            self._give_up(reply.get("error") or f"it rendered {len(texts)} texts of {len(leaf)}")
            return None
        self.rendered += len(texts)
        return texts

    def close(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        try:
            if process.stdin is not None:
                process.stdin.close()  # the worker exits at end of input
        except OSError:  # (it is gone: what was left for it goes nowhere)
            pass
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()

    def _started(self) -> bool:
        """Whether the worker is ready; starts it if it is not running. Under `auto`
        the runs that come while it starts are rendered here; `always` waits for it."""
        if self._ready:
            return True
        if self._process is None:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tapd.print_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,  # (what it says goes where this process's stderr goes)
            )
        assert self._process.stdout is not None
        wait = _REPLY_TIMEOUT if self.mode == "always" else 0.0
        if not _readable(self._process.stdout.fileno(), wait):
            if self._process.poll() is not None:
                raise RuntimeError(f"it exited with code {self._process.returncode}")
            return False
        greeting = self._process.stdout.readline()
        if greeting != _READY:
            raise RuntimeError(f"it said {greeting[:80]!r} instead of being ready")
        self._ready = True
        return True

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process is not None and self._process.stdin is not None
        body = msgpack.packb(message, use_bin_type=True)
        self._process.stdin.write(_LENGTH.pack(len(body)) + body)
        self._process.stdin.flush()

    def _receive(self) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        stream = self._process.stdout
        deadline = time.monotonic() + _REPLY_TIMEOUT
        if not _readable(stream.fileno(), _REPLY_TIMEOUT):
            raise TimeoutError(f"no reply in {_REPLY_TIMEOUT:g} s")
        (length,) = _LENGTH.unpack(_read_exactly(stream, _LENGTH.size, deadline))
        reply: dict[str, Any] = msgpack.unpackb(_read_exactly(stream, length, deadline))
        return reply

    def _give_up(self, reason: str) -> None:
        logger.warning(
            "tapd's print worker failed (%s); id_print renders in this process from now on",
            reason,
        )
        self._broken = True
        process = self._process
        if process is not None and process.poll() is None:
            process.kill()
        self.close()


def _readable(fd: int, timeout: float) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)


def _read_exactly(stream: Any, count: int, deadline: float) -> bytes:
    parts = []
    while count:
        if not _readable(stream.fileno(), max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the reply stopped half way")
        part = stream.read1(count)
        if not part:
            raise EOFError("it exited half way through a reply")
        parts.append(part)
        count -= len(part)
    return b"".join(parts)


# ---- the worker process ------------------------------------------------------------------


def _render(request: dict[str, Any]) -> list[str]:
    from tapd.printing import render

    dtype = dtype_from_name(request["dtype"])
    leaf = np.frombuffer(request["data"], dtype).reshape(request["shape"])
    threshold = request["threshold"]
    return [render(leaf[i, ...], threshold=threshold) for i in range(len(leaf))]


def main() -> None:
    # Below the JAX process's threads: where they want every core, the step goes first
    # and the lines come a little later.
    os.nice(10)
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    sink.write(_READY)
    sink.flush()
    while header := source.read(_LENGTH.size):
        (length,) = _LENGTH.unpack(header)
        request = msgpack.unpackb(source.read(length))
        if request["options"] is not None:
            np.set_printoptions(**request["options"])
        try:
            reply: dict[str, Any] = {"texts": _render(request)}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        body = msgpack.packb(reply, use_bin_type=True)
        sink.write(_LENGTH.pack(len(body)) + body)
        sink.flush()


if __name__ == "__main__":
    main()
