"""Consumer names and the patterns that select them: one rule for every party.

A pattern is a consumer name, taken exactly, or a prefix written `prefix*` ("module:*"
takes every function of a module, "*" takes everything). The daemon routes by it, the
subscriber library dispatches by it and `tapd replay` filters by it: all import it from
here. Plain Python, no JAX: `tapd_client` imports it too.
"""

from __future__ import annotations

from collections.abc import Iterable

# The most characters of a consumer name or pattern, a host, subscriber or group name:
# what the wire protocol accepts (tapd/protocol/schema.py) and what a tap may be named.
MAX_NAME = 256


def matches(pattern: str, consumer: str) -> bool:
    """Whether `pattern` (exact, or `prefix*`) selects `consumer`."""
    return consumer == pattern or (pattern.endswith("*") and consumer.startswith(pattern[:-1]))


def matches_any(patterns: Iterable[str], consumer: str) -> bool:
    return any(matches(pattern, consumer) for pattern in patterns)


def first_match(patterns: Iterable[str], consumer: str) -> str | None:
    """The first of `patterns` that selects `consumer`, else None."""
    return next((pattern for pattern in patterns if matches(pattern, consumer)), None)
