"""Random programs, their taps checked against the references (issue 49).

tests/test_order_property.py runs this.

Hypothesis draws small programs (`Program`): statements on a state pytree (`a`, f32;
`b`, i32; `v`, f32[3]) that tap it, nested in `fori_loop`, `scan`, `while_loop` (whose
body may pass values through unchanged), `cond`, `switch`, a nested `jit`, `vmap`,
`grad` and `jax.checkpoint`, with values that depend on loop indices and carries,
pytrees and several dtypes. Values stay small integers, so that every path computes
them exactly.

Each program runs three ways in this process (its backend and gather settings come from
the environment the test gives it):
- `tapd.id_tap` of a closure (the default: ordered) under `jax.jit`, against the same
  function run eagerly, under `jax.disable_jit()`, its taps `tapd.id_tap(...,
  ordered="strict")` (JAX's runtime token orders each eager tap after the one before);
- for programs JAX lets `ordered=True` into (no `vmap`): `tapd.debug.callback(...,
  ordered=True)` under `jax.jit` against `jax.debug.callback(..., ordered=True)`, which
  it promises to match under every transformation; and, without `grad` (under which
  `jax.debug` runs a loop-invariant tap once, and again under `checkpoint`:
  docs/MIGRATING.md), `jax.debug.callback` against the eager run.

The taps each gives (site, values, batch dims) must be the same, in the same order. On
a failure Hypothesis shrinks the program, and this prints it as Python (`Program.source`)
and exits 1: commit it to tests/test_order_property.py's regressions.

    python tests/apps/order_property_app.py EXAMPLES SEED
    python tests/apps/order_property_app.py --seconds SECONDS FLOOR SEED   (the soak tier)
    python tests/apps/order_property_app.py --programs '["<Program.source>", ...]'
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from jax import lax

import tapd

# ---- programs -------------------------------------------------------------------------

# A statement: ("tap", site, what, use) | ("bump", which) | (kind, length, body...)
Stmt = tuple[Any, ...]
# Programs a round of the time-sized soak run (programs_for): one seed a round.
ROUND = 10

TAPPED = ["a", "b", "v", "pair", "tree", "int8", "bool", "bf16"]


@st.composite
def statements(draw: Any, depth: int, in_grad: bool = False, in_vmap: bool = False) -> list[Stmt]:
    count = draw(st.integers(1, 3))
    out: list[Stmt] = []
    for _ in range(count):
        kinds = ["tap", "tap", "bump"]
        if depth > 0:
            kinds += ["fori", "scan", "cond", "switch", "jit", "checkpoint"]
            if not in_grad:
                kinds += ["while"]
                if not in_vmap:
                    kinds += ["grad"]
            if not in_vmap and not in_grad:
                kinds += ["vmap"]
        kind = draw(st.sampled_from(kinds))
        if kind == "tap":
            site = draw(st.integers(0, 3))
            what = draw(st.sampled_from(TAPPED))
            out.append(("tap", site, what, draw(st.booleans())))
        elif kind == "bump":
            out.append(("bump", draw(st.sampled_from(["a", "b", "v"]))))
        else:
            inner = {
                "in_grad": in_grad or kind == "grad",
                "in_vmap": in_vmap or kind == "vmap",
            }
            body = draw(statements(depth - 1, **inner))
            other = draw(statements(depth - 1, **inner)) if kind in ("cond", "switch") else []
            third = draw(statements(depth - 1, **inner)) if kind == "switch" else []
            length = draw(st.integers(0, 3))
            out.append((kind, length, body, other, third))
    return out


@dataclasses.dataclass
class Program:
    body: list[Stmt]

    def has(self, *kinds: str) -> bool:
        def walk(stmts: list[Stmt]) -> bool:
            for stmt in stmts:
                if stmt[0] in kinds:
                    return True
                if stmt[0] not in ("tap", "bump") and any(walk(s) for s in stmt[2:]):
                    return True
            return False

        return walk(self.body)

    def source(self) -> str:
        """The program, as the nested statements it is made of (enough to rebuild it)."""
        return repr(self.body)


# ---- the program as a JAX function, with a tap function of the caller's -----------------


def tapped_value(s: dict[str, Any], what: str) -> Any:
    if what == "pair":
        return (s["a"], s["b"])
    if what == "tree":
        return {"x": s["v"], "y": [s["b"]]}
    if what == "int8":
        return (s["b"] % 100).astype(jnp.int8)
    if what == "bool":
        return s["b"] % 2 == 0
    if what == "bf16":
        return (s["a"] % 64).astype(jnp.bfloat16)
    return s[what]


def run(stmts: list[Stmt], s: dict[str, Any], tap: Any) -> dict[str, Any]:
    for stmt in stmts:
        s = step(stmt, s, tap)
    return s


def step(stmt: Stmt, s: dict[str, Any], tap: Any) -> dict[str, Any]:
    kind = stmt[0]
    if kind == "tap":
        _, site, what, use = stmt
        out = tap(site, tapped_value(s, what))
        if use and what in ("a", "b", "v"):
            s = {**s, what: out}
        return s
    if kind == "bump":
        which = stmt[1]
        if which == "a":
            return {**s, "a": s["a"] + 1.0 + (s["b"] % 3).astype(jnp.float32)}
        if which == "b":
            return {**s, "b": s["b"] + 1}
        return {**s, "v": s["v"] + s["a"]}
    _, length, body, other, third = stmt
    if kind == "fori":

        def fori_body(j: Any, s: dict[str, Any]) -> dict[str, Any]:
            return run(body, {**s, "b": s["b"] + j}, tap)

        return lax.fori_loop(0, length, fori_body, s)  # type: ignore[no-any-return]
    if kind == "scan":

        def scan_body(s: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
            s = run(body, {**s, "a": s["a"] + x}, tap)
            return s, s["b"]

        if length == 0 and jax.config.jax_disable_jit:
            return s  # (JAX refuses an empty scan eagerly; its body never runs)
        s, _ = lax.scan(scan_body, s, jnp.arange(length, dtype=jnp.float32))
        return s
    if kind == "while":
        # `a` and `v` pass through the loop unchanged unless the body changes them.
        def while_body(carry: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
            k, s = carry
            return k + 1, run(body, s, tap)

        _, s = lax.while_loop(lambda c: c[0] < length, while_body, (jnp.int32(0), s))
        return s
    if kind == "cond":
        return lax.cond(  # type: ignore[no-any-return]
            s["b"] % 2 == 0, lambda s: run(body, s, tap), lambda s: run(other, s, tap), s
        )
    if kind == "switch":
        branches = [lambda s, b=b: run(b, s, tap) for b in (body, other, third)]
        return lax.switch(s["b"] % 3, branches, s)  # type: ignore[no-any-return]
    if kind == "jit":
        return jax.jit(lambda s: run(body, s, tap))(s)  # type: ignore[no-any-return]
    if kind == "checkpoint":
        return jax.checkpoint(lambda s: run(body, s, tap))(s)  # type: ignore[no-any-return]
    if kind == "vmap":
        # Two lanes, `a` and `v` batched and `b` not (nothing in a body makes `b` depend
        # on them): what is batched stays batched, so eager and compiled loops batch the
        # same values (a loop under jit batches its whole carry where one part is).
        def lane(a: Any, v: Any, s: dict[str, Any]) -> Any:
            out = run(body, {**s, "a": a, "v": v}, tap)
            return out["a"], out["v"]

        a, v = jax.vmap(lane, in_axes=(0, 0, None))(
            jnp.stack([s["a"], s["a"] + 1.0]), jnp.stack([s["v"], s["v"] + 1.0]), s
        )
        return {**s, "a": a.sum(), "v": v.sum(axis=0)}
    if kind == "grad":

        def loss(a: Any, s: dict[str, Any]) -> Any:
            return run(body, {**s, "a": a}, tap)["a"] * 2.0

        return {**s, "a": s["a"] + jax.grad(loss)(s["a"], s)}
    raise AssertionError(kind)


def start() -> dict[str, Any]:
    return {"a": jnp.float32(1), "b": jnp.int32(2), "v": jnp.arange(3, dtype=jnp.float32)}


# ---- the runs --------------------------------------------------------------------------


def plain(value: Any) -> Any:
    return jax.tree.map(lambda leaf: np.asarray(leaf).astype(np.float64).tolist(), value)


class Log:
    def __init__(self) -> None:
        self.taps: list[Any] = []

    def id_tap_function(self, site: int) -> Any:
        def record(arg: Any, transforms: Any) -> None:
            batched = [list(p.get("batch_dims", ())) for n, p in transforms if n == "batch"]
            self.taps.append([site, plain(arg), batched])

        record.__name__ = f"site{site}"
        return record

    def callback_function(self, site: int) -> Any:
        def record(arg: Any) -> None:
            self.taps.append([site, plain(arg), []])

        return record


def run_with(program: Program, make_tap: Any, *, jit: bool) -> list[Any]:
    """The program's taps: run once eagerly, or jitted and called twice (the second
    call of a gathered computation takes JAX's C++ path: tapd.emitter.outputs_fast_path)."""
    log = Log()
    tap = make_tap(log)
    function = lambda s: run(program.body, s, tap)  # noqa: E731
    if jit:
        jitted = jax.jit(function)
        out = [jitted(start()), jitted(start())]
    else:
        with jax.disable_jit():
            out = function(start())
    jax.block_until_ready(out)
    tapd.barrier_wait()
    jax.effects_barrier()
    return log.taps


def id_tap_default(log: Log) -> Any:
    return lambda site, x: tapd.id_tap(log.id_tap_function(site), x)


def id_tap_strict(log: Log) -> Any:
    return lambda site, x: tapd.id_tap(log.id_tap_function(site), x, ordered="strict")


def tapd_debug(log: Log) -> Any:
    def tap(site: int, x: Any) -> Any:
        tapd.debug.callback(log.callback_function(site), x, ordered=True)
        return x

    return tap


def jax_debug(log: Log) -> Any:
    def tap(site: int, x: Any) -> Any:
        jax.debug.callback(log.callback_function(site), x, ordered=True)
        return x

    return tap


def check(program: Program) -> None:
    eager = run_with(program, id_tap_strict, jit=False) * 2  # (as the two jitted calls)
    compiled = run_with(program, id_tap_default, jit=True)
    assert compiled == eager, ("id_tap under jit", "eager", compiled, eager)
    if program.has("vmap"):
        return  # (JAX refuses an ordered jax.debug.callback under vmap)
    reference = run_with(program, jax_debug, jit=True)
    debug = run_with(program, tapd_debug, jit=True)
    assert debug == reference, ("tapd.debug.callback", "jax.debug.callback", debug, reference)
    if not program.has("grad"):
        # (under grad jax.debug differs from eager by design: MIGRATING.md, "Behaviour")
        unbatched = [[site, value, []] for site, value, _ in eager]
        assert reference == unbatched, ("jax.debug.callback", "eager", reference, unbatched)


def random_programs(examples: int, chosen_seed: int) -> dict[str, Any]:
    checked: list[int] = []

    @seed(chosen_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(st.builds(Program, statements(3)))
    def property_holds(program: Program) -> None:
        check(program)
        checked.append(1)

    try:
        property_holds()
    except AssertionError as exc:
        # (Hypothesis notes the shrunk program on the exception: "Falsifying example")
        notes = "\n".join(getattr(exc, "__notes__", []))
        return {"ok": False, "failure": str(exc)[:4000], "program": notes}
    return {"ok": True, "checked": len(checked)}


def programs_for(seconds: float, floor: int, chosen_seed: int) -> dict[str, Any]:
    """The soak tier's share, sized by time: rounds of ROUND programs, each round a seed of
    its own (chosen_seed, chosen_seed + 1, ...), until `seconds` have passed and at least
    `floor` programs were checked. A fixed set of seeds, so a failure is found again by
    the same round; the count depends on the machine, and is reported."""
    started = time.monotonic()
    checked = 0
    rounds = 0
    while checked < floor or time.monotonic() - started < seconds:
        result = random_programs(ROUND, chosen_seed + rounds)
        rounds += 1
        if not result["ok"]:
            result["round_seed"] = chosen_seed + rounds - 1
            return {**result, "checked": checked}
        checked += result["checked"]
    return {"ok": True, "checked": checked, "rounds": rounds}


def regressions(sources: list[str]) -> dict[str, Any]:
    """Programs given as their `Program.source`, each checked as a drawn one is."""
    failures = []
    for source in sources:
        try:
            check(Program(ast.literal_eval(source)))
        except AssertionError as exc:
            failures.append([source, str(exc)[:2000]])
    return {"ok": not failures, "checked": len(sources), "failures": failures}


def main() -> int:
    if sys.argv[1] == "--programs":
        result = regressions(json.loads(sys.argv[2]))
    elif sys.argv[1] == "--seconds":
        # --seconds S FLOOR SEED
        result = programs_for(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        result = random_programs(int(sys.argv[1]), int(sys.argv[2]))
    from tapd.emitter import outputs_fast_path

    result["fast_calls"] = outputs_fast_path.calls_served()
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
