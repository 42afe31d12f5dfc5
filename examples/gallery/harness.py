"""What the gallery's worker puts around a program: every host function it calls
(a `jax.debug.print` line, a `jax.debug.callback`, a host_callback `id_tap`) is recorded
and made to take `delay` seconds, as a slow logger or progress bar would.

- printed lines: `sys.stdout` is a `SlowStdout`, which records each line and sleeps
  `delay` per line (JAX's and tapd's `jax.debug.print` both write one line a `write`);
- callbacks: `jax.debug.callback` is wrapped (in `jax.debug` and `jax._src.debugging`,
  before the program's libraries import it), so that each callback records its
  arguments and sleeps before it runs the program's own function;
- host_callback: in the reference, `jax.experimental.host_callback` is a shim of the
  `jax.debug.callback` calls JAX's migration notes name (`id_tap(f, x)` becomes an
  ordered callback of `f(x, ())`); under `python -m tapd.hcb`, tapd's `id_tap` is
  wrapped as the callbacks are;
- `tap` mode: `jax.debug.print` becomes a `tapd.tap` to the gallery's subscriber
  process (examples/gallery/subscriber.py), which formats, sleeps and records the line.

Nothing here is timed: the worker times the program's own call.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

TAP_PRINT_CONSUMER = "gallery.print"


class Recorder:
    """The host calls of the current run, in the order they ran, and their delay."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.lock = threading.Lock()
        self.calls: list[str] = []

    def record(self, entry: str) -> None:
        with self.lock:
            self.calls.append(entry)
        if self.delay:
            time.sleep(self.delay)

    def take(self) -> list[str]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


RECORDER = Recorder()


def plain(value: Any) -> Any:
    """A callback's arguments as text-able lists (arrays to nested lists)."""
    import jax

    return jax.tree_util.tree_map(lambda leaf: np.asarray(leaf).tolist(), value)


class SlowStdout:
    """`sys.stdout` for a gallery run: each complete line is recorded (and takes
    `RECORDER.delay`); everything goes on to `stream` (a log) as written."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.partial = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.partial += text
            *lines, self.partial = self.partial.split("\n")
        for line in lines:
            RECORDER.record("print: " + line)
        self.stream.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def recorded(function: Callable[..., Any], kind: str = "callback") -> Callable[..., Any]:
    """`function`, recording its arguments and taking `RECORDER.delay` first."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        RECORDER.record(f"{kind}: {plain((args, kwargs))!r}")
        return function(*args, **kwargs)

    return call


def wrap_debug_callback() -> None:
    """Every `jax.debug.callback` from now on runs its function through `recorded`
    (whichever `jax.debug.callback` is installed: JAX's, or tapd's after
    `python -m tapd.debug`)."""
    import jax.debug
    from jax._src import debugging

    current = jax.debug.callback

    @functools.wraps(current)
    def callback(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return current(recorded(function), *args, **kwargs)

    jax.debug.callback = callback
    debugging.debug_callback = callback


def install_host_callback_shim() -> None:
    """The reference for programs written for host_callback (removed in JAX 0.8):
    `id_tap(f, x)` as the ordered `jax.debug.callback` of `f(x, ())` that JAX's notes
    suggest in its place; `barrier_wait` as `jax.effects_barrier`."""
    import jax
    import jax.experimental

    def id_tap(tap_func: Callable[..., Any], arg: Any, *, result: Any = None, **_: Any) -> Any:
        jax.debug.callback(lambda value: tap_func(value, ()), arg, ordered=True)
        return arg if result is None else result

    shim = types.ModuleType("jax.experimental.host_callback")
    shim.id_tap = id_tap  # type: ignore[attr-defined]
    shim.barrier_wait = lambda logging_name=None: jax.effects_barrier()  # type: ignore[attr-defined]
    sys.modules[shim.__name__] = shim
    jax.experimental.host_callback = shim  # type: ignore[attr-defined]


def wrap_tapd_id_tap() -> None:
    """Under `python -m tapd.hcb`: tapd's `id_tap` (what `jax.experimental.host_callback`
    gives) records and slows its tap functions as the callbacks are."""
    import tapd
    import tapd.hcb

    current = tapd.hcb.id_tap

    @functools.wraps(current)
    def id_tap(tap_func: Callable[..., Any], arg: Any, **kwargs: Any) -> Any:
        def tap(value: Any, transforms: Any) -> Any:
            RECORDER.record(f"callback: {plain(((value,), {}))!r}")
            return tap_func(value, transforms)

        return current(tap, arg, **kwargs)

    tapd.hcb.id_tap = id_tap
    tapd.id_tap = id_tap


def tap_prints() -> None:
    """`jax.debug.print(fmt, *args, **kwargs)` as `tapd.tap` of its arguments to the
    gallery's subscriber, the format string as the tap's metadata."""
    import jax.debug
    from jax._src import debugging

    import tapd

    def print_by_tap(fmt: str, *args: Any, ordered: bool = False, **kwargs: Any) -> None:
        kwargs.pop("partitioned", None)
        tapd.tap({"args": list(args), "kwargs": kwargs}, TAP_PRINT_CONSUMER, fmt=fmt)

    jax.debug.print = print_by_tap
    debugging.debug_print = print_by_tap
