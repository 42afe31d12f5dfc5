"""A process's own prints come after the callback lines JAX would have printed first.

JAX runs a `jax.debug` callback inside the computation, so by the time the program
prints what a computation returned, the computation's callbacks have printed their
lines. tapd runs them later, on its receiver thread. `order_writes(stream, timeout,
catch_up)` has each write to `stream` (`sys.stdout`) first wait until the computations
dispatched so far have run and the receiver has run their callbacks (`catch_up`:
tapd.emitter.lifecycle's), so that `print("result", y)` comes after the lines of the
computation that made `y`, and an `ordered=True` print never splices into a line of the
program's own. A loop that does not print never waits for a callback; one that prints
waits at each print, as it waited for JAX's callbacks.

Not from tapd's receiver threads (a callback's own print), nor while JAX traces, nor
from inside one of JAX's own host callbacks (a computation runs it: waiting for the
devices there would wait for itself). Installed when a process's first in-process tap
site is made (tapd.emitter.lifecycle), and on each IPython cell's stream
(tapd.emitter.print_order.ipython).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapd.emitter.jax_compat import in_host_callback
from tapd.emitter.local.threads import on_receiver_thread


def order_writes(stream: Any, timeout: float, catch_up: Callable[[float], object]) -> None:
    """Have `stream.write` first run the callbacks of the computations dispatched so
    far (`catch_up(timeout)`: waiting at most `timeout` s). On the instance: `print`
    looks `write` up there, and the stream stays what it was; once per stream."""
    write = getattr(stream, "write", None)
    if not callable(write) or getattr(write, "tapd_orders", False):
        return

    def write_after_callbacks(text: str) -> Any:
        if not (on_receiver_thread() or in_host_callback()):
            catch_up(timeout)
        return write(text)

    write_after_callbacks.tapd_orders = True  # type: ignore[attr-defined]
    try:
        stream.write = write_after_callbacks
    except (AttributeError, TypeError):  # a stream whose attributes are fixed: as it is
        pass
