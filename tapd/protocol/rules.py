"""How tapd/protocol/schema.py says what a field must be: the limits a decoder enforces,
rules made from them (`Int`, `Str`, `Of`, `ListOf`), and `check_fields`, which holds a
message to a schema of such rules. The rules themselves, message kind by kind, are
schema.py's; this module imports nothing from tapd.protocol.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from tapd.consumers import MAX_NAME
from tapd.errors import ProtocolError


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a decoder enforces before it trusts anything in a message."""

    max_header_bytes: int = 1 << 20
    max_leaves: int = 4096
    max_tree_depth: int = 64
    max_ndim: int = 32
    max_message_bytes: int = 1 << 30
    max_batch: int = 4096  # taps in one `taps` message
    max_name: int = MAX_NAME  # consumer names and patterns, host and subscriber names
    max_id: int = 512  # daemon ids, emitter names ("host:pid"), forwarder ids
    max_text: int = 8192  # an error's text
    max_patterns: int = 1024  # consumer patterns in a subscriber's hello
    max_window: int = 1 << 20  # a subscriber's window, in taps
    max_entries: int = 1 << 16  # errors in one ack; keys of meta; transforms
    max_path: int = 4096  # ring and sites paths in an emitter's hello
    max_sites_bytes: int = 64 << 20  # a ring's whole `.sites` file
    max_outcome_ranges: int = 16384  # in a barrier_done to a forwarder


DEFAULT_LIMITS = Limits()

U64_MAX = 2**64 - 1
I64_MIN = -(2**63)


# ---- field rules -----------------------------------------------------------------------

# A rule checks one value and returns None, or (reason, complaint).
Complaint = tuple[str, str] | None
Rule = Callable[[Any, Limits], Complaint]


def is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass in Python, never one on the wire


def Int(lo: int = I64_MIN, hi: int = U64_MAX, *, optional: bool = False) -> Rule:
    def rule(value: Any, limits: Limits) -> Complaint:
        if value is None and optional:
            return None
        if not is_int(value):
            return ("bad_field", f"has bad type: {value!r:.60}")
        if not lo <= value <= hi:
            return ("bad_field", f"{value} is not within [{lo}, {hi}]")
        return None

    rule.types = (int, type(None)) if optional else int  # type: ignore[attr-defined]
    return rule


def Str(limit: str | None = None, *, empty: bool = True) -> Rule:
    """A str of at most `getattr(limits, limit)` characters (unbounded: None)."""

    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, str):
            return ("bad_field", f"has bad type: {value!r:.60}")
        if not empty and not value:
            return ("bad_field", "is empty")
        bound = getattr(limits, limit) if limit else None
        if bound is not None and len(value) > bound:
            return ("too_large", f"is {len(value)} characters long; the limit is {bound}")
        return None

    rule.types = str  # type: ignore[attr-defined]
    return rule


def Of(types: type | tuple[type, ...]) -> Rule:
    """Only a type (containers whose insides other checks look at)."""

    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _tuple(types)):
            return ("bad_field", f"has bad type: {value!r:.60}")
        return None

    rule.types = types  # type: ignore[attr-defined]
    return rule


def _tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def ListOf(item: Rule, limit: str, *, empty: bool = True) -> Rule:
    def rule(value: Any, limits: Limits) -> Complaint:
        if not isinstance(value, list):
            return ("bad_field", f"has bad type: {value!r:.60}")
        bound = getattr(limits, limit)
        if len(value) > bound:
            return ("too_large", f"has {len(value)} entries; the limit is {bound}")
        if not empty and not value:
            return ("bad_field", "is empty")
        for index, entry in enumerate(value):
            complaint = item(entry, limits)
            if complaint is not None:
                return (complaint[0], f"entry {index} {complaint[1]}")
        return None

    rule.types = list  # type: ignore[attr-defined]
    return rule


@dataclasses.dataclass(frozen=True)
class Field:
    rule: Rule
    required: bool = True


def req(rule: Rule) -> Field:
    return Field(rule, True)


def opt(rule: Rule) -> Field:
    return Field(rule, False)


Schema = Mapping[str, Field]


# ---- checks ----------------------------------------------------------------------------

_MISSING = object()


def check_fields(
    kind: str, header: Mapping[str, Any], schema: Schema, limits: Limits = DEFAULT_LIMITS
) -> None:
    """Every field of `schema` that is required is there, and every one there obeys its
    rule; raises ProtocolError naming the kind, the field and what is wrong."""
    for name, field in schema.items():
        value = header.get(name, _MISSING)
        if value is _MISSING:
            if field.required:
                raise ProtocolError("bad_field", f"{kind!r} message lacks {name!r}")
            continue
        complaint = field.rule(value, limits)
        if complaint is not None:
            reason, why = complaint
            raise ProtocolError(reason, f"{kind!r} field {name!r} {why}")
