"""A tap of a loop-invariant value, under `grad` of a `scan`: once a step, as the program says.

When JAX differentiates a `scan`, it splits the body into a forward ("known") loop and
a backward one, and then, as an optimization, traces the forward loop once more with
its constants known and its carries and inputs not (`_scan_known_hoisting` in
`jax/_src/lax/control_flow/loops.py`): whatever depends on the constants alone is
computed once, before the loop. An effect is no exception (JAX #16637), so a tap of a
value the loop does not change ran once instead of once a step. The same program
run eagerly (`jax.disable_jit()`) taps once a step, and so does tapd without `grad`;
legacy host_callback dropped such taps altogether, and `jax.debug.callback` runs them
once. tapd follows the program: once a step (docs/MIGRATING.md, "Taps under grad").

So while JAX traces for that hoisting (`hoisting`, a thread-local flag set around
`_scan_known_hoisting`), a tap of known values is staged into the loop instead of run
before it (`_partial_eval`): its operands become the loop's constants, which is what
they are. Nothing else changes: every other loop-invariant value is still hoisted, and
outside that trace a tap of known values runs on the known side as before.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from jax._src.interpreters import partial_eval as pe

from tapd.emitter.primitive import tap_p


class _Hoisting(threading.local):
    active = False


_hoisting = _Hoisting()


def _partial_eval(trace: Any, *tracers: Any, **params: Any) -> Any:
    if _hoisting.active and all(tracer.is_known() for tracer in tracers):
        tracers = tuple(trace.instantiate_const(tracer) for tracer in tracers)
    return trace.default_process_primitive(tap_p, tracers, params)


def install() -> None:
    """Wrap JAX's scan hoisting (once); where this JAX has none, nothing is hoisted."""
    from jax._src.lax.control_flow import loops

    hoist = getattr(loops, "_scan_known_hoisting", None)
    if hoist is None or getattr(hoist, "tapd_wrapped", False):
        return

    @functools.wraps(hoist)
    def hoisting(*args: Any, **kwargs: Any) -> Any:
        before, _hoisting.active = _hoisting.active, True
        try:
            return hoist(*args, **kwargs)
        finally:
            _hoisting.active = before

    hoisting.tapd_wrapped = True  # type: ignore[attr-defined]
    loops._scan_known_hoisting = hoisting
    pe.custom_partial_eval_rules[tap_p] = _partial_eval


install()
