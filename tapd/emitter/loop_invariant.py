"""A tap of a loop-invariant value, under `grad` of a `scan`: once a step, as the program says.

When JAX differentiates a `scan`, it splits the body into a forward ("known") loop and
a backward one, and then, as an optimization, traces the forward loop once more with
its constants known and its carries and inputs not (`_scan_known_hoisting` in
`jax/_src/lax/control_flow/loops.py`): whatever depends on the constants alone is
computed once, before the loop. An effect is no exception (JAX #16637), so a tap of a
value the loop does not change ran once instead of once a step. The same program
run eagerly (`jax.disable_jit()`) taps once a step, and so does tapd without `grad`;
legacy host_callback dropped such taps altogether, and `jax.debug.callback` runs them
once. tapd's taps (`tap`, `id_tap`, `id_print`) follow the program: once a step
(docs/MIGRATING.md, "Behaviour"); `tapd.debug`'s keep `jax.debug`'s calls, once.

So while JAX traces for that hoisting (a thread-local flag set around it, `install`), a
tap of known values is staged into the loop instead of run
before it (`_partial_eval`): its operands become the loop's constants, which is what
they are. Nothing else changes: every other loop-invariant value is still hoisted, and
outside that trace a tap of known values runs on the known side as before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from jax._src.interpreters import partial_eval as pe

from tapd.emitter.primitive import TapSiteParams, tap_p


class _Hoisting(threading.local):
    active = False


_hoisting = _Hoisting()


def _partial_eval(trace: Any, *tracers: Any, **params: Any) -> Any:
    site: TapSiteParams = params["site"]
    staged = _hoisting.active and not site.like_jax_debug
    if staged and all(tracer.is_known() for tracer in tracers):
        tracers = tuple(trace.instantiate_const(tracer) for tracer in tracers)
    return trace.default_process_primitive(tap_p, tracers, params)


def _flagged(hoist: Callable[..., Any]) -> Callable[..., Any]:
    """`hoist`, run with the flag set."""
    if getattr(hoist, "tapd_wrapped", False):
        return hoist

    @functools.wraps(hoist)
    def hoisting(*args: Any, **kwargs: Any) -> Any:
        before, _hoisting.active = _hoisting.active, True
        try:
            return hoist(*args, **kwargs)
        finally:
            _hoisting.active = before

    hoisting.tapd_wrapped = True  # type: ignore[attr-defined]
    return hoisting


def install() -> None:
    """Wrap JAX's two scan hoistings: `grad`'s (`_scan_known_hoisting`) and that of
    `jax.checkpoint`'s partial evaluation (`_scan_partial_eval_custom`, whose only
    trace of JAX's partial evaluator is its hoisting). Where this JAX has neither, it
    hoists nothing of the kind."""
    from jax._src.lax.control_flow import loops

    hoist = getattr(loops, "_scan_known_hoisting", None)
    if hoist is not None:
        loops._scan_known_hoisting = _flagged(hoist)
    custom = pe.partial_eval_jaxpr_custom_rules.get(loops.scan_p)
    if custom is not None:
        pe.partial_eval_jaxpr_custom_rules[loops.scan_p] = _flagged(custom)
    pe.custom_partial_eval_rules[tap_p] = _partial_eval


install()
