"""`tapd.install_debug()`: `jax.debug`'s calls served by tapd, for code the user cannot edit.

Libraries call `jax.debug.callback` and `jax.debug.print` on their users' behalf
(progress bars, optimizers' `verbose=True`, RL loops that log metrics). After
`install_debug()` these names give tapd's functions, in this process, for every call
made from then on:

- `jax.debug.callback`, `jax.debug.print` (and `jax.debug.log` where JAX has it), and
  the same functions in `jax._src.debugging`, where `jax.debug` takes them from: code
  that did `from jax import debug` (or `import jax`) before finds them there at each
  call. A name bound earlier by `from jax.debug import print` keeps JAX's function:
  `python -m tapd.debug script.py` installs before the script imports anything;
- `jax.effects_barrier()`: JAX's barrier, then `tapd.barrier_wait()`, so that a program
  that waits for its callbacks there waits for tapd's too, and gets what they raised
  (`tapd.CallbackException`);
- with `io_callback=True`, `jax.experimental.io_callback` calls whose
  `result_shape_dtypes` is None (the computation gets nothing back, so it need not wait:
  the close of NumPyro's and Diffrax's progress bars, whose updates return a value) go to
  tapd as a callback would; every other `io_callback` goes to JAX's own. JAX's refusals
  stay: `ordered=True` under `vmap`, and differentiation through one.

One call can still run synchronously, as JAX runs it: `blocking=True` (then the
callback has run when the step goes on), or JAX's own functions, kept as
`tapd.debug.jax_callback`, `tapd.debug.jax_print`, `tapd.debug.jax_io_callback`.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.debug
import jax.experimental
from jax._src import api as _jax_api
from jax._src import callback as _jax_callback_module
from jax._src import debugging as _jax_debugging
from jax._src.ad_util import Zero
from jax._src.interpreters import ad, batching

from tapd.debug import calls, delivery
from tapd.emitter import jax_compat, lifecycle
from tapd.emitter.local.threads import on_receiver_thread

jax_effects_barrier: Callable[[], None] = jax_compat.jax_effects_barrier  # JAX's own

_lock = threading.Lock()
_exiting = threading.Event()
_installed: list[bool] = []


def install(*, io_callback: bool = False) -> None:
    """Serve `jax.debug.callback`, `jax.debug.print` (`jax.debug.log`) and
    `jax.effects_barrier` by tapd from now on, in this process; with `io_callback=True`,
    also `jax.experimental.io_callback` calls that return nothing. Idempotent."""
    with _lock:
        for module in (jax.debug, _jax_debugging):
            name = "callback" if module is jax.debug else "debug_callback"
            setattr(module, name, calls.debug_callback)
            setattr(module, "print" if module is jax.debug else "debug_print", calls.debug_print)
            if calls.jax_log is not None:
                setattr(module, "log" if module is jax.debug else "debug_log", calls.debug_log)
        jax.effects_barrier = effects_barrier
        _jax_api.effects_barrier = effects_barrier
        if not _installed:  # threading's exit hooks run before atexit's handlers
            register = getattr(threading, "_register_atexit", atexit.register)
            register(_note_exit)
            _installed.append(True)
        if io_callback:
            jax.experimental.io_callback = io_callback_without_result
            _jax_callback_module.io_callback = io_callback_without_result


def effects_barrier() -> None:
    """`jax.effects_barrier()`, then `tapd.barrier_wait()`: every callback so far has
    run when it returns; raises `tapd.CallbackException` if any raised.

    JAX's alone where tapd's would be wrong: called by tapd itself (its barrier and
    exit drain call JAX's first), from a callback (which would wait for itself), or
    once the interpreter is exiting (tapd's exit drain has waited for the callbacks,
    and its receiver may be gone)."""
    jax_effects_barrier()
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if _exiting.is_set() or caller == "tapd" or caller.startswith("tapd."):
        return
    if on_receiver_thread():
        return
    lifecycle.barrier_wait()  # (tapd.barrier_wait's)


def _note_exit() -> None:
    _exiting.set()


def io_callback_without_result(
    callback: Callable[..., Any],
    result_shape_dtypes: Any,
    *args: Any,
    sharding: Any = None,
    ordered: bool = False,
    **kwargs: Any,
) -> Any:
    """`jax.experimental.io_callback`: tapd's when `result_shape_dtypes` is None (the
    computation needs nothing back), JAX's own otherwise."""
    if result_shape_dtypes is not None:
        return calls.jax_io_callback(
            callback, result_shape_dtypes, *args, sharding=sharding, ordered=ordered, **kwargs
        )
    flat, _ = jax.tree_util.tree_flatten((args, kwargs))
    for leaf in flat:  # JAX's rules for io_callback_p, where the tracers show them
        if ordered and _batched(leaf):
            raise ValueError("Cannot `vmap` ordered IO callback.")
        if _differentiated(leaf):
            raise ValueError("IO callbacks do not support JVP.")
    in_tree, dynamic, static = calls.split_arguments(args, kwargs)
    site = delivery.CallbackSite(callback, in_tree, static)

    def synchronous() -> None:
        calls.jax_io_callback(callback, None, *args, sharding=sharding, ordered=ordered, **kwargs)

    calls.dispatch(site, dynamic, ordered=ordered, partitioned=False, synchronous=synchronous)
    return None


def _batched(leaf: Any) -> bool:
    return isinstance(leaf, batching.BatchTracer) and leaf.batch_dim is not None


def _differentiated(leaf: Any) -> bool:
    tracers = tuple(
        kind
        for kind in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None))
        if kind is not None
    )
    return isinstance(leaf, tracers) and not isinstance(leaf.tangent, Zero)
