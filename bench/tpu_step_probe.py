"""What a live loop's step costs on a TPU with nothing to flush (issue 51).

On the TPU v5e a dormant 1 MiB tap in a 1000-step live loop adds ~41 µs a step
(bench/tpu_live.py `every=100`), where writing 1 MiB into a carried buffer adds ~10
(bench/tpu_big_probe.py). Plain JAX, no tapd: a `while` of 1000 steps of
`x * 0.999 + 0.001` over 1 MiB, with what tapd's live loop adds, one piece at a time.
µs a step added over the bare loop, medians of 3 rounds of 3 calls:

- `write`: each step writes `x` into row `i % 8` of a carried f32[8, 256K] buffer;
- `cond-cb`: `write`, and each step a `cond` (taken at the last step only) whose branch
  is an ordered `io_callback` reading the buffer (a flush that sends);
- `switch-cb`: `write`, and each step a 3-way `switch` (nothing / a flush that sends /
  an `io_callback` with an int32 result: tapd's `_chunk_step`), taken at the last step;
- `gated-switch-cb`: `switch-cb` inside a `cond` on whether anything is due;
- `cond-plain`: `write`, and each step a `cond` whose branch sums the buffer (no
  callback): whether a callback in a branch is what costs;
- `switch-cb-small`: `switch-cb` without the buffer (the callback reads 4 bytes);
- `pass-switch-cb`: the switch first, the buffer going through it (each branch returns
  it), then the write: the order of tapd's live step;
- `pass-nested`: the same with the answer a `cond` of its own inside the switch;
- `unrolled-8`: `switch-cb` once for 8 steps, the loop's step 8 of them;
- `flag-cond-plain`: `cond-plain` with a predicate of the data (`x[0] > 1e9`);
- `nested-8`: an inner `fori_loop` of 8 steps that only write, then `switch-cb`'s switch;
- `KIND@tiles`: KIND with the buffer shaped f32[8, 2048, 128], so that a row is whole
  (8, 128) tiles of the TPU's layout rather than one row of each of 2048 tiles.

Only some kinds: `PROBE_KINDS=write,cond-plain,write@tiles,cond-plain@tiles`.

    python bench/tpu_step_probe.py
    python bench/tpu_step_probe.py --hlo DIR   # also each form's compiled HLO, DIR/KIND.txt,
                                               # its copies and fusions counted
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback
from tpu_big_probe import medians_us
from tpu_loop_hlo_probe import counted_ops

ROW, ROWS, STEPS = 2**18, 8, 1000


def sink(*_: Any) -> None:
    pass


def answer(*_: Any) -> np.ndarray:
    return np.zeros((2,), np.int32)


def variant(kind: str) -> Callable[[Any], Any]:
    kind, _, shaped = kind.partition("@")
    shape = (ROWS, ROW // 128, 128) if shaped == "tiles" else (ROWS, ROW)

    def put(buffer: Any, x: Any, row: Any) -> Any:
        return lax.dynamic_update_index_in_dim(buffer, x.reshape(shape[1:]), row, 0)

    def send(buffer: Any) -> Any:
        io_callback(sink, None, buffer, ordered=True)
        return buffer

    def answered(buffer: Any) -> Any:
        io_callback(
            answer, jax.ShapeDtypeStruct((2,), np.int32), buffer.reshape(-1)[:2], ordered=True
        )
        return buffer

    def step(loop: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        i, x, buffer = loop
        x = x * 0.999 + 0.001
        last = i == STEPS - 1
        if kind.startswith("pass"):  # (the buffer through the switch, then written)
            which = lax.select(last, np.int32(2), np.int32(0))
            if kind == "pass-switch-cb":
                buffer = lax.switch(which, [lambda b: b, send, answered], buffer)
            else:  # pass-nested: the answer a `cond` of a flush or a poll, as tapd's
                nested = lambda b: lax.cond(i > 0, answered, lambda c: c, b)  # noqa: E731
                buffer = lax.switch(which, [lambda b: b, send, nested], buffer)
            buffer = put(buffer, x, i % ROWS)
            return i + 1, x, buffer
        if kind == "unrolled-8":  # (8 steps a loop step, one switch for them)
            which = lax.select(i == STEPS - 8, np.int32(2), np.int32(0))
            lax.switch(which, [lambda b: b, send, answered], buffer)
            for k in range(8):
                x = x * 0.999 + 0.001 if k else x
                buffer = put(buffer, x, (i + k) % ROWS)
            return i + 8, x, buffer
        if kind == "nested-8":  # (an inner loop of 8 plain steps, then the switch)

            def inner(k: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
                x, buffer = carry
                x = lax.select(k > 0, x * 0.999 + 0.001, x)
                return x, put(buffer, x, (i + k) % ROWS)

            x, buffer = lax.fori_loop(0, 8, inner, (x, buffer))
            which = lax.select(i == STEPS - 8, np.int32(2), np.int32(0))
            lax.switch(which, [lambda b: b, send, answered], buffer)
            return i + 8, x, buffer
        if kind == "flag-cond-plain":  # (the predicate a value carried, not the step's)
            buffer = put(buffer, x, i % ROWS)
            total = lax.cond(x[0] > 1e9, lambda b: jnp.sum(b), lambda b: jnp.float32(0), buffer)
            return i + 1, x + total * 0, buffer
        if kind != "none":
            buffer = put(buffer, x, i % ROWS)
        read = buffer if kind != "switch-cb-small" else buffer.reshape(ROWS, ROW)[0, :2]
        if kind == "cond-cb":
            lax.cond(last, send, lambda b: b, read)
        elif kind in ("switch-cb", "switch-cb-small"):
            which = lax.select(last, np.int32(2), np.int32(0))
            lax.switch(which, [lambda b: b, send, answered], read)
        elif kind == "gated-switch-cb":
            which = lax.select(last, np.int32(2), np.int32(0))

            def due(b: Any) -> Any:
                return lax.switch(which, [lambda c: c, send, answered], b)

            lax.cond(which > 0, due, lambda b: b, read)
        elif kind == "cond-plain":
            total = lax.cond(last, lambda b: jnp.sum(b), lambda b: jnp.float32(0), read)
            x = x + total * 0
        return i + 1, x, buffer

    def run(x: Any) -> Any:
        buffer = jnp.zeros(shape, np.float32)
        _, x, buffer = lax.while_loop(lambda c: c[0] < STEPS, step, (np.int32(0), x, buffer))
        return x, buffer.reshape(-1)[0]

    return jax.jit(run)


KINDS = (
    "none",
    "write",
    "cond-cb",
    "switch-cb",
    "gated-switch-cb",
    "cond-plain",
    "switch-cb-small",
    "pass-switch-cb",
    "pass-nested",
    "unrolled-8",
    "flag-cond-plain",
    "nested-8",
)


def main() -> None:
    x = jnp.zeros(ROW, jnp.float32)
    chosen = os.environ.get("PROBE_KINDS")
    kinds = chosen.split(",") if chosen else KINDS
    calls = {kind: variant(kind) for kind in kinds}
    if "--hlo" in sys.argv:  # (where the writes' copies are, if they are copies)
        folder = Path(sys.argv[sys.argv.index("--hlo") + 1])
        folder.mkdir(parents=True, exist_ok=True)
        for kind, call in calls.items():
            text = call.lower(x).compile().as_text()  # type: ignore[attr-defined]
            (folder / f"{kind}.txt").write_text(text)
            ops, of_buffer = counted_ops(text, f"[{ROWS},")
            print(kind, "ops:", ops, "of the whole buffer:", of_buffer, flush=True)
    medians = medians_us(calls, x, per_round=3)
    print(f"device {jax.devices()[0]}, JAX {jax.__version__}")
    base = medians.get("none", 0.0)
    for kind in kinds:
        us = medians[kind]
        print(f"{kind:16s} {us:10.1f} µs a call  {(us - base) / STEPS:8.2f} µs a step added")


if __name__ == "__main__":
    main()
