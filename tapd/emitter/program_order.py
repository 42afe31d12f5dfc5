"""Program order inside a computation, by construction: one token, threaded by JAX.

A computation's ordered taps must run as the program runs them, whatever the data
dependencies: a loop that only passes the tapped value's input through, or a nested
`jit` whose `cond` taps, must still run after the taps above it and before those below.
Orders kept by data alone fail there, because XLA drops what a loop passes through
unchanged and forwards what a branch returns untouched. JAX's ordered effects do not:
JAX threads one token per effect through every loop carry, branch, call, `custom_jvp`,
`custom_vjp`, `remat` and `shard_map` body, and each effectful operation takes and
returns it. tapd uses that machinery rather than a second one of its own.

As a computation lowers (`chained`, called by `tapd.emitter.lowering` on the whole
jaxpr, after every transformation), each ordered tap that is not strict is marked
`chained` (`TapSiteParams.chained`): its effects gain `PROGRAM_ORDER`, an ordered effect
of tapd's, and so do those of every equation and jaxpr around it. The whole computation
is then one `ordered_call_p`, which makes `PROGRAM_ORDER`'s token inside the computation
(`hlo.create_token`) and lowers the rewritten jaxpr with it. To JAX's dispatch the
computation has only tapd's unordered effect, so it keeps the C++ fast path, and no
runtime token passes between calls. A computation with strict taps (JAX's runtime
token, `primitive.ORDERED`) pays for that token anyway: its other ordered taps become
strict too, so that one token orders them all.

The gathered path (tapd.emitter.gathered) orders its flushes with the same effect and
the same call, which then also carries its way out (`Exit`).

Marking happens only at lowering, not at trace time, because transformations treat
ordered effects differently from unordered ones (`vmap` of a `cond` or `while` refuses
them): a tap is still, to every transformation, the unordered primitive it was traced as.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from jax._src import core
from jax._src import linear_util as lu
from jax._src.interpreters import mlir
from jax._src.interpreters import partial_eval as pe
from jax._src.lib.mlir.dialects import hlo  # type: ignore[attr-defined]

from tapd.emitter import jax_compat
from tapd.emitter.jaxpr_walk import JaxprRewrite
from tapd.emitter.primitive import ORDERED, PROGRAM_ORDER, UNORDERED, TapSiteParams, tap_p

# A jaxpr with its constants: core.ClosedJaxpr before JAX 0.12, core.Jaxpr since (which
# holds them); written as Any so that one annotation type-checks against both.
ClosedJaxpr = Any


class Exit(Protocol):
    """What a call that ends with an output adds (tapd.emitter.gathered.flush.WayOut):
    its jaxpr takes `operands(ctx)` first and returns one more result, given to `done`."""

    def operands(self, ctx: mlir.LoweringRuleContext) -> list[Any]: ...

    def done(self, result: Any) -> None: ...


ordered_call_p = core.Primitive("tapd_ordered_call")
ordered_call_p.multiple_results = True


def call(jaxpr: ClosedJaxpr, args: Sequence[Any], exit: Exit | None = None) -> list[Any]:
    """`jaxpr` applied to `args`, with `PROGRAM_ORDER`'s token made inside: to JAX, an
    unordered tap. With an `exit`, see `Exit`."""
    return ordered_call_p.bind(*args, jaxpr=jaxpr, exit=exit)  # type: ignore[no-any-return,no-untyped-call]


@ordered_call_p.def_effectful_abstract_eval  # type: ignore[untyped-decorator]
def _call_abstract_eval(
    *avals: Any, jaxpr: ClosedJaxpr, exit: Exit | None
) -> tuple[list[Any], set[Any]]:
    outs = list(jaxpr.out_avals)
    effects = {*(jaxpr.effects - {PROGRAM_ORDER}), UNORDERED}
    return outs[:-1] if exit is not None else outs, effects


def _lower_call(
    ctx: mlir.LoweringRuleContext, *args: Any, jaxpr: ClosedJaxpr, exit: Exit | None
) -> list[Any]:
    tokens = mlir.TokenSet({**dict(ctx.tokens_in.items()), PROGRAM_ORDER: hlo.create_token()})
    inner = dataclasses.replace(ctx, tokens_in=tokens, tokens_out=None)
    operands = list(args)
    if exit is not None:
        operands = [*exit.operands(ctx), *operands]
        inner = dataclasses.replace(
            inner, avals_in=list(jaxpr.in_avals), avals_out=list(jaxpr.out_avals)
        )
    outs: list[Any] = mlir.lower_fun(core.jaxpr_as_fun(jaxpr), multiple_results=True)(
        inner, *operands
    )
    if inner.tokens_out is not None:  # JAX's own ordered effects' tokens, passed on
        ctx.set_tokens_out(inner.tokens_out.subset([e for e, _ in ctx.tokens_in.items()]))
    if exit is not None:
        *outs, last = outs
        exit.done(last)
    return outs


jax_compat.register_lowering(ordered_call_p, _lower_call)


# ---- the rewrite, as the computation lowers -----------------------------------------


def chained(closed: ClosedJaxpr, ordered_effects: Sequence[Any] | None) -> ClosedJaxpr | None:
    """`closed` with its ordered taps threading one token (see the module docstring);
    None where it has no ordered tap to chain. `ordered_effects`: those JAX threads
    from the runtime into this computation (its caller's list)."""
    strict = ORDERED in (ordered_effects or ())
    rewriter = _Chain(ORDERED if strict else PROGRAM_ORDER)
    jaxpr = _jaxpr_of(closed)
    rewritten = rewriter.jaxpr(jaxpr)
    if rewritten is jaxpr:
        return None
    inner = _with_jaxpr(closed, rewritten)
    if strict:  # JAX's runtime token is there already: no call of our own
        return inner
    in_avals = [var.aval for var in jaxpr.invars]
    wrapped = lu.wrap_init(lambda *args: call(inner, args), debug_info=jaxpr.debug_info)
    traced = pe.trace_to_jaxpr_dynamic(wrapped, in_avals)
    make: Any = getattr(core, "ClosedJaxpr", core.Jaxpr)
    return make(traced[0], traced[2])


class _Chain(JaxprRewrite):
    """One rewrite: each ordered tap marked, and every equation and jaxpr around one
    given `effect` too."""

    def __init__(self, effect: Any) -> None:
        super().__init__()
        self.effect = effect

    def rebuilt(self, jaxpr: Any, eqns: list[Any]) -> Any:
        return jaxpr.replace(eqns=eqns, effects=jaxpr.effects | {self.effect})

    def eqn(self, eqn: Any) -> Any:
        if eqn.primitive is tap_p:
            site: TapSiteParams = eqn.params["site"]
            if not site.ordered or site.strict or site.chained:
                return eqn
            if self.effect is ORDERED:
                marked = dataclasses.replace(site, strict=True)
            else:
                marked = dataclasses.replace(site, chained=True)
            effects = eqn.effects | marked.effects
            return eqn.replace(params={**eqn.params, "site": marked}, effects=effects)
        params = self.params(eqn)
        if params is None:
            return eqn
        return eqn.replace(params=params, effects=eqn.effects | {self.effect})


def _jaxpr_of(closed: ClosedJaxpr) -> Any:
    """The core.Jaxpr of a ClosedJaxpr, or the jaxpr itself (JAX 0.12)."""
    return closed if isinstance(closed, core.Jaxpr) else closed.jaxpr


def _with_jaxpr(closed: ClosedJaxpr, jaxpr: Any) -> ClosedJaxpr:
    return jaxpr if isinstance(closed, core.Jaxpr) else closed.replace(jaxpr=jaxpr)
