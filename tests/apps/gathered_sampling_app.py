"""Sampled taps on the gathered path (tests/test_gathered_sampling.py): each scenario
runs its programs, reads the ring back in this process, and prints one JSON line: the
records per consumer ([seq, step]), the records each flush or output carried (what
moved off the device), and tapd.stats().

    python gathered_sampling_app.py SCENARIO   # TAPD_GATHER=on or off
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
from tapd.emitter import lifecycle

MOVED: list[int] = []  # the records each packed output or flush carried off the device
if os.environ.get("TAPD_GATHER") == "on":
    from tapd.emitter.gathered import host as gathered_host

    _write = gathered_host.Flush.write_packed

    def _counted(self, packed):  # type: ignore[no-untyped-def]
        MOVED.append(self.records(packed)[0])
        _write(self, packed)

    gathered_host.Flush.write_packed = _counted  # type: ignore[method-assign]


def loop(name: str, steps: int, every: int = 1):  # type: ignore[no-untyped-def]
    """A `fori_loop` tapping four floats a step, `every` its own sampling."""

    def body(i, c):  # type: ignore[no-untyped-def]
        return tapd.tap(c + 1.0, name, step=i, every=every)

    return jax.jit(lambda c: lax.fori_loop(0, steps, body, c)).lower(jnp.zeros(4)).compile()


def while_loop(name: str, steps: int, every: int):  # type: ignore[no-untyped-def]
    """A `while` tapping each step (its count unknown before it runs)."""

    def body(carry):  # type: ignore[no-untyped-def]
        i, c = carry
        return i + 1, tapd.tap(c + 1.0, name, step=i, every=every)

    def run(c):  # type: ignore[no-untyped-def]
        return lax.while_loop(lambda carry: carry[0] < steps, body, (0, c))[1]

    return jax.jit(run).lower(jnp.zeros(4)).compile()


def random_programs(seed: int, native: object, known: bool) -> bool:
    """Random computations over consumers "ra", "rb" and "rc" (loops of random kinds and
    lengths, one or two taps a step, each with its own `every`, a branch that taps or
    not), called in a random order, the subscribers' one-in-N changed now and then
    between calls (after a barrier: the per-tap path reads it as each tap runs). `known`:
    only loops whose count of taps is known before they run (no `while`, no branch).
    Returns whether any call's count was unknown before it ran."""
    rng = np.random.default_rng(seed)
    names = ["ra", "rb", "rc"]
    programs = []
    unknown = False
    for index in range(6):
        kind = str(rng.choice(["fori", "scan"] if known else ["fori", "scan", "while", "cond"]))
        steps = int(rng.choice([1, 3, 7, 40, 1500]))
        taps = [
            (str(rng.choice(names)), int(rng.choice([1, 1, 2, 3, 5])))
            for _ in range(int(rng.integers(1, 3)))
        ]
        unknown |= kind in ("while", "cond")

        def body(i, c, taps=taps, kind=kind, index=index):  # type: ignore[no-untyped-def]
            for k, (name, every) in enumerate(taps):

                def tapped(c, name=name, every=every, k=k):  # type: ignore[no-untyped-def]
                    return tapd.tap(c + 1.0, name, step=i, every=every, at=index, k=k)

                if kind == "cond" and k == 0:
                    c = lax.cond(i % 3 == 1, tapped, lambda c: c, c)
                else:
                    c = tapped(c)
            return c

        if kind == "while":

            def run(c, steps=steps, body=body):  # type: ignore[no-untyped-def]
                return lax.while_loop(
                    lambda ic: ic[0] < steps, lambda ic: (ic[0] + 1, body(ic[0], ic[1])), (0, c)
                )[1]
        elif kind == "scan":

            def run(c, steps=steps, body=body):  # type: ignore[no-untyped-def]
                return lax.scan(lambda c, i: (body(i, c), None), c, jnp.arange(steps))[0]
        else:

            def run(c, steps=steps, body=body):  # type: ignore[no-untyped-def]
                return lax.fori_loop(0, steps, body, c)

        programs.append(jax.jit(run).lower(jnp.zeros(4)).compile())
    ring = native.ring  # type: ignore[attr-defined]
    zeros = jnp.zeros(4)
    for _ in range(24):
        if rng.random() < 0.15:
            jax.effects_barrier()
            name = str(rng.choice(names))
            for site in native.sites_of(name):  # type: ignore[attr-defined]
                ring.set_site_every(site, int(rng.choice([1, 2, 3, 4])))
        programs[int(rng.integers(len(programs)))](zeros)
    return unknown


def main() -> None:
    scenario = sys.argv[1]
    native = lifecycle.get_sender().native
    ring = native.ring
    zeros = jnp.zeros(4)
    outs = []
    unknown = False
    if scenario == "every":  # 3 calls of 1000 steps, every=100, back to back
        program = loop("e100", 1000, every=100)
        outs = [program(zeros) for _ in range(3)]
    elif scenario == "subscribers":  # every=2 and the subscribers' one in 3: W = 6
        program = loop("k2n3", 40, every=2)
        for site in native.sites_of("k2n3"):
            ring.set_site_every(site, 3)
        outs = [program(zeros) for _ in range(3)]
    elif scenario == "live":  # 3000 steps, every=7: flushes while it runs
        program = loop("live7", 3000, every=7)
        outs = [program(zeros) for _ in range(2)]
    elif scenario == "bounded":  # 40 steps, every=5, then the subscribers' one in 3
        program = loop("b5", 40, every=5)
        jax.block_until_ready([program(zeros) for _ in range(3)])
        jax.effects_barrier()
        for site in native.sites_of("b5"):
            ring.set_site_every(site, 3)
        outs = [program(zeros) for _ in range(3)]
    elif scenario == "mixed":  # a while (count unknown) between loops of one consumer
        counted = loop("mix", 25, every=4)
        uncounted = while_loop("mix", 10, every=4)
        outs = [counted(zeros), uncounted(zeros), counted(zeros), uncounted(zeros)]
        outs += [counted(zeros)]
    elif scenario == "shared":  # two sites of one consumer: the ring samples their taps

        def body(i, c):  # type: ignore[no-untyped-def]
            c = tapd.tap(c + 1.0, "two", step=i, every=3, which="a")
            return tapd.tap(c * 2.0, "two", step=i, every=3, which="b")

        program = jax.jit(lambda c: lax.fori_loop(0, 20, body, c)).lower(zeros).compile()
        outs = [program(zeros) for _ in range(2)]
    elif scenario == "resampled":  # the subscribers' N changes between calls
        program = loop("re", 30, every=1)
        [site] = native.sites_of("re")
        for n in (5, 1, 4, 3):
            ring.set_site_every(site, n)
            jax.block_until_ready(program(zeros))
            jax.effects_barrier()
    elif scenario == "random":
        unknown = random_programs(int(sys.argv[2]), native, sys.argv[3] == "known")
    else:
        raise SystemExit(f"no scenario {scenario!r}")
    jax.block_until_ready(outs)
    jax.effects_barrier()
    names = {}
    for name in ("e100", "k2n3", "live7", "b5", "mix", "two", "re", "ra", "rb", "rc"):
        for site in native.sites_of(name):
            names[site] = name
    records: dict[str, list[list[int]]] = {}
    for record in ring.read(0, 10_000_000):
        records.setdefault(names[record.site], []).append([record.seq, record.step])
    stats = tapd.stats()
    unknown = scenario == "random" and unknown
    output = {"records": records, "moved": MOVED, "stats": stats, "unknown": unknown}
    print(json.dumps(output), flush=True)


if __name__ == "__main__":
    main()
