"""A JAX process for tests/test_held_host_function.py (and tests/tpu): a computation of
the loop shapes real solvers have runs to its end while the host function its taps call
is held, as a slow printer or progress bar would hold it (issue 62).

    python tests/apps/held_host_app.py [SHAPE ...]    # default: every shape

Under `tapd.install_debug()`. Each shape is a jitted program whose `jax.debug` calls lie
in loops of unknown length (a `while` whose trip count is traced), nested such loops, a
`cond`, or equinox's bounded loop (nested `scan`s of `cond`s, written out here). Its
first host function (`jax.debug.callback`, or `jax.debug.print`'s write to stdout)
holds until the program lets it go: the first call, and a second call made once the
function is held, must each return (`block_until_ready`) while it is held: their taps,
their flushes and the host's answers to their paced chunks may not wait for it. A
watchdog lets the function go after `HOLD_LIMIT` seconds, so that a wait shows as a
failure, not a hang.
Then every call's values must arrive, in program order.

Prints one JSON line: per shape, whether the function was entered, whether each call
returned while it was held, and what arrived against what was due.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any

import tapd

tapd.install_debug()  # (as `python -m tapd.debug` does: before the program's imports)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

HOLD_LIMIT = 60.0  # s: calls that need longer wait for the held function
ENTER_LIMIT = 120.0  # s: the first call's taps must reach the function by then
OUTER, INNER = 12, 5  # the loops' trip counts (traced: unknown when compiled)


class Gate:
    """Holds the first host call until `release`; counts what arrived."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()
        self.arrived: list[Any] = []

    def hold_first(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            self.released.wait()  # (the watchdog lets it go, at the latest)


gate = Gate()


def callback(*values: Any) -> None:
    gate.arrived.append([int(np.asarray(v)) for v in values])
    gate.hold_first()


class HeldStdout:
    """stdout whose first line's write holds (a printer that hangs); records lines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        if "\n" in text:
            gate.arrived.extend(line for line in text.splitlines() if line)
            gate.hold_first()
        return len(text)

    def flush(self) -> None:
        pass


def inner_sum(trips: Any) -> Any:
    """0 + 1 + ... + (trips - 1), by a `while` of `trips` steps (unknown length)."""
    return lax.while_loop(lambda s: s[0] < trips, lambda s: (s[0] + 1, s[1] + s[0]), (0, 0))[1]


def nested_while(n: Any, m: Any) -> Any:
    """An outer `while` of unknown length tapping each step; an inner one in each."""

    def body(c: Any) -> Any:
        i, total = c
        j = inner_sum(m + i % 3)
        jax.debug.callback(callback, i, j)
        return i + 1, total + j

    return lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]


def print_nested_while(n: Any, m: Any) -> Any:
    """The same, through `jax.debug.print` (optimistix's verbose solver's shape)."""

    def body(c: Any) -> Any:
        i, total = c
        j = inner_sum(m + i % 3)
        jax.debug.print("step {i} inner {j}", i=i, j=j)
        return i + 1, total + j

    return lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]


def tap_in_cond(n: Any, m: Any) -> Any:
    """The tap inside a `cond` (every other step) of an outer `while`."""

    def body(c: Any) -> Any:
        i, total = c
        j = inner_sum(m + i % 3)
        lax.cond(i % 2 == 0, lambda: jax.debug.callback(callback, i, j), lambda: None)
        return i + 1, total + j

    return lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]


def tap_in_inner_while(n: Any, m: Any) -> Any:
    """The tap inside an inner `while` of unknown length, in a `cond` there."""

    def inner(i: Any) -> Any:
        def step(s: Any) -> Any:
            k, total = s
            lax.cond(k == i % 2, lambda: jax.debug.callback(callback, i, k), lambda: None)
            return k + 1, total + k

        return lax.while_loop(lambda s: s[0] < m, step, (0, 0))[1]

    def body(c: Any) -> Any:
        i, total = c
        return i + 1, total + inner(i)

    return lax.while_loop(lambda c: c[0] < n, body, (0, 0))[1]


def bounded(n: Any, m: Any) -> Any:
    """equinox's bounded `while_loop` (kind="bounded", as Diffrax's DirectAdjoint runs
    its steps): nested `scan`s of a `cond` that steps while the predicate holds, the
    tap in the step, with a buffer carried and written each step (its `buffers=`)."""
    levels, base = 2, 4  # (16 steps at most)

    def step(c: Any) -> Any:
        i, buffer = c
        j = inner_sum(m + i % 3)
        jax.debug.callback(callback, i, j)
        return i + 1, buffer.at[i].set(j)

    def maybe_step(c: Any) -> Any:
        return lax.cond(c[0] < n, step, lambda c: c, c)

    def level(depth: int) -> Callable[[Any], Any]:
        if depth == 0:
            return maybe_step
        below = level(depth - 1)
        return lambda c: lax.scan(lambda c, _: (below(c), None), c, None, length=base)[0]

    return level(levels)((0, jnp.zeros(base**levels, jnp.int32)))[1].sum()


SHAPES: dict[str, Callable[[Any, Any], Any]] = {
    "nested_while": nested_while,
    "print_nested_while": print_nested_while,
    "tap_in_cond": tap_in_cond,
    "tap_in_inner_while": tap_in_inner_while,
    "bounded": bounded,
}


def due(shape: str, n: int, m: int) -> list[Any]:
    """What one call's host functions get, in program order."""
    sums = [sum(range(m + i % 3)) for i in range(n)]
    if shape == "print_nested_while":
        return [f"step {i} inner {sums[i]}" for i in range(n)]
    if shape == "tap_in_cond":
        return [[i, sums[i]] for i in range(0, n, 2)]
    if shape == "tap_in_inner_while":
        return [[i, i % 2] for i in range(n)]
    return [[i, sums[i]] for i in range(min(n, 16))]


def run(shape: str) -> dict[str, Any]:
    global gate
    gate = Gate()
    program = jax.jit(SHAPES[shape])
    n, m = jnp.int32(OUTER), jnp.int32(INNER)
    watchdog = threading.Timer(HOLD_LIMIT, gate.released.set)
    watchdog.start()
    returned = []  # per call: whether it returned while the function was held
    program(n, m).block_until_ready()  # (compiled; its first tap holds the function)
    returned.append(not gate.released.is_set())
    entered = gate.entered.wait(ENTER_LIMIT)
    program(n, m).block_until_ready()
    returned.append(not gate.released.is_set())
    watchdog.cancel()
    gate.released.set()
    jax.effects_barrier()
    return {
        "entered": entered,
        "returned_while_held": returned,
        "arrived": gate.arrived,
        "due": due(shape, OUTER, INNER) * 2,
    }


def main() -> None:
    shapes = sys.argv[1:] or list(SHAPES)
    out = sys.stdout
    sys.stdout = HeldStdout(out)
    results = {shape: run(shape) for shape in shapes}
    sys.stdout = out
    host_callbacks = tapd.stats().get("host_callbacks", 0)
    print(json.dumps({"results": results, "host_callbacks": host_callbacks}))


if __name__ == "__main__":
    main()
