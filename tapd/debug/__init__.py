"""`jax.debug.callback` and `jax.debug.print` without the stall.

    import tapd.debug

    @jax.jit
    def step(state):
        ...
        tapd.debug.print("step {s}: loss {l:.4f}", s=state.step, l=loss)
        tapd.debug.callback(lambda m: wandb.log(m), metrics)   # closures work
        ...

The same signatures and the same calls as `jax.debug`'s (counts, values, printed text,
under every transformation), but the callback runs on tapd's receiver thread in this
process, not inside the step: the step never waits for it. `tapd.barrier_wait()` waits
for every callback so far and raises what they raised; so does interpreter exit.
`tapd.install_debug()` (or `python -m tapd.debug script.py`) makes `jax.debug` itself
give these, for code that cannot be edited. docs/MIGRATING.md, "jax.debug", says what
stays different.

Importing this package imports JAX.
"""

from __future__ import annotations

from tapd.debug.calls import (
    debug_callback as callback,
)
from tapd.debug.calls import (
    debug_log as log,
)
from tapd.debug.calls import (
    debug_print as print,
)
from tapd.debug.calls import (
    jax_callback,
    jax_io_callback,
    jax_print,
)
from tapd.debug.install import install

__all__ = ["callback", "install", "jax_callback", "jax_io_callback", "jax_print", "log", "print"]
