"""A dormant computation's twin: the same computation without its taps, run on JAX's
C++ dispatch path while every one of its sites stays dormant (issue 51).

A gathered computation on the C++ path (tapd/emitter/outputs_fast_path.py) returns its
packed buffers as one more output, and a call with every site dormant moves none of
them; but JAX's cost of a second output remains (~60 µs a call on a TPU host, against
~120 for a whole untapped step: tpu_dormant_probe, retired). So a computation that is
called often while dormant gets a twin: its module as lowered (kept by `keep_module`),
the way out's result dropped (`jax_compat.executables.without_result`), compiled in a background
thread for its one device. XLA drops every tap's work as dead code; the parameters stay
the computation's, so the C++ path's data of the tapped computation serves the twin
with its executable swapped and the first output gone (`twin_data`). Each twin call's
dormant taps are still counted (skipped, their seqs used), by the root of its output
tree, as the tapped C++ path counts them.

No Python runs before a call on the C++ path, so a twin cannot see a wake in time by
itself. It holds its sites instead: before it is served, each site's slot in the ring's
table is marked relied on (`SiteWriter.rely_on_dormancy`, then its `every` read again:
ring.h, SiteSlot), and the daemon that wakes a marked site waits for this process to
acknowledge the wake before it welcomes the subscriber that woke it or says the site is
taken (tapd/daemon/wants.py). A thread (`_watch`) looks at the held sites every
`WATCH_SECONDS`; when one wakes, it stops every twin that holds it, drops JAX's C++
caches (the next call of each jitted function takes the Python path, which reads the
flags and serves the tapped computation), then acknowledges. A twin call dispatched
before the acknowledgment counts its taps skipped, as a call dispatched before a wake
does; no call dispatched after it runs a twin (a cache entry being filled meanwhile is
one JAX no longer holds: jax_compat.executables.drop_cpp_dispatch_caches).

When (`dormant_call`): from `TWIN_AFTER` dormant calls on the C++ path in a row, at most
`TWIN_GAP` seconds apart on average (for a step that long, the second output's ~60 µs
matter little, and a big step's compile would cost much); `TAPD_GATHER_DORMANT_TWIN=0`
never. A twin that fails to compile is logged (debug) and not tried again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, cast

from tapd.emitter import lifecycle, taps_as_outputs
from tapd.emitter.jax_compat.executables import (
    can_drop_cpp_dispatch_caches,
    compile_for_device,
    drop_cpp_dispatch_caches,
    without_result,
)
from tapd.emitter.taps_as_outputs import OutputsEffect

logger = logging.getLogger("tapd.emitter")

TWIN_AFTER = 8  # dormant calls on the C++ path in a row before a twin is compiled
TWIN_GAP = 0.005  # ... at most this many seconds apart on average
WATCH_SECONDS = 0.002  # between the watcher's looks at the held sites

_lock = threading.RLock()  # the held sites, the watcher, each twin's `serving`
_held: dict[tuple[int, int], tuple[Any, set[Twin]]] = {}  # (ring, site id) -> writer, twins
_watcher: threading.Thread | None = None
_calls = 0  # twin calls so far (`calls_served`)
_compiles = [0, 0]  # twins whose compilation started, and ended (`compiles`)


class Twin:
    """One computation's twin: its module, then its executable, and whether it serves."""

    __slots__ = ("executable", "failed", "module", "result", "run", "serving")

    def __init__(self, module: bytes, result: int) -> None:
        self.module: bytes | None = module  # (dropped once compiled)
        self.result = result  # the way out's position among the module's results
        self.executable: Any = None
        self.failed = False
        self.serving = False  # handed to JAX's C++ path, its sites held
        self.run: tuple[int, float] = (0, 0.0)  # dormant calls in a row, the first's time


def keep_module(effect: OutputsEffect, module: Any, result: int) -> None:
    """At lowering: keep the module of a computation whose calls may take the C++ path
    with every site dormant (one device, no flags while it runs, its taps counted
    before it runs), for its twin. Never fails the lowering: a module not kept has no
    twin."""
    settings = lifecycle.settings()
    if not (settings.gather_fast_dispatch and settings.gather_dormant_twin):
        return
    if not effect.lowered_for_fast_path():
        return
    try:
        if not can_drop_cpp_dispatch_caches():  # (a JAX that could not stop a twin)
            return
        from jax._src.interpreters import mlir

        effect.twin = Twin(mlir.module_to_bytecode(module), result)
    except Exception:
        logger.debug("a gathered computation's module is not kept for a twin", exc_info=True)


def dormant_call(effect: OutputsEffect) -> None:
    """A call on the tapped C++ path with every site dormant: compiles the twin once the
    calls warrant one (see the module docstring), and once it is ready, drops JAX's C++
    caches, so that the computation's next call chooses it (`twin_data`)."""
    twin = effect.twin
    if twin is None or twin.failed or twin.serving:
        return
    if twin.executable is not None:
        drop_cpp_dispatch_caches()
        return
    if twin.module is None:  # (compiling)
        return
    calls, first = twin.run
    now = time.monotonic()
    if calls == 0:
        first = now
    calls += 1
    twin.run = (calls, first)
    if calls >= TWIN_AFTER:
        twin.run = (0, 0.0)
        if (now - first) / (calls - 1) <= TWIN_GAP:
            assert effect.packed_output is not None  # (the C++ path is made from it)
            (device,) = effect.packed_output[1].device_set
            with _lock:  # (two threads dispatching: one compiles)
                module, twin.module = twin.module, None
                if module is None:
                    return
                _compiles[0] += 1
            # (not a daemon thread: an exit waits for the compilation, which must not
            # meet JAX's backends torn down by their exit hook)
            threading.Thread(target=_compile, args=(twin, module, device), name="tapd-twin").start()


def woken_call(effect: OutputsEffect) -> None:
    """A call on the tapped C++ path that found a site awake: the run of dormant calls
    starts again."""
    if effect.twin is not None:
        effect.twin.run = (0, 0.0)


def _compile(twin: Twin, module: bytes, device: Any) -> None:
    try:
        twin.executable = compile_for_device(without_result(module, twin.result), device)
    except Exception:
        twin.failed = True
        logger.debug("a dormant computation's twin did not compile", exc_info=True)
    finally:
        _compiles[1] += 1


def twin_data(effect: OutputsEffect, data: Any) -> Any:
    """The C++ path's data for `effect`'s twin, `data` being the tapped computation's
    (`outputs_fast_path`: the packed buffers its first output); None where the twin is
    not ready, or a site of the computation is not dormant now. Holds its sites."""
    twin = effect.twin
    if twin is None or twin.executable is None or twin.failed:
        return None
    sites = list(getattr(effect.receiver, "sites", ()))
    with _lock:
        held = []
        for site in sites:
            held.append(site)
            if not site.rely_on_dormancy():  # (marked, then read: ring.h, SiteSlot)
                _release([s for s in held if not _holders(s)])
                return None
        for site in sites:
            _held.setdefault((site.ring, site.site_id), (site, set()))[1].add(twin)
        twin.serving = True
        _start_watching()
    return data._replace(
        xla_executable=twin.executable,
        out_pytree_def=_tree(effect, data.out_pytree_def.children()[1]),
        out_shardings=data.out_shardings[1:],
        out_avals=data.out_avals[1:],
        out_committed=data.out_committed[1:],
    )


def _holders(site: Any) -> set[Twin]:
    held = _held.get((site.ring, site.site_id))
    return set() if held is None else held[1]


def _release(sites: list[Any]) -> None:
    """Acknowledge: these sites are relied on no more (with `_lock` held)."""
    for site in sites:
        _held.pop((site.ring, site.site_id), None)
        site.release_dormancy()


def calls_served() -> int:
    """How many calls twins have served so far."""
    return _calls


def compiles() -> tuple[int, int]:
    """How many twins' compilations have started, and ended (compiled or failed)."""
    return _compiles[0], _compiles[1]


# ---- the root of a twin call's outputs ---------------------------------------------------


class _TwinOutputs:
    """The root of a twin call's outputs: the computation's own, which its unflattening
    returns once it has counted the call's dormant taps."""

    __slots__ = ("effect", "outputs")

    def __init__(self, effect: OutputsEffect, outputs: Any) -> None:
        self.effect, self.outputs = effect, outputs


def _flatten(node: _TwinOutputs) -> tuple[tuple[Any], OutputsEffect]:
    return (node.outputs,), node.effect


def _unflatten(effect: OutputsEffect, children: Any) -> Any:
    (outputs,) = children
    _called(effect)
    return outputs


def _tree(effect: OutputsEffect, outputs: Any) -> Any:
    import jax

    _register()
    return outputs.from_node_data_and_children(
        jax.tree_util.default_registry, (_TwinOutputs, effect), [outputs]
    )


@functools.cache
def _register() -> None:
    import jax

    jax.tree_util.register_pytree_node(_TwinOutputs, _flatten, _unflatten)


def _called(effect: OutputsEffect) -> None:
    """A twin call, as its dispatch returns: its dormant taps counted (the watcher, not
    each call, looks for a wake: a call's cost on the host is this alone). Never
    raises."""
    global _calls
    _calls += 1  # (a statistic)
    try:
        receiver = cast(taps_as_outputs.Receiver, effect.receiver)  # (one device)
        assert effect.call_counts is not None
        taps_as_outputs.collector.received(None, receiver, effect.call_counts)
    except Exception:
        logger.exception("tapd could not count a dormant computation's taps")


# ---- the watcher: wakes acknowledged -----------------------------------------------------


def _start_watching() -> None:
    global _watcher
    if _watcher is None:  # (with `_lock` held)
        _watcher = threading.Thread(target=_watch, name="tapd-twin-watch", daemon=True)
        _watcher.start()


def _watch() -> None:
    global _watcher
    while True:
        time.sleep(WATCH_SECONDS)
        with _lock:
            if not _held:
                _watcher = None
                return
            woken = [twins for site, twins in _held.values() if not site.dormant_now()]
        if woken:
            _stop(set().union(*woken))


def _stop(twins: set[Any]) -> None:
    """Stop serving `twins`: JAX's C++ caches dropped, then their sites acknowledged
    (released where no twin still serving holds them)."""
    with _lock:
        for twin in twins:
            twin.serving = False
        drop_cpp_dispatch_caches()  # (before the acknowledgment: no later call runs a twin)
        for site, holders in list(_held.values()):
            holders -= twins
            if not holders:
                _release([site])
