"""tapd under IPython and Jupyter: what a cell's computations call back shows in that cell.

JAX runs a `jax.debug` callback inside the computation, so its line lands in the output
of the cell that ran it, before anything the cell prints once it has the result. tapd
runs callbacks later, on a receiver thread; under IPython it puts their output back
where JAX shows it:

- when a cell finishes (IPython's `post_run_cell` event), tapd waits until the
  callbacks of the computations it dispatched have run (`drain`: tapd.emitter.
  lifecycle's), for up to `TAPD_CELL_TIMEOUT` seconds. A cell that reaches the bound
  says so in its output; the rest then run, and print, later. What the callbacks raised
  is left for the next `barrier_wait` (and logged where it happened, as JAX logs it);
- a write to the cell's `sys.stdout` first waits for the computations dispatched so far
  and lets the receiver run their callbacks (tapd.emitter.print_order.stdout), as JAX's
  synchronous callbacks would have run by then. A cell that prints a result
  (`print("result", y)` writes "result" before it waits for `y`) shows the
  computation's lines first, as with JAX, and an `ordered=True` print never splices into
  the cell's own line. A loop that only dispatches steps never waits for a callback.

Each `tapd.debug.print` is one write of its text and its newline, so the lines of two
threads never splice. At kernel shutdown or restart, the exit drain runs what is left
(tapd.emitter.lifecycle).

`attach()` is called when a process's first tap site needs a receiver; it does nothing
outside IPython. There, `id_print` prints in this process too, as host_callback's did,
rather than in a `tapd subscribe tapd.printing` that may run elsewhere.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from tapd.emitter.local.threads import on_receiver_thread
from tapd.emitter.print_order import stdout
from tapd.errors import BarrierTimeout

logger = logging.getLogger("tapd.emitter")


class _Waits(NamedTuple):
    """What the hooks wait with, as `attach` was given them."""

    timeout: float  # TAPD_CELL_TIMEOUT
    drain: Callable[[float], None]  # a cell's callbacks, all run (or the timeout)
    catch_up: Callable[[float], object]  # before a write: the callbacks so far


_attached: set[int] = set()  # ids of the shells hooked
_waits: list[_Waits] = []  # (one)
_lock = threading.Lock()


def running() -> bool:
    """Whether this process is an IPython shell (a Jupyter kernel, `ipython`)."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def attach(
    timeout: float, *, drain: Callable[[float], None], catch_up: Callable[[float], object]
) -> None:
    """Hook the running IPython shell and its `sys.stdout`, once each; nothing outside
    IPython. `timeout`: TAPD_CELL_TIMEOUT (given: this runs under the emitter's state
    lock, where reading the settings would wait for itself); `drain(timeout)` waits for
    every callback dispatched so far, `catch_up(timeout)` for those before a write."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    with _lock:
        if id(shell) not in _attached:
            _attached.add(id(shell))
            _waits[:] = [_Waits(timeout, drain, catch_up)]
            shell.events.register("pre_run_cell", _cell_starts)
            shell.events.register("post_run_cell", _cell_finished)
    _cell_starts()


def _cell_starts(info: Any = None) -> None:
    """IPython's pre_run_cell (and `attach`): hook the `sys.stdout` this cell writes to
    (a kernel may give each cell a stream of its own)."""
    waits = _waits[0]
    stdout.order_writes(sys.stdout, waits.timeout, waits.catch_up)


def _cell_finished(result: Any = None) -> None:
    """IPython's post_run_cell: the cell's callbacks run before its output closes."""
    if on_receiver_thread():
        return
    timeout, drain, _ = _waits[0]
    try:
        drain(timeout)
    except BarrierTimeout as exc:
        why = str(exc).partition("\n")[0]
        sys.stdout.write(
            f"tapd: this cell's callbacks had not all run after {timeout:g} s "
            f"(TAPD_CELL_TIMEOUT); the rest run later. {why}\n"
        )
    except Exception:  # a hook must not break the shell: say it, and go on
        logger.exception("tapd: waiting for this cell's callbacks failed")
    sys.stdout.flush()
