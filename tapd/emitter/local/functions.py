"""A tap function of this process, as both of its receivers run it: its name for people,
the argument rebuilt with the site's own pytree types, and the way a run of taps may be
handed to it (`CallsByRun`). Shared by the local ring's receiver (tapd.emitter.local.path)
and the receiver a daemon feeds (tapd.emitter.local.fallback)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from tapd_client.meta import TapMeta

LOCAL_PREFIX = "local/"  # every local consumer's name starts so (docs/TAPPING.md)
MAX_QUALNAME = 96  # of the function's name in a local consumer name


@dataclasses.dataclass(frozen=True)
class LocalFunction:
    """A tap function of this process and what it needs of each tap: the site's pytree
    structure (so that it gets the very types it would have got from host_callback)."""

    function: Callable[..., Any]
    treedef: Any  # jax.tree_util.PyTreeDef
    flat: bool  # a tuple of leaves, which a tap's value already is (no rebuild)
    name: str  # for people (describe)
    leaf: bool = False  # one leaf, no container: a tap's value is the argument itself


class CallsByRun:
    """A local tap function that makes a run of its site's taps with what they share
    looked up once (tapd.debug's `Delivery`): the receiver runs a plain site's taps
    through `calls(transforms)`, a context whose value is a function of one tap's value,
    instead of calling the function once a tap."""

    def calls(self, transforms: Any) -> contextlib.AbstractContextManager[Callable[[Any], None]]:
        raise NotImplementedError


class Named:
    """A handler whose name (in the error a barrier raises) says what it runs."""

    def __init__(self, handler: Callable[[Any, TapMeta], None], name: str) -> None:
        self._handler = handler
        self.__qualname__ = name

    def __call__(self, value: Any, meta: TapMeta) -> None:
        self._handler(value, meta)


def describe(function: Any) -> str:
    """A tap function's name for people: its qualified name (a bound method's is
    `Class.method`), `partial(name)`, or its class's name for a callable object."""
    if isinstance(function, functools.partial):
        return f"partial({describe(function.func)})"
    qualname = getattr(function, "__qualname__", None)
    return qualname if isinstance(qualname, str) else type(function).__qualname__


def rebuild(treedef: Any, value: Any) -> Any:
    """The tapped value with the site's own pytree types (namedtuple classes, dataclasses,
    registered nodes) rather than the protocol's stand-ins."""
    leaves: list[Any] = []

    def walk(node: Any) -> None:
        if node is None:
            return
        if isinstance(node, tuple | list):
            for child in node:
                walk(child)
        elif isinstance(node, dict):  # insertion order is the tree spec's order
            for child in node.values():
                walk(child)
        else:
            leaves.append(node)

    walk(value)
    if len(leaves) != treedef.num_leaves:
        return value
    return treedef.unflatten(leaves)
