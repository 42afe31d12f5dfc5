"""A long loop's taps, live: they reach the host within `gather_latency` seconds,
whatever the loop's step time (issue 51).

A gathered loop used to flush when its log filled, after a count of taps: at 1.4 ms a
step and 1024 taps a log, a progress bar inside it froze for 1.5 s, then jumped; at
100 ms a step, nothing arrived before the loop ended. The device has no clock, so the
host paces it instead. A live loop runs in chunks of at most `interval` steps, a value
the loop carries; each chunk ends with a host callback that writes the chunk's taps
(a flush) or, where it logged none, only asks (a poll). Either answers with the sites'
fresh wake flags and the next `interval`, which the host (`Pace`) sets from the time
the chunk took: as many steps as half the latency holds. So a site woken while the loop
runs takes its taps from the next chunk, and a dormant site's taps move nothing.
Where the log fills before the chunk's steps are run, its flush only sends (the device
goes on without waiting for the host, which on a TPU would stall the loop for the copy
of the whole log) and the chunk goes on.

A loop's first chunk, before anything is known of its step time, is one step, the
next two; the host then knows. It remembers the step time across calls (the interval
also comes in with the wake flags, `tapd.emitter.taps_as_outputs`), so a call of a
loop it has seen starts at its pace.

On a TPU an executable that holds any host callback costs ~2 ms a call more, even one
never run (tpu_live_probe, retired), and a callback that runs ~0.7 ms, with or without a
result. So only a loop that runs long is live (`is_live`): a `while`, a loop whose taps
overflow the log (it flushes anyway), or one whose work, estimated from its equations
at the device's peak rates and its host callbacks at their least cost
(`estimated_seconds`), takes at least a quarter of the latency. A short loop keeps no
callback: its taps leave with the computation's output. (A loop whose taps are counted
before it runs takes them in one log where they fit `gather_log_bytes`, unless it may
run long: tapd.emitter.gathered.choose.plan_buffers.)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax
from jax._src import core

# Peak rates (operations a second, bytes a second) a loop's work is estimated at: the
# fast side of each device kind (a TPU v5e: 197 TFLOP/s in bf16, 819 GB/s), so that a
# loop estimated long is long; one underestimated keeps today's path, flushed at its end.
PEAK_RATES = {"tpu": (2e14, 8e11), "gpu": (2e14, 2e12), "cpu": (2e11, 5e10)}
# The least a host callback costs each time it runs (a TPU's is a transfer, 0.4-1 ms:
# docs/TAPPING.md; a CPU's no-op `jax.debug.callback` ~100 µs): a loop of many steps
# that each call the host (`io_callback`, `pure_callback`, `jax.debug`) is long, however
# little its arithmetic.
CALLBACK_SECONDS = {"tpu": 4e-4, "gpu": 3e-5, "cpu": 5e-5}
CALLBACKS = frozenset({"io_callback", "pure_callback", "debug_callback"})
LONG_FRACTION = 0.25  # a loop estimated at this share of the latency is live
SLACK = 0.5  # a chunk is paced at this share of the latency (a flush takes time too)
MOST_STEPS = 2**30  # the interval where nothing bounds it (latency 0: off)


def estimated_seconds(jaxpr: core.Jaxpr, platform: str) -> float:
    """The least time one run of `jaxpr` could take on `platform` (inf where a `while`
    loop runs: its trip count is not known): its arithmetic and bytes at the device's
    peak rates, its host callbacks at their least cost."""
    flops_rate, bytes_rate = PEAK_RATES.get(platform, PEAK_RATES["cpu"])
    total = 0.0
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "while":
            return math.inf
        if name == "scan":
            total += params["length"] * estimated_seconds(params["jaxpr"].jaxpr, platform)
        elif name == "cond":
            total += max(estimated_seconds(b.jaxpr, platform) for b in params["branches"])
        elif subs := list(core.jaxprs_in_params(params)):
            total += sum(estimated_seconds(sub, platform) for sub in subs)
        elif name == "dot_general":
            total += _dot_flops(eqn) / flops_rate
        elif name in CALLBACKS:
            total += CALLBACK_SECONDS.get(platform, CALLBACK_SECONDS["cpu"])
        else:
            total += sum(_bytes(var.aval) for var in eqn.outvars) / bytes_rate
    return total


def _dot_flops(eqn: core.JaxprEqn) -> float:
    (contracting, _), _ = eqn.params["dimension_numbers"]
    lhs: Any = eqn.invars[0].aval
    out: Any = eqn.outvars[0].aval
    reduced = math.prod(int(lhs.shape[d]) for d in contracting)
    return 2.0 * float(math.prod(out.shape)) * reduced


def _bytes(aval: Any) -> float:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0.0
    return float(math.prod(shape)) * float(np.dtype(dtype).itemsize)


def is_live(loop_seconds: float, overflows: bool, latency: float) -> bool:
    """Whether a loop (estimated at `loop_seconds`; whose taps `overflows` the log) is
    run in paced chunks."""
    return latency > 0 and (overflows or loop_seconds >= LONG_FRACTION * latency)


# ---- the host's side ----------------------------------------------------------------------


class Pace:
    """The steps a live chunk runs, learned from the time chunks take: one per gathered
    computation (its flushes and polls answer from it, and so do its wake flags)."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.step_seconds: float | None = None  # the last chunk's time a step
        self._last = 0.0  # when the last answer was given
        self._lock = threading.Lock()

    def interval(self) -> int:
        """Steps a chunk, at the pace known (one where none is)."""
        if self.latency <= 0:
            return MOST_STEPS
        if self.step_seconds is None:
            return 1
        steps = SLACK * self.latency / max(self.step_seconds, 1e-9)
        # (a power of two: a steady loop keeps one value, so its wake flags stay put)
        return int(min(MOST_STEPS, 2 ** math.floor(math.log2(max(steps, 1.0)))))

    def answered(self, steps: int, polls: int) -> int:
        """A chunk of `steps` ended (the call's answer number `polls`): the next interval."""
        now = time.perf_counter()
        with self._lock:
            if polls > 0 and steps > 0:  # (the time since this call's last answer)
                self.step_seconds = (now - self._last) / steps
                self._last = now
                return self.interval()
            self._last = now
            if self.step_seconds is None and steps > 0:
                return min(MOST_STEPS, 2 * steps)  # (nothing known yet: twice as long)
            return self.interval()


# ---- the device's side --------------------------------------------------------------------


def scan(
    rewriter: Any,
    params: dict[str, Any],
    consts: list[Any],
    carry: list[Any],
    xs: list[Any],
    state: Any,
    per_step: int,
) -> tuple[list[Any], Any]:
    """A `scan` with taps, run live: one loop over its steps, each begun by `_chunk_step`
    (an answer where the chunk's paced steps have run, a flush where the log has no
    room), then run unchecked."""
    body = params["jaxpr"]
    length, reverse = int(params["length"]), bool(params["reverse"])
    carry_count = len(carry)
    y_avals = [var.aval for var in body.jaxpr.outvars[carry_count:]]
    room = _room(rewriter, per_step)
    ys = [lax.full((length, *a.shape), 0, a.dtype) for a in y_avals]
    state = rewriter.flush_if(state.count > 0, state)

    def step(loop: tuple[Any, ...]) -> tuple[Any, ...]:
        i, start, values, ys, st = loop  # (start: the chunk's first step)
        start, st = _chunk_step(rewriter, room, i - start >= st.interval, i, start, st)
        at = np.int32(length - 1) - i if reverse else i
        x = [lax.dynamic_index_in_dim(x, at, 0, keepdims=False) for x in xs]
        outs, st = rewriter.run(body.jaxpr, body.consts, [*consts, *values, *x], st, False)
        ys = [
            lax.dynamic_update_index_in_dim(y, out, at, 0)
            for y, out in zip(ys, outs[carry_count:], strict=True)
        ]
        return i + 1, start, outs[:carry_count], ys, st

    zero = np.int32(0)
    _, _, carry, ys, state = lax.while_loop(
        lambda loop: loop[0] < length, step, (zero, zero, carry, ys, state)
    )
    return [*carry, *ys], state


def while_loop(
    rewriter: Any,
    going_on: Callable[[list[Any]], Any],
    step: Callable[[list[Any], Any, bool], tuple[list[Any], Any]],
    carry: list[Any],
    state: Any,
    per_step: int,
) -> tuple[list[Any], Any]:
    """A `while` loop with taps, run live (as `scan`: its steps counted from the
    chunk's first)."""
    room = _room(rewriter, per_step)
    state = rewriter.flush_if(state.count > 0, state)

    def live_step(loop: tuple[Any, list[Any], Any]) -> tuple[Any, list[Any], Any]:
        i, values, st = loop  # (i: the step, counted from the chunk's first)
        start, st = _chunk_step(rewriter, room, i >= st.interval, i, np.int32(0), st)
        values, st = step(values, st, False)
        return i - start + 1, values, st

    _, carry, state = lax.while_loop(
        lambda loop: going_on(loop[1]), live_step, (np.int32(0), carry, state)
    )
    return list(carry), state


def _room(rewriter: Any, per_step: int) -> Callable[[Any], Any]:
    """Whether the log has room for one more step's taps. (Kept taps only fill it: a
    dormant or sampled-out site's loop runs its chunk at the pace.)"""
    most = np.int32(rewriter.plan.capacity - per_step)
    return lambda state: state.count <= most


def _chunk_step(
    rewriter: Any, room: Callable[[Any], Any], paced: Any, i: Any, start: Any, state: Any
) -> tuple[Any, Any]:
    """Before step `i` of a live loop (in a chunk begun at `start`): if the chunk ran its
    `paced` steps, the host's answer (a flush, or a poll where it logged nothing), and a
    chunk begins at `i`; else, if the log has no `room` for the step, a flush that only
    sends (the device does not wait for the host) and the chunk goes on; else nothing.
    One `switch` a step: on a TPU a loop of chunks, each an inner loop, cost ~6 ms a
    chunk more than one loop, callbacks or not (tpu_answer_probe, retired). Returns
    (the chunk's first step, `state` after)."""

    def answered(st: Any) -> tuple[Any, Any]:
        return i, rewriter.answered(st, i - start)

    def full(st: Any) -> tuple[Any, Any]:
        return start, rewriter.flushed(st)

    which = lax.select(paced, np.int32(2), lax.select(room(state), np.int32(0), np.int32(1)))
    result: tuple[Any, Any] = lax.switch(which, [lambda st: (start, st), full, answered], state)
    return result
