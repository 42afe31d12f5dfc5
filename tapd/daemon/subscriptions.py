"""A subscriber's hello, read into what the router acts on (docs/PROTOCOL.md, "hello").

Decode checked every field (tapd/protocol/schema.py, SUBSCRIBER_HELLO); here they are
given their meaning: which consumers are fallbacks and for which emitter, which worker
pool it joins, whether it only adds consumers to its session (`update`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tapd.daemon.targets.base import Subscription
from tapd.protocol.rules import DEFAULT_LIMITS


@dataclasses.dataclass(frozen=True)
class Hello:
    consumers: list[str]
    subscription: Subscription
    group: str | None
    window: int
    batch: bool
    update: bool
    name: str
    columns: bool = False  # it decodes columnar runs (docs/PROTOCOL.md, "taps")

    @classmethod
    def of(cls, header: dict[str, Any]) -> Hello:
        consumers = header["consumers"]
        owner = header.get("fallback_for")
        marked = header.get("fallback")
        fallback = [c for c in consumers if isinstance(marked, list) and c in marked]
        group = header.get("group")  # a worker pool's members have no fallbacks
        if group is not None or not (
            isinstance(owner, str) and 0 < len(owner) <= DEFAULT_LIMITS.max_id
        ):
            owner, fallback = None, []
        patterns = tuple(c for c in consumers if c not in fallback)
        if group is not None:  # (a group's key: in whatever order its members list them)
            patterns = tuple(sorted(set(patterns)))
        # (pattern, n) of the hello's `every` (schema.py checked each names a consumer)
        every = tuple((p, n) for p, n in header.get("every", []) if p in patterns and n > 1)
        return cls(
            consumers=consumers,
            subscription=Subscription(patterns, tuple(fallback), owner, every),
            group=group,
            window=header["window"],
            batch=header.get("batch") is True,
            update=header.get("update") is True,
            name=str(header.get("name", "")),
            columns=header.get("columns") is True,
        )

    @property
    def patterns(self) -> tuple[str, ...]:
        return self.subscription.patterns
