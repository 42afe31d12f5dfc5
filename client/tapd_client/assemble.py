"""Put a step's shards back together: one handler call with the global value.

In a `pmap`/`shard_map` job every device taps its own block, from every process,
through its host's daemon. `Assembler` wraps a handler: it collects the taps of one
(consumer, step) until every shard arrived, then calls the handler once with the global
value. Taps carry their shard layout (`meta.shard`: mesh coordinates, global shapes),
so each block goes where it belongs, whichever backend tapped it, and the number of
shards comes from the layout too. Taps without a layout (from tapd before it, say) are
stacked in (process, device) order, which needs `shards=` and the native backend's
device ids. Steps still incomplete after `timeout` seconds are reported to
`on_incomplete` (by default a logged error) and dropped, never waited for forever.
Tap with `step=` so that the blocks of one step can be told from the next one's.

    sub = Subscriber([host0, host1])
    sub.add_handler("grads", Assembler(show_global, timeout=30))
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tapd.protocol import flatten, unflatten
from tapd_client.meta import TapMeta

logger = logging.getLogger("tapd.subscriber")

AssembledHandler = Callable[[Any, list[TapMeta]], object]
IncompleteHandler = Callable[[str, int | None, list[TapMeta]], object]


ShardKey = tuple[int, ...]


@dataclasses.dataclass
class _Pending:
    first_seen: float
    expected: int
    shards: dict[ShardKey, tuple[Any, TapMeta]] = dataclasses.field(default_factory=dict)


def _log_incomplete(consumer: str, step: int | None, metas: list[TapMeta]) -> None:
    have = sorted(m.shard.coords if m.shard else (m.process, m.device or 0) for m in metas)
    logger.error("step %s of %r is incomplete: only shards %s arrived", step, consumer, have)


class Assembler:
    """A subscriber handler that calls `handler(global_value, metas)` once per step."""

    def __init__(
        self,
        handler: AssembledHandler,
        *,
        shards: int | None = None,
        timeout: float = 60.0,
        on_incomplete: IncompleteHandler = _log_incomplete,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if shards is not None and shards <= 0:
            raise ValueError(f"shards must be positive, got {shards}")
        self.handler = handler
        self.shards = shards
        self.timeout = timeout
        self.on_incomplete = on_incomplete
        self._clock = clock
        self._pending: dict[tuple[str, int | None], _Pending] = {}
        self._lock = threading.Lock()
        self.unplaced = 0  # taps that carry neither a layout nor a device id
        self.__qualname__ = f"Assembler({getattr(handler, '__qualname__', handler)})"

    def __call__(self, arg: Any, meta: TapMeta) -> None:
        self.expire()
        placed = self._shard_key(meta)
        if placed is None:
            return
        shard, expected = placed
        key = (meta.consumer, meta.step)
        with self._lock:
            pending = self._pending.setdefault(key, _Pending(self._clock(), expected))
            # Each shard once; a re-delivery after a daemon restart replaces it.
            pending.shards[shard] = (arg, meta)
            if len(pending.shards) < pending.expected:
                return
            del self._pending[key]
        ordered = [pending.shards[k] for k in sorted(pending.shards)]
        metas = [m for _, m in ordered]
        if metas[0].shard is not None:
            value = _place([value for value, _ in ordered], metas)
        else:
            value = _stack([value for value, _ in ordered])
        self.handler(value, metas)

    def _shard_key(self, meta: TapMeta) -> tuple[ShardKey, int] | None:
        if meta.shard is not None:
            return meta.shard.coords, meta.shard.count
        if meta.device is not None and self.shards is not None:
            return (meta.process, meta.device), self.shards
        self.unplaced += 1
        if self.unplaced == 1:
            logger.error(
                "cannot assemble %r: its taps carry no shard layout%s",
                meta.consumer,
                "" if self.shards else " and Assembler was given no shards=",
            )
        return None

    def expire(self) -> None:
        """Report and forget steps waiting longer than `timeout` (also runs on each tap)."""
        now = self._clock()
        with self._lock:
            stale = [k for k, p in self._pending.items() if now - p.first_seen > self.timeout]
            expired = [(k, self._pending.pop(k)) for k in stale]
        for (consumer, step), pending in expired:
            self.on_incomplete(consumer, step, [m for _, m in pending.shards.values()])


def _place(values: list[Any], metas: list[TapMeta]) -> Any:
    """Write each block into its slice of the global arrays, leaf by leaf."""
    tree, _ = flatten(values[0])
    first = metas[0].shard
    assert first is not None
    blocks = [flatten(value)[1] for value in values]
    out = []
    for leaf, shape in enumerate(first.global_shapes):
        whole = np.empty(shape, dtype=np.asarray(blocks[0][leaf]).dtype)
        for leaves, meta in zip(blocks, metas, strict=True):
            assert meta.shard is not None
            where = meta.shard.block(leaf)
            whole[where] = np.asarray(leaves[leaf]).reshape(whole[where].shape)
        out.append(whole)
    return unflatten(tree, out)


def _stack(values: list[Any]) -> Any:
    """Stack shards leaf by leaf: arrays along a new leading axis, dicts key by key."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _stack([v[key] for v in values]) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(_stack([v[i] for v in values]) for i in range(len(first)))
    return np.stack([np.asarray(v) for v in values])
