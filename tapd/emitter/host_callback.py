"""host_callback's API: `id_tap`, `id_print`, and the consumer names of tap functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tapd.emitter.tapping import emit
from tapd.errors import TapDefinitionError

PRINT_CONSUMER = "tapd.printing:print_tap"


def id_tap(
    tap_func: Callable[..., Any],
    arg: Any,
    *,
    result: Any = None,
    tap_with_device: bool = False,
) -> Any:
    """host_callback's `id_tap`: `tap_func(arg, transforms)` runs in a subscriber
    (`tapd subscribe MODULE`); returns `result` if given, else `arg`."""
    consumer = consumer_name(tap_func)
    emit(consumer, arg, None, {"tap_with_device": True} if tap_with_device else {})
    return arg if result is None else result


def id_print(arg: Any, *, result: Any = None, what: str | None = None, **kwargs: Any) -> Any:
    """host_callback's `id_print`: printed by a subscriber of `tapd.printing`
    (`tapd subscribe tapd.printing`, or `tapd tail`)."""
    emit(PRINT_CONSUMER, arg, None, {"what": what, **kwargs})
    return arg if result is None else result


def consumer_name(tap_func: Callable[..., Any]) -> str:
    """`module:qualname` of an importable function; TapDefinitionError otherwise."""
    module = getattr(tap_func, "__module__", None)
    qualname = getattr(tap_func, "__qualname__", None)
    if not module or not qualname or "<lambda>" in qualname or "<locals>" in qualname:
        shown = qualname or repr(tap_func)
        raise TapDefinitionError(
            f"id_tap({shown}): tapd runs tap functions in a subscriber process, which finds "
            "them by their import path 'module:qualname'; a lambda, closure or callable "
            "object has none. Define the function at the top level of a module "
            "(`def log_loss(arg, transforms): ...`, then `tapd subscribe mymodule`), or use "
            "`tapd.tap(x, 'name')` with a `@subscriber.on('name')` handler."
        )
    return f"{module}:{qualname}"
