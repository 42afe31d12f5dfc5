"""Two JAX internals wrapped rather than called, for the default tap to keep JAX's C++
dispatch path (issue 26): `pxla.ExecuteReplicated.__init__` (`dispatch_ignores`: an
executable whose only effect is tapd's unordered one is served from C++, and
`jax.effects_barrier()` then calls tapd's flush after JAX's own) and
`mlir.lower_jaxpr_to_module` (`wrap_module_lowering`: tapd orders the lowered module's
taps, tapd/emitter/order.py). Both are seams too: `SEAMS` checks their keywords
(tapd.emitter.jax_compat.versions). Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any


def dispatch_ignores(effect_type: type, flush: Callable[[], None]) -> None:
    """Let JAX's C++ dispatch path serve executables whose only effects are of
    `effect_type` (tapd's unordered tap effect).

    JAX turns that path off for any executable with an effect (`has_unordered_effects`
    of `pxla.ExecuteReplicated`, read by `pjit._get_fastpath_data` and by
    `MeshExecutable.create_cpp_call`), and runs every call through Python instead, about
    55 µs a call. The effect only has to keep the tap in the program: the tap needs no
    runtime token, and tapd's barrier waits for dispatched computations itself. An
    executable with ordered effects, or with any other effect, is left as JAX made it.

    JAX's `effects_barrier()` waits for the runtime tokens of effectful computations,
    and an executable served so has none: `jax.effects_barrier()` calls `flush` after
    JAX's own barrier (`jax_effects_barrier`), which waits for every computation with an
    effect dispatched before it once one was served so (`served_without_tokens`), and
    for what else tapd adds to the barrier."""
    from jax._src.interpreters import pxla

    _flush_after_barrier(flush)

    init = pxla.ExecuteReplicated.__init__
    if getattr(init, "tapd_ignores", None) is not None:
        return
    import inspect

    signature = inspect.signature(init)
    if not {"unordered_effects", "ordered_effects"} <= set(signature.parameters):
        return  # (SEAMS names it: a tap fails at trace time)

    @functools.wraps(init)
    def init_ignoring_taps(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        unordered, ordered = bound["unordered_effects"], bound["ordered_effects"]
        if (
            not ordered
            and all(isinstance(effect, effect_type) for effect in unordered)
            and not _on_several_cpus(bound["xla_executable"])
        ):
            self.has_unordered_effects = False
            _served_without_tokens.set()

    init_ignoring_taps.tapd_ignores = effect_type  # type: ignore[attr-defined]
    pxla.ExecuteReplicated.__init__ = init_ignoring_taps  # type: ignore[method-assign]


def ignored_by_dispatch(effect: Any) -> bool:
    """Whether `effect` is of the type `dispatch_ignores` was given (tapd's tap effect)."""
    from jax._src.interpreters import pxla

    ignored = getattr(pxla.ExecuteReplicated.__init__, "tapd_ignores", None)
    return ignored is not None and isinstance(effect, ignored)


def _on_several_cpus(executable: Any) -> bool:
    """Whether `executable` runs on more than one CPU device (pmap, shard_map, a
    partitioned jit over `--xla_force_host_platform_device_count` devices). Those keep
    JAX's runtime token: the CPU client runs each device's part once its inputs are
    ready, and a barrier's per-device marker could overtake a part still running, whose
    outputs the program may have dropped (`lifecycle.flush_devices`). A GPU's or TPU's
    stream keeps dispatch order; on one CPU device the barrier waits for the live arrays
    (what escapes that: flush_devices)."""
    try:
        devices = executable.local_devices()
        return len(devices) > 1 and devices[0].platform == "cpu"
    except Exception:  # (this JAX's executable says otherwise: as before)
        return False


_served_without_tokens = threading.Event()  # an executable took the path dispatch_ignores opens
_jax_own_barrier: list[Callable[[], None]] = []  # JAX's effects_barrier, before tapd's


def served_without_tokens() -> bool:
    """Whether any executable has taken the path `dispatch_ignores` opens."""
    return _served_without_tokens.is_set()


def jax_effects_barrier() -> None:
    """JAX's own `jax.effects_barrier()`, whatever tapd (or `tapd.install_debug()`) has
    made of `jax.effects_barrier` since."""
    if _jax_own_barrier:
        _jax_own_barrier[0]()
        return
    from jax._src import api

    api.effects_barrier()


def _flush_after_barrier(flush: Callable[[], None]) -> None:
    import jax
    from jax._src import api

    if _jax_own_barrier:
        return
    own = api.effects_barrier
    _jax_own_barrier.append(own)

    @functools.wraps(own)
    def effects_barrier() -> None:
        own()
        flush()

    jax.effects_barrier = api.effects_barrier = effects_barrier


def wrap_module_lowering(wrapper: Any) -> None:
    """Lower every module through `wrapper(lower, *args, **kwargs)`, where `lower` is
    `mlir.lower_jaxpr_to_module` (which jit, pmap and AOT lowering call through the
    module's attribute): tapd orders a lowered module's tapping operations there
    (`tapd.emitter.order`)."""
    from jax._src.interpreters import mlir

    lower = mlir.lower_jaxpr_to_module
    if getattr(lower, "tapd_wrapped", False):
        return

    @functools.wraps(lower)
    def lower_module(*args: Any, **kwargs: Any) -> Any:
        return wrapper(lower, *args, **kwargs)

    lower_module.tapd_wrapped = True  # type: ignore[attr-defined]
    mlir.lower_jaxpr_to_module = lower_module
