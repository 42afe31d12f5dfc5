"""host_callback's API: `id_tap`, `id_print`, and where their tap functions run.

Where a tap function runs (docs/MIGRATING.md, "Where tap functions run"):

- an **importable** function (`mymodule.f`, found again by the name
  `mymodule:f`), or a `functools.partial` of one whose keywords are plain values (str,
  int, float, bool, None: they travel as the site's static metadata): in a subscriber
  process that takes its consumer (`tapd subscribe mymodule`), else in this process
  (tapd/emitter/local/fallback.py, "fallback");
- **anything else** (a lambda, a closure, a bound method, a callable object, a function
  of `__main__`, a partial binding objects or positional arguments): in this process,
  on tapd's receiver thread, under a consumer name of its own.

Either way the function is called as host_callback called it: `f(arg, transforms)`,
with `device=` when the site said `tap_with_device=True`.

How its taps keep order (`_ordering`, decided per tap when it is traced; docs/MIGRATING.md,
"Order"): host_callback threaded one token through every tap. tapd keeps that order with
its own token inside the computation (`tapd.emitter.program_order`), which JAX threads
through every loop, branch and call, on one device or several (a partitioned `jit`, each
device's `pmap` or `shard_map` body), and which leaves the step on JAX's C++ dispatch
path. `ordered="strict"` (or TAPD_ORDERED=strict) takes JAX's runtime token instead,
which also orders independent computations, at JAX's per-call cost.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax

from tapd.emitter import lifecycle
from tapd.emitter.local import fallback
from tapd.emitter.local.functions import describe
from tapd.emitter.print_order import ipython
from tapd.emitter.tapping import Ordering, check_ordered, emit
from tapd.errors import TapDefinitionError
from tapd.printing import print_tap
from tapd_client.tap_functions import RESERVED_META

PRINT_CONSUMER = "tapd.printing:print_tap"

_META_TYPES = (str, int, float, bool, type(None))  # what a site's static metadata may hold

# host_callback's own words (jax/experimental/host_callback.py), so that code and tests
# that look for them still find them.
_KWARGS_REMOVED = (
    "Support for **kwargs in ``id_tap`` has been removed. Instead, pre-apply keyword "
    "arguments, either by using a closure or by passing "
    "``functools.partial(tap_func, **kwargs)``."
)


def id_tap(
    tap_func: Callable[..., Any],
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    callback_flavor: Any = None,
    ordered: Ordering | None = None,
    **kwargs: Any,
) -> Any:
    """host_callback's `id_tap`: `tap_func(arg, transforms)` runs in a subscriber process
    that takes it, or in this process (see the module docstring); returns `result` if
    given, else `arg` (as the tap's output, so later uses of it come after the tap).

    `device_index` picks the device whose tap runs the function where the computation
    taps a value once for all devices; `callback_flavor` (host_callback's choice of JAX
    callback) is accepted and has no effect: tapd taps are asynchronous.

    `ordered` (tapd's, not host_callback's; default: TAPD_ORDERED, on) keeps
    host_callback's order: tapd's own token inside the computation, on JAX's C++
    dispatch path, or JAX's ordered effect where the computation is split over several
    devices (see the module docstring). `"strict"`: JAX's ordered effect in any case
    (also between computations, at JAX's per-call cost); `True`: tapd's token in any
    case, as `tapd.tap`'s; `False`: no order between sites (docs/TAPPING.md, "Ordered,
    strict and unordered taps")."""
    if kwargs:
        raise TypeError(_KWARGS_REMOVED)
    return _id_tap(tap_func, arg, result, tap_with_device, device_index, ordered, here=False)


def _id_tap(
    tap_func: Callable[..., Any],
    arg: Any,
    result: Any,
    tap_with_device: bool,
    device_index: int,
    ordered: Ordering | None,
    *,
    here: bool,
) -> Any:
    """`id_tap`; `here`: the function runs in this process even if importable."""
    if not callable(tap_func):
        raise TypeError(f"Expected a callable value, got {tap_func!r}")
    check_ordered("id_tap", ordered)
    meta = _site_meta(tap_with_device, device_index)
    consumer, bound = _placement(tap_func, arg, here=here)
    ordering = _ordering(arg, ordered)
    # Always taken (host_callback's semantics: an id_tap function always runs).
    tapped = emit(consumer, arg, None, {**bound, **meta}, always=True, ordered=ordering)
    return tapped if result is None else result


def _ordering(arg: Any, ordered: Ordering | None) -> Ordering:
    """How an id_tap of `arg` traced here keeps host_callback's order (see the module
    docstring): `ordered` if given; else TAPD_ORDERED's (on, the default: tapd's own
    token, on one device or several)."""
    if ordered is not None:
        return ordered
    setting: Ordering = lifecycle.settings().ordered
    return setting


def id_print(
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
    device_index: int = 0,
    output_stream: Any = None,
    threshold: int | None = None,
    callback_flavor: Any = None,
    ordered: Ordering | None = None,
    **kwargs: Any,
) -> Any:
    """host_callback's `id_print`: prints `arg` as host_callback did, after the keywords
    (`what: ...`). With `output_stream`, `output_stream.write(line)` is called in this
    process; otherwise it is printed by `tapd subscribe tapd.printing` (or shown by
    `tapd tail`) if one runs, else on this process's stdout. `threshold` goes to
    `numpy.array2string`; `ordered` is id_tap's (not printed)."""
    if output_stream is not None:
        kwargs["output_stream"] = output_stream
    if threshold is not None:
        kwargs["threshold"] = threshold
    printer = functools.partial(print_tap, **kwargs)
    # In a notebook the lines belong in the cell that made them
    # (tapd.emitter.print_order.ipython), not with a subscriber elsewhere.
    here = ipython.running()
    return _id_tap(printer, arg, result, tap_with_device, device_index, ordered, here=here)


def consumer_name(tap_func: Callable[..., Any]) -> str:
    """The consumer an importable tap function's taps are named by, `module:qualname`;
    TapDefinitionError for a function that only this process can run."""
    importable = importable_form(tap_func)
    if importable is None:
        raise TapDefinitionError(
            f"{describe(tap_func)} has no import path a subscriber process "
            "could find it by; id_tap runs it in this process"
        )
    return importable[0]


def importable_form(tap_func: Callable[..., Any]) -> tuple[str, dict[str, Any]] | None:
    """(consumer, bound keywords) of a tap function that another process can import and
    call the same way, or None. That is a function found again by its module and
    qualified name (not one of `__main__`, which is another module in any other process,
    nor a bound method), or a `functools.partial` of one that binds keywords only, each a
    plain value that is not a name tapd reserves."""
    bound: dict[str, Any] = {}
    if isinstance(tap_func, functools.partial):
        keywords = tap_func.keywords
        if tap_func.args or not all(
            k not in RESERVED_META and type(v) in _META_TYPES for k, v in keywords.items()
        ):
            return None
        bound, tap_func = dict(keywords), tap_func.func
    if inspect.ismethod(tap_func):
        return None
    module = getattr(tap_func, "__module__", None)
    qualname = getattr(tap_func, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__":
        return None
    found: Any = sys.modules.get(module)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not tap_func:  # a lambda, a closure (<locals>), a decorated copy...
        return None
    return f"{module}:{qualname}", bound


def _placement(
    tap_func: Callable[..., Any], arg: Any, *, here: bool = False
) -> tuple[str, dict[str, Any]]:
    """The consumer of this site, and the keywords that travel with it; subscribes this
    process's receiver first where it is to run the function (`here`: in any case)."""
    importable = None if here else importable_form(tap_func)
    if importable is not None:
        if fallback.fallback_enabled():
            lifecycle.fallback_receiver().fallback(importable[0])
        return importable
    treedef = jax.tree_util.tree_structure(arg)
    return lifecycle.local_consumer(tap_func, treedef), {}


def _site_meta(tap_with_device: bool, device_index: int) -> dict[str, Any]:
    if type(device_index) is not int or not 0 <= device_index < jax.local_device_count():
        raise TapDefinitionError(
            f"device_index={device_index!r}: expected the index of one of this process's "
            f"{jax.local_device_count()} devices"
        )
    meta: dict[str, Any] = {}
    if tap_with_device:
        meta["tap_with_device"] = True
    if device_index:  # the device whose tap runs the function (lowering reads it)
        meta["device_index"] = device_index
    return meta
