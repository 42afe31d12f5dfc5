"""Pytree structure on the wire: flatten a Python value to (spec, leaves) and back.

The spec is plain msgpack data (docs/PROTOCOL.md, "tree spec"). Containers the
protocol knows (tuple, list, dict, namedtuple, None) keep their shape; any other pytree
node, described by the `custom` hook the JAX side supplies, travels as a dict from key
path to child, so a subscriber never needs the emitter's classes.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

from tapd.errors import ProtocolError, TapDefinitionError

TreeSpec = list[Any]
# Given a non-container value: None if it is a leaf, else (type name, key paths, children).
CustomNode = Callable[[Any], tuple[str, list[str], list[Any]] | None]

LEAF: TreeSpec = ["*"]


def _is_namedtuple(value: object) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def flatten(value: Any, custom: CustomNode | None = None) -> tuple[TreeSpec, list[Any]]:
    """Split `value` into a tree spec and its leaves, in spec order (dict keys sorted).
    Raises TapDefinitionError for a value that cannot travel (a dict key not str/int)."""
    leaves: list[Any] = []

    def walk(node: Any) -> TreeSpec:
        if node is None:
            return ["n"]
        if _is_namedtuple(node):
            return ["nt", type(node).__name__, list(node._fields), [walk(c) for c in node]]
        if isinstance(node, tuple):
            return ["t", [walk(c) for c in node]]
        if isinstance(node, list):
            return ["l", [walk(c) for c in node]]
        if isinstance(node, dict):
            keys = _sorted_keys(node)
            return ["d", keys, [walk(node[k]) for k in keys]]
        described = custom(node) if custom is not None else None
        if described is not None:
            name, paths, children = described
            return ["k", name, paths, [walk(c) for c in children]]
        leaves.append(node)
        return LEAF

    return walk(value), leaves


def _sorted_keys(mapping: dict[Any, Any]) -> list[Any]:
    for key in mapping:
        if not isinstance(key, str | int) or isinstance(key, bool):
            raise TapDefinitionError(
                f"dict key {key!r:.80} ({type(key).__name__}) cannot be tapped: only str and "
                f"int keys travel (the dict's keys: {list(mapping)!r:.120})"
            )
    try:
        return sorted(mapping)
    except TypeError:  # mixed str and int keys
        return sorted(mapping, key=lambda k: (isinstance(k, str), k))


def count_leaves(spec: TreeSpec, max_depth: int) -> int:
    """Validate `spec` and return how many leaves it expects."""
    count = 0

    def walk(node: Any, depth: int) -> None:
        nonlocal count
        if depth > max_depth:
            raise ProtocolError("bad_tree", f"tree deeper than {max_depth}")
        tag, children = _split(node)
        if tag == "*":
            count += 1
        for child in children:
            walk(child, depth + 1)

    walk(spec, 0)
    return count


def unflatten(spec: TreeSpec, leaves: Sequence[Any]) -> Any:
    """Rebuild the value `spec` describes from `leaves` (as many as it has leaf slots)."""
    return rebuilder(spec)(leaves)


def rebuilder(spec: TreeSpec) -> Callable[[Sequence[Any]], Any]:
    """`unflatten(spec, ·)`, with `spec` checked once: for the many taps of one site in a
    `taps` message, each rebuilt without walking and checking the spec again."""
    count = 0

    def build(node: Any) -> Callable[[Sequence[Any]], Any]:
        nonlocal count
        tag, children = _split(node)
        if tag == "*":
            index = count
            count += 1
            return lambda leaves: leaves[index]
        if tag == "n":
            return lambda leaves: None
        if children and all(child == LEAF for child in children) and tag in ("t", "l"):
            first, count = count, count + len(children)  # flat: one slice (the common tap)
            last, kind = count, (tuple if tag == "t" else list)
            return lambda leaves: kind(leaves[first:last])
        parts = [build(c) for c in children]
        if tag == "t":
            return lambda leaves: tuple([part(leaves) for part in parts])
        if tag == "l":
            return lambda leaves: [part(leaves) for part in parts]
        if tag == "nt":
            made = _namedtuple_type(node[1], tuple(node[2]))
            return lambda leaves: made(*[part(leaves) for part in parts])
        keys = node[1] if tag == "d" else node[2]  # "k": key path -> child
        return lambda leaves: dict(zip(keys, [part(leaves) for part in parts], strict=True))

    root = build(spec)
    total = count

    def rebuild(leaves: Sequence[Any]) -> Any:
        if len(leaves) != total:
            raise ProtocolError("bad_tree", f"tree has {total} leaves, message has {len(leaves)}")
        return root(leaves)

    return rebuild


def _split(node: Any) -> tuple[str, list[Any]]:
    """Check one spec node's shape; return its tag and children."""
    if not isinstance(node, list) or not node or not isinstance(node[0], str):
        raise ProtocolError("bad_tree", f"malformed tree node {node!r:.80}")
    tag = node[0]
    expected = {"*": 1, "n": 1, "t": 2, "l": 2, "d": 3, "nt": 4, "k": 4}.get(tag)
    if expected is None or len(node) != expected:
        raise ProtocolError("bad_tree", f"malformed tree node {node!r:.80}")
    if expected == 1:
        return tag, []
    children = node[-1]
    if not isinstance(children, list):
        raise ProtocolError("bad_tree", f"children of {tag!r} node are not a list")
    if tag in ("d", "nt", "k"):
        keys = node[-2]
        if not isinstance(keys, list) or len(keys) != len(children):
            raise ProtocolError("bad_tree", f"{tag!r} node has keys that do not match children")
        # Types first: `set` below must only ever see hashable keys.
        if tag == "d" and not all(
            isinstance(k, str | int) and not isinstance(k, bool) for k in keys
        ):
            raise ProtocolError("bad_tree", "dict keys must be str or int")
        if tag in ("nt", "k") and not (
            isinstance(node[1], str) and all(isinstance(k, str) for k in keys)
        ):
            raise ProtocolError("bad_tree", f"{tag!r} node needs a str name and str keys")
        if len(set(keys)) != len(keys):
            raise ProtocolError("bad_tree", f"{tag!r} node has duplicate keys")
    return tag, children


@functools.lru_cache(maxsize=256)
def _namedtuple_type(name: str, fields: tuple[str, ...]) -> Any:
    try:
        return collections.namedtuple(name, fields)
    except ValueError as exc:
        raise ProtocolError("bad_tree", f"bad namedtuple {name!r} {fields!r}") from exc
