"""A gathered computation that ends with its taps as an output, on JAX's C++ dispatch
path (issue 51: "one tap a call").

`tapd.emitter.taps_as_outputs` takes a gathered computation's packed buffers out as the
result of an ordered effect's token, and passes the sites' wake flags in as its
argument. JAX serves an executable with an ordered effect from Python, never from its
C++ dispatch path (`pjit._get_fastpath_data`): on the TPU host a one-tap step cost 584
µs a call that way, against 118 untapped (tpu_call_probe, retired, session 20).

The C++ path runs the executable on the call's arguments, prefixed with constants of
its own (`const_args`), and gives back its outputs unflattened by a tree
(`out_pytree_def`). So where a computation's way out needs nothing of the Python path,
`install` gives it a C++ path of its own (`_fast_path`), from its second call (the
first, on the Python path, shows the output's form):

- the flags argument becomes a constant in which every site keeps every tap
  (`OutputsEffect.fast_flags`), so that no flags need be read before the call runs;
- the packed buffers become one more output, first, taken by the tree's root, a node of
  tapd's own (`_WithTaps`) whose unflattening, once a call, in the dispatching thread,
  reads the wake flags, as the Python path reads them at dispatch, and hands the
  output to the collector (`_arrived`): a call with every site dormant moves nothing
  (its taps counted as skipped, their number known before it runs); otherwise the whole
  output is written, and the ring skips a dormant site's records (which moved with the
  others) and samples a sampled one's, as it does each host callback's tap. A site
  woken before a call thus takes that call's taps, as on the Python path.

Where it applies (`_eligible`): `TAPD_GATHER_FAST_DISPATCH` (on by default); one device;
the computation's only ordered effect is the way out and its only other effects tapd's
taps; no flush or poll while it runs (those bring flags with them,
`OutputsEffect.refreshed`); each site's taps counted before it runs (`call_counts`); a
log not sized for what sampling leaves (`sampled_bound`). A consumer sampled one in N
keeps the Python path, whose flags sample on the device (a sampled-out tap moves
nothing): a call that finds one on the C++ path is written as it came (the ring samples
it) and drops the C++ path of every computation (`_drop_fast_paths`), so that the next
call takes the flags; a computation whose sampling has stopped gets its C++ path back
the same way, from the Python path (tests/test_outputs_fast_path.py).

A computation whose calls here find every site dormant, called often, gets a twin
compiled without its taps, which this path then serves instead while its sites stay
dormant (`tapd.emitter.dormant_twin`: `dormant_call`, `twin_data`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
from typing import Any, cast

from tapd.emitter import dormant_twin, jax_compat, lifecycle, taps_as_outputs
from tapd.emitter.jax_compat.executables import drop_cpp_dispatch_caches
from tapd.emitter.taps_as_outputs import OutputsEffect

logger = logging.getLogger("tapd.emitter")

_lock = threading.Lock()
_installed: bool | None = None
_calls = 0  # calls served on the C++ path (`calls_served`)


def install() -> bool:
    """`taps_as_outputs.install()`, and the C++ path for the outputs that can take it
    (where this JAX's fast path takes constants and its data is a named tuple: JAX 0.8
    and later); False where the way out itself cannot be installed."""
    global _installed
    if not taps_as_outputs.install():
        return False
    with _lock:
        if _installed is None:
            _installed = _wrap_fastpath_data()
            taps_as_outputs.on_python_path = _on_python_path
    return True


def _wrap_fastpath_data() -> bool:
    try:
        from jax._src import pjit
        from jax._src.interpreters import pxla
    except ImportError:
        return False
    original = getattr(pjit, "_get_fastpath_data", None)
    data_type = getattr(pxla, "MeshExecutableFastpathData", None)
    fields = getattr(data_type, "_fields", ())
    if original is None or not {"const_args", "out_pytree_def", "kept_var_bitvec"} <= set(fields):
        return False
    parameters = list(inspect.signature(original).parameters)
    if parameters[:1] != ["executable"] or "effects" not in parameters:
        return False
    effects_at = parameters.index("effects") - 1  # (among the arguments after `executable`)

    @functools.wraps(original)
    def get_fastpath_data(executable: Any, *args: Any, **kwargs: Any) -> Any:
        data = original(executable, *args, **kwargs)
        if data is not None:
            return data
        try:
            effects = args[effects_at] if len(args) > effects_at else kwargs.get("effects")
            return _fast_path(original, executable, effects, args, kwargs)
        except Exception:  # (a JAX whose executable differs: the Python path, as before)
            logger.debug("a gathered output keeps JAX's Python path", exc_info=True)
            return None

    pjit._get_fastpath_data = get_fastpath_data
    return True


# ---- the C++ path of one computation ----------------------------------------------------


def _fast_path(
    original: Any, executable: Any, effects: Any, args: tuple[Any, ...], kwargs: Any
) -> Any:
    """The fast path data of `executable` (`effects`: its jaxpr's) with its way out as a
    constant in and an output out (see the module docstring); None where it does not
    apply. `original` makes the rest, given the executable without its ordered effect."""
    effect = _eligible(executable, effects)
    if effect is None:
        return None
    call = executable.unsafe_call
    bare_call = copy.copy(call)
    bare_call.ordered_effects = []
    bare_call.has_unordered_effects = False
    bare = copy.copy(executable)
    bare._unsafe_call = bare_call
    data = original(bare, *args, **kwargs)
    if data is None:
        return None
    assert effect.packed_output is not None  # (`fast_path_allowed`)
    packed_aval, packed_sharding = effect.packed_output
    (device,) = packed_sharding.device_set
    flags = effect.fast_flags(device)
    tapped = data._replace(
        out_pytree_def=_tree_with_taps(effect, data.out_pytree_def),
        in_shardings=[flags.sharding, *data.in_shardings],
        out_shardings=[packed_sharding, *data.out_shardings],
        out_avals=[packed_aval, *data.out_avals],
        out_committed=[True, *data.out_committed],
        kept_var_bitvec=[True, *data.kept_var_bitvec],
        in_device_local_layouts=[None, *data.in_device_local_layouts],
        const_args=[flags, *data.const_args],
    )
    # (every site dormant, called often: the computation without its taps, dormant_twin)
    return dormant_twin.twin_data(effect, tapped) or tapped


def _eligible(executable: Any, effects: Any) -> OutputsEffect | None:
    """The way out of `executable` where its call may take the C++ path (see the module
    docstring), else None."""
    call: Any = getattr(executable, "unsafe_call", None)
    ordered = list(getattr(call, "ordered_effects", None) or [])
    if len(ordered) != 1 or not isinstance(ordered[0], OutputsEffect):
        return None
    effect = ordered[0]
    if not lifecycle.settings().gather_fast_dispatch:
        return None
    if getattr(call, "has_host_callbacks", True) or getattr(call, "mut", None) is not None:
        return None
    if not all(jax_compat.ignored_by_dispatch(e) for e in effects or ()):
        return None
    if len(call.xla_executable.local_devices()) != 1:
        return None
    return effect if effect.fast_path_allowed() else None


class _WithTaps:
    """The root of a fast call's outputs: the packed buffers, then the computation's own
    outputs, which its unflattening returns once it has handed the buffers on."""

    __slots__ = ("effect", "outputs", "packed")

    def __init__(self, effect: OutputsEffect, packed: Any, outputs: Any) -> None:
        self.effect, self.packed, self.outputs = effect, packed, outputs


def _flatten(node: _WithTaps) -> tuple[tuple[Any, Any], OutputsEffect]:
    return (node.packed, node.outputs), node.effect


def _unflatten(effect: OutputsEffect, children: Any) -> Any:
    packed, outputs = children
    _arrived(effect, packed)
    return outputs


def _tree_with_taps(effect: OutputsEffect, outputs: Any) -> Any:
    """The tree of a fast call's outputs: `_WithTaps(effect, packed, <outputs>)`."""
    import jax

    _register()
    leaf = jax.tree_util.tree_structure(0)
    return outputs.from_node_data_and_children(
        jax.tree_util.default_registry, (_WithTaps, effect), [leaf, outputs]
    )


@functools.cache
def _register() -> None:
    import jax

    jax.tree_util.register_pytree_node(_WithTaps, _flatten, _unflatten)


def _arrived(effect: OutputsEffect, packed: Any) -> None:
    """A fast call's packed buffers, as its dispatch returns them: to the collector, as
    much of them as the wake flags read now say (see the module docstring). Never
    raises: the call's own outputs are returned whatever happens here."""
    global _calls
    _calls += 1  # (a statistic: two threads dispatching at once may lose one)
    try:
        # (one device: `fast_path_allowed`)
        receiver = cast(taps_as_outputs.Receiver, effect.receiver)
        assert receiver is not None and effect.call_counts is not None
        if not any(receiver.keeps()):  # (every site dormant: the common case, made short)
            taps_as_outputs.collector.received(None, receiver, effect.call_counts)
            dormant_twin.dormant_call(effect)
            return
        dormant_twin.woken_call(effect)
        flags = receiver.wake_flags(effect.call_counts)
        keeps = flags[: effect.sites]
        if any(keep > 1 for keep in keeps):  # (sampled: the Python path samples on the device)
            effect.sampled_when_fast = True
            _drop_fast_paths()
        if not any(keeps):
            taps_as_outputs.collector.received(None, receiver, effect.call_counts)
        else:
            taps_as_outputs.collector.received(packed, receiver, False)
    except Exception:
        logger.exception("tapd could not take a gathered computation's taps")


def calls_served() -> int:
    """How many calls of gathered computations JAX's C++ path has served so far (their
    twins' among them: `dormant_twin.calls_served`)."""
    return _calls + dormant_twin.calls_served()


def _on_python_path(effect: OutputsEffect, packed: Any, keeps: Any) -> None:
    """Each call of a way out on the Python path (`taps_as_outputs._received`): the
    output's form, which its C++ path needs, and, where sampling dropped that path and
    has stopped, that path back."""
    if effect.packed_output is None:
        effect.packed_output = (packed.aval, packed.sharding)
    if effect.sampled_when_fast and not any(keep > 1 for keep in keeps):
        effect.sampled_when_fast = False
        _drop_fast_paths()


def _drop_fast_paths() -> None:
    """Every jitted function's next call goes through Python again, where each
    computation's path is chosen anew."""
    drop_cpp_dispatch_caches()
