"""Run host_callback-style tap functions (`id_tap(mymodule.f, x)`) in a subscriber.

A tap site written `id_tap(mymodule.log_loss, x)` is consumer `"mymodule:log_loss"`.
`serve_module("mymodule")` subscribes to `"mymodule:*"`, finds each function by its
qualified name and calls it as host_callback did: `f(arg, transforms)`, plus
`device=` when the site asked for `tap_with_device=True`, plus the keywords the site
bound (`id_tap(functools.partial(mymodule.f, what="loss"), x)` calls
`f(arg, transforms, what="loss")`; `id_print`'s keywords travel the same way).

The emitting process runs the same function, the same way, when no subscriber takes
its consumer (tapd/emitter/local/fallback.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

from tapd.errors import TapdError
from tapd_client.meta import TapMeta
from tapd_client.subscriber import Subscriber

# Metadata that tapd itself adds to a tap site, never a keyword of the tap function:
# `tap_with_device` (id_tap asked for `device=`), `device_index` (id_tap's), `key_impl`
# (a tapped PRNG key's implementation), `device_platform` (the JAX platform of the
# device, with tap_with_device) and `device_names` (JSON {local ordinal: str(device)} of
# the emitting process's devices of that platform, with tap_with_device). Bound keywords
# of these names make a tap function run in its own process only
# (tapd.emitter.host_callback.importable_form).
RESERVED_META = frozenset(
    {"tap_with_device", "device_index", "key_impl", "device_platform", "device_names"}
)


@dataclasses.dataclass(frozen=True)
class TapDevice:
    """The device a tap ran on, for a tap function outside the JAX process (which has no
    `jax.Device`): printed as the emitting process's JAX printed it, `name` (its
    `str(device)`: `cpu:0` in jax 0.10, `TFRT_CPU_0` in jax 0.8), else as
    `platform:id`."""

    platform: str
    id: int
    name: str | None = None

    def __str__(self) -> str:
        return self.name if self.name is not None else f"{self.platform}:{self.id}"


def resolve(consumer: str) -> Callable[..., Any]:
    """The function a `module:qualname` consumer names."""
    module_name, _, qualname = consumer.partition(":")
    if not qualname:
        raise TapdError(f"consumer {consumer!r} is not of the form 'module:qualname'")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise TapdError(f"module {module_name!r} has no tap function {qualname!r}") from exc
    if not callable(target):
        raise TapdError(f"{consumer!r} is not callable")
    return target  # type: ignore[no-any-return]


def tap_function_keywords(meta: TapMeta, device: Any = None) -> dict[str, Any]:
    """The keywords a tap function gets: the site's bound ones, and `device=` (`device`,
    or `meta.device` if None) where the site asked for it."""
    kwargs = {k: v for k, v in meta.meta.items() if k not in RESERVED_META}
    if meta.meta.get("tap_with_device"):
        if device is None and meta.device is not None and "device_platform" in meta.meta:
            names = _device_names(meta.meta.get("device_names"))
            name = names.get(str(meta.device))
            device = TapDevice(str(meta.meta["device_platform"]), meta.device, name)
        kwargs["device"] = meta.device if device is None else device
    return kwargs


@functools.lru_cache(maxsize=64)
def _device_names(text: Any) -> dict[str, str]:
    """A site's `device_names` meta, read: {} where it is missing or malformed."""
    try:
        names = json.loads(text) if isinstance(text, str) else {}
    except ValueError:
        return {}
    if not isinstance(names, dict):
        return {}
    return {str(k): v for k, v in names.items() if isinstance(v, str)}


def call_tap_function(arg: Any, meta: TapMeta) -> None:
    function = _cached_resolve(meta.consumer)
    function(arg, meta.transforms, **tap_function_keywords(meta))


@functools.lru_cache(maxsize=1024)
def _cached_resolve(consumer: str) -> Callable[..., Any]:
    return resolve(consumer)


def serve_module(module_name: str, subscriber: Subscriber) -> Subscriber:
    """Register the handler that runs `module_name`'s tap functions on `subscriber`."""
    importlib.import_module(module_name)  # fail now, not at the first tap
    subscriber.add_handler(f"{module_name}:*", call_tap_function)
    return subscriber
