"""Put a step's shards back together: one handler call with the global array.

In a `pmap`/`shard_map` job every device taps its own shard, from every process, through
its host's daemon. `Assembler` wraps a handler: it collects the taps of one
(consumer, step) until `shards` of them arrived, then calls the handler once with the
shards stacked in (process, device) order, which is pmap's device order. Steps still
incomplete after `timeout` seconds are reported to `on_incomplete` (by default a
logged error) and dropped, never waited for forever. It needs device ids, which the
native backend provides and the portable one cannot.

    sub = Subscriber([host0, host1])
    sub.add_handler("grads", Assembler(show_global, shards=8, timeout=30))
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tapd_client.meta import TapMeta

logger = logging.getLogger("tapd.subscriber")

AssembledHandler = Callable[[Any, list[TapMeta]], object]
IncompleteHandler = Callable[[str, int | None, list[TapMeta]], object]


@dataclasses.dataclass
class _Pending:
    first_seen: float
    shards: dict[tuple[int, int], tuple[Any, TapMeta]] = dataclasses.field(default_factory=dict)


def _log_incomplete(consumer: str, step: int | None, metas: list[TapMeta]) -> None:
    have = sorted((m.process, m.device) for m in metas)
    logger.error("step %s of %r is incomplete: only shards %s arrived", step, consumer, have)


class Assembler:
    """A subscriber handler that calls `handler(global_value, metas)` once per step."""

    def __init__(
        self,
        handler: AssembledHandler,
        *,
        shards: int,
        timeout: float = 60.0,
        on_incomplete: IncompleteHandler = _log_incomplete,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if shards <= 0:
            raise ValueError(f"shards must be positive, got {shards}")
        self.handler = handler
        self.shards = shards
        self.timeout = timeout
        self.on_incomplete = on_incomplete
        self._clock = clock
        self._pending: dict[tuple[str, int | None], _Pending] = {}
        self._lock = threading.Lock()
        self.unordered = 0  # taps without a device id, which cannot be placed
        self.__qualname__ = f"Assembler({getattr(handler, '__qualname__', handler)})"

    def __call__(self, arg: Any, meta: TapMeta) -> None:
        self.expire()
        if meta.device is None:  # the portable backend cannot say which device tapped
            self.unordered += 1
            if self.unordered == 1:
                logger.error("cannot assemble %r: its taps carry no device id (the portable "
                             "backend does not know it); use the native backend",
                             meta.consumer)  # fmt: skip
            return
        key = (meta.consumer, meta.step)
        with self._lock:
            pending = self._pending.setdefault(key, _Pending(self._clock()))
            # Each device's shard once; a re-delivery after a daemon restart replaces it.
            pending.shards[(meta.process, meta.device)] = (arg, meta)
            if len(pending.shards) < self.shards:
                return
            del self._pending[key]
        ordered = [pending.shards[k] for k in sorted(pending.shards)]
        self.handler(_stack([value for value, _ in ordered]), [m for _, m in ordered])

    def expire(self) -> None:
        """Report and forget steps waiting longer than `timeout` (also runs on each tap)."""
        now = self._clock()
        with self._lock:
            stale = [k for k, p in self._pending.items() if now - p.first_seen > self.timeout]
            expired = [(k, self._pending.pop(k)) for k in stale]
        for (consumer, step), pending in expired:
            self.on_incomplete(consumer, step, [m for _, m in pending.shards.values()])


def _stack(values: list[Any]) -> Any:
    """Stack shards leaf by leaf: arrays along a new leading axis, dicts key by key."""
    first = values[0]
    if isinstance(first, dict):
        return {key: _stack([v[key] for v in values]) for key in first}
    if isinstance(first, list | tuple):
        return type(first)(_stack([v[i] for v in values]) for i in range(len(first)))
    return np.stack([np.asarray(v) for v in values])
