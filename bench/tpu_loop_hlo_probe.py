"""Where a long gathered loop's time goes (issue 51): the compiled HLO of the 1.4 ms loop
of bench/tpu_live.py (a `fori_loop` of two 4096² matmuls a step, tapping its index),
untapped, tapped and paced (the default), and tapped unpaced (`gather_latency` 0).

    python bench/tpu_loop_hlo_probe.py OUT_DIR   # on the TPU

Prints, for each, the copies, transposes and while loops of the optimized module, and
how many of them move a whole [4096, 4096] carry; writes each module's text to OUT_DIR.
Run it where a step costs more tapped than untapped: a copy of the carry a step (64 MiB
at ~800 GB/s: ~80 µs) would show here.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

N = int(__import__("os").environ.get("PROBE_N", "4096"))


def arrived(*_: object) -> None:
    pass


def program(kind: str):  # type: ignore[no-untyped-def]
    import tapd  # (here: bench/tpu_step_probe.py takes `counted_ops` without tapd)

    def body(i, c):  # type: ignore[no-untyped-def]
        for _ in range(2):
            c = (c @ c) * (1.0 / N)
        if kind != "none":
            return tapd.id_tap(arrived, i, result=c)
        return c

    return jax.jit(lambda c: lax.fori_loop(0, 2500, body, c))


def counted_ops(text: str, shape: str) -> tuple[dict[str, int], dict[str, int]]:
    """The copies, transposes, while loops and fusions of an optimized module's `text`,
    each kind counted: all of them, and those whose result has `shape` ("[8,262144]")."""
    ops: dict[str, int] = {}
    whole: dict[str, int] = {}
    for line in text.splitlines():
        found = re.search(r"= (\S+) (copy|transpose|while|copy-start|fusion)\(", line)
        if not found:
            continue
        op = found.group(2)
        ops[op] = ops.get(op, 0) + 1
        if shape in found.group(1):
            whole[op] = whole.get(op, 0) + 1
    return ops, whole


def main() -> None:
    from tapd.emitter import lifecycle

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    c = jnp.ones((N, N), jnp.float32)
    settings = lifecycle.settings()
    for kind in ("none", "tap", "unpaced"):
        if kind == "unpaced":
            lifecycle._settings = dataclasses.replace(settings, gather_latency=0.0)
        text = program(kind).lower(c).compile().as_text()
        lifecycle._settings = settings
        (out / f"{kind}.hlo.txt").write_text(text)
        ops, whole = counted_ops(text, f"[{N},{N}]")
        print(kind, "ops:", ops, "of a whole carry:", whole, flush=True)


if __name__ == "__main__":
    main()
