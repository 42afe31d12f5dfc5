"""Progress bars that a jitted loop's callbacks update and the program closes as soon as
the call returns, without `block_until_ready` (tests/test_bars.py). Each update first
waits for an event that the program sets only once the call has returned: the bar has
nothing when the call returns (the call did not wait for an update; had it waited, the
update would have waited its 60 s out), and what it has when it closes is what the
close waited for. `python bars_app.py SCENARIO` prints one JSON line of results last.

- `closes`: tqdm (imported before tapd's first callback: patched where imported), a
  subclass of it that records at its close, rich's Progress (imported after it: patched
  as it is imported), a class of the program's whose close is `tapd.after_callbacks`,
  and one whose `closed` flag stops its updates, as BlackJAX's does (patched as
  BlackJAX's is, once the bar is open);
  updated through `tapd.install_debug()`'s `jax.debug.callback`, and through `id_tap`
  of a bound method.
- `closed_by_callbacks`: bars that the computation's own callbacks close, as jax-tqdm's
  and NumPyro's last update and Diffrax's close do: from tapd's receiver thread, and
  from inside one of JAX's own host callbacks. Neither waits (each would wait for
  itself: the call would never return).
- `stalled`: an update that waits for an event set only after the close: the close
  gives up after TAPD_CELL_TIMEOUT without a callback run, and says so.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from tqdm import tqdm

import tapd

STEPS = 100
WAIT = 60.0  # s: an update waits this long at most for its event


class RecordingTqdm(tqdm):  # type: ignore[misc]
    """A tqdm bar that notes what it had when it closed."""

    at_close: float | None = None

    def close(self) -> None:
        if self.at_close is None:
            self.at_close = self.n
        super().close()


class OwnBar:
    """A bar of the program's own, not one tapd knows: `tapd.after_callbacks`."""

    def __init__(self) -> None:
        self.n = 0
        self.at_close: int | None = None

    def update(self, n: int = 1) -> None:
        self.n += n

    @tapd.after_callbacks
    def close(self) -> None:
        self.at_close = self.n


class FlagState:
    """A bar's state that stops taking updates once `closed` is set, as BlackJAX's
    `ProgressState` does (tapd makes that flag wait: `_wait_before_closed`)."""

    def __init__(self) -> None:
        self.closed = False
        self.n = 0
        self.at_close: int | None = None

    def update(self, n: int = 1) -> None:
        if not self.closed:
            self.n += n

    def close(self) -> None:
        self.closed = True
        self.at_close = self.n


class Updates:
    """What the loop's callbacks do to the bars: each waits for `go`, then advances
    every bar by one (a bound method: `id_tap` runs it in this process)."""

    def __init__(self, bars: list[Any], go: threading.Event) -> None:
        self.bars, self.go = bars, go
        self.threads: set[str] = set()

    def advance(self, *_: Any) -> None:
        self.go.wait(WAIT)
        self.threads.add(threading.current_thread().name)
        for bar in self.bars:
            bar.update(1)


def loop_with(callback: Any) -> Any:
    def body(i: jax.Array, total: jax.Array) -> jax.Array:
        callback(i)
        return total + i

    return jax.jit(lambda x: lax.fori_loop(0, STEPS, body, x))


def rich_progress() -> tuple[Any, Any]:
    """rich's Progress (imported now), with one task, and a subclass that notes what its
    task had when it stopped."""
    import io

    from rich.console import Console
    from rich.progress import Progress

    class RecordingProgress(Progress):  # type: ignore[misc]
        at_stop: float | None = None

        def stop(self) -> None:
            if self.at_stop is None:
                self.at_stop = self.tasks[0].completed
            super().stop()

    progress = RecordingProgress(console=Console(file=io.StringIO(), force_terminal=True))
    task = progress.add_task("steps", total=STEPS)
    progress.start()
    return progress, task


def one_run(how: str, with_rich: bool) -> dict[str, Any]:
    """Open the bars, run the loop, close them at once; what each had then."""
    go = threading.Event()
    plain, recording, own = tqdm(total=STEPS), RecordingTqdm(total=STEPS), OwnBar()
    flag = FlagState()  # (made before its class is patched, below)
    bars: list[Any] = [plain, recording, own, flag]
    if with_rich:
        progress, task = rich_progress()
        bars.append(_RichTask(progress, task))
    updates = Updates(bars, go)
    if how == "install_debug":
        loop = loop_with(lambda i: jax.debug.callback(updates.advance, i))
    else:
        loop = loop_with(lambda i: tapd.id_tap(updates.advance, i))
    out = loop(jnp.int32(0))  # (no block_until_ready: the close waits, not the call)
    pending = [plain.n, recording.n, own.n, flag.n]  # the call returned before any update
    from tapd.emitter.print_order import bars as tapd_bars

    tapd_bars._wait_before_closed(FlagState, "closed")  # (BlackJAX's: its module is absent)
    go.set()
    plain.close()
    recording.close()
    own.close()
    flag.close()
    got = {"pending": pending, "tqdm": plain.n, "subclass": recording.at_close,
           "own": own.at_close, "flag": flag.at_close}  # fmt: skip
    if with_rich:
        progress.stop()
        got["rich"] = progress.at_stop
    got["out"], got["threads"] = int(out), sorted(updates.threads)
    return got


class _RichTask:
    """One task of a rich Progress, updated as a bar is."""

    def __init__(self, progress: Any, task: Any) -> None:
        self.progress, self.task = progress, task

    def update(self, n: int) -> None:
        self.progress.update(self.task, advance=n)


def closes() -> dict[str, Any]:
    tapd.install_debug()
    assert "rich" not in sys.modules  # (imported once tapd's callbacks are in use)
    return {
        "install_debug": one_run("install_debug", with_rich=True),
        "id_tap": one_run("id_tap", with_rich=False),
    }


def closed_by_callbacks() -> dict[str, Any]:
    """The updates wait for `go`, set once the call has returned: a close that waited
    for them from inside the computation would stall (and say so), and so would one on
    the receiver thread, which runs them."""
    from jax.experimental import io_callback

    tapd.install_debug()  # (io_callback stays JAX's: it runs inside the computation)
    by_tapd, by_jax = RecordingTqdm(total=STEPS), RecordingTqdm(total=STEPS)
    updates = Updates([by_tapd], threading.Event())

    def run(x: jax.Array) -> jax.Array:
        def body(i: jax.Array, total: jax.Array) -> jax.Array:
            jax.debug.callback(updates.advance, i)
            return total + i

        total = lax.fori_loop(0, STEPS, body, x)
        jax.debug.callback(lambda t: by_tapd.close(), total)
        io_callback(lambda t: by_jax.close(), None, total, ordered=True)
        return total

    out = jax.jit(run)(jnp.int32(0))
    pending = by_tapd.n
    updates.go.set()
    jax.effects_barrier()
    return {"pending": pending, "by_tapd": by_tapd.at_close, "by_jax": by_jax.at_close,
            "out": int(out)}  # fmt: skip


def stalled() -> dict[str, Any]:
    tapd.install_debug()
    go = threading.Event()
    recording = RecordingTqdm(total=STEPS)
    updates = Updates([recording], go)
    loop_with(lambda i: jax.debug.callback(updates.advance, i))(jnp.int32(0))
    recording.close()  # (no update runs until `go`: the close gives up)
    at_close = recording.at_close
    go.set()
    tapd.barrier_wait()
    return {"at_close": at_close, "ran": tapd.stats()["local"]["ran"]}


if __name__ == "__main__":
    scenarios = {"closes": closes, "closed_by_callbacks": closed_by_callbacks, "stalled": stalled}
    scenario = scenarios[sys.argv[1]]
    print(json.dumps(scenario()))
