"""Start the daemon and the subscriber as real processes, train, report, clean up."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from tapd.clients import control
from tapd.errors import TapdError
from tapd.runtime import default_endpoint


def _wait_for(what: str, condition: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return
        time.sleep(0.05)
    raise TapdError(f"gave up waiting for {what} after {timeout:g} s")


def _daemon_answers(endpoint: str) -> bool:
    try:
        control.stats(endpoint, timeout=0.2)
        return True
    except TimeoutError:
        return False


def _subscribed(endpoint: str, consumer: str) -> bool:
    stats = control.stats(endpoint, timeout=1.0)
    return any(consumer in s["consumers"] for s in stats["subscribers"])


@contextlib.contextmanager
def _process(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(argv)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def run_demo(steps: int) -> int:
    endpoint = default_endpoint()
    with contextlib.ExitStack() as stack:
        if _daemon_answers(endpoint):
            print(f"demo: using the tapd daemon already running at {endpoint}")
        else:
            print(f"demo: starting the tapd daemon at {endpoint}")
            daemon_argv = [sys.executable, "-m", "tapd", "--log-level", "warning", "start"]
            stack.enter_context(_process(daemon_argv))
            _wait_for("the daemon", lambda: _daemon_answers(endpoint))
        print("demo: starting a subscriber process (tapd.demo.watch)")
        stack.enter_context(_process([sys.executable, "-m", "tapd.demo.watch"]))
        _wait_for("the subscriber", lambda: _subscribed(endpoint, "grad_norm"))

        import tapd
        from tapd.demo.train import train

        print(f"demo: training {steps} steps (jit + lax.scan), tapping loss and grad_norm")
        started = time.perf_counter()
        final_loss = train(steps)
        trained = time.perf_counter() - started
        tapd.barrier_wait(timeout=60)
        waited = time.perf_counter() - started - trained
        counts = tapd.stats()
    dropped = counts["dropped"] + counts["daemon_dropped"]
    print(
        f"demo: final loss {final_loss:.5f}; training took {trained:.2f} s, the barrier "
        f"{waited:.3f} s more (backend: {tapd.backend()})\n"
        f"demo summary: taps sent {counts['sent']} / delivered {counts['delivered']} / "
        f"dropped {dropped} / unrouted {counts['unrouted']} / handler errors {counts['errors']}"
    )
    ok = counts["sent"] == counts["delivered"] and dropped == 0 and not counts["unrouted"]
    return 0 if ok else 1
