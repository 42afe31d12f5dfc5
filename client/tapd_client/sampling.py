"""A subscriber's sampling: `@sub.on("acts", every=10)` takes only the taps of "acts"
whose seq is a multiple of 10 (times the site's own `every`). The daemon thins by it and
tells the emitter, which then copies nothing in between (docs/PROTOCOL.md, "Sampling").
Plain Python: no JAX."""

from __future__ import annotations

from typing import Any

from tapd.protocol.message import site_every
from tapd.protocol.schema import MAX_EVERY


class Sampling:
    """The `every` asked for each consumer pattern of one subscriber (1: all)."""

    def __init__(self) -> None:
        self.every: dict[str, int] = {}

    def add(self, consumer: str, every: int) -> None:
        if type(every) is not int or not 1 <= every <= MAX_EVERY:
            raise ValueError(
                f"every= for {consumer!r} must be an int from 1 to {MAX_EVERY}, got {every!r:.40}"
            )
        if every > 1:
            self.every[consumer] = every

    def add_to(self, hello: dict[str, Any]) -> None:
        """Into a hello's fields: `every` as [pattern, n] pairs, if any samples."""
        if self.every:
            hello["every"] = [[pattern, n] for pattern, n in self.every.items()]

    def modulus(self, pattern: str, fields: dict[str, Any]) -> int:
        """K * n: a tap dispatched by `pattern` is one it asked for iff its seq is a
        multiple (K the site's own `every`, from a header or a static entry; the
        daemon's rule, tapd/daemon/sampling.py)."""
        return self.every.get(pattern, 1) * site_every(fields)

    def keeps(self, pattern: str, header: dict[str, Any]) -> bool:
        """Whether the tap of `header`, dispatched by `pattern`, is one it asked for."""
        if pattern not in self.every:
            return True
        seq = header.get("seq")
        return type(seq) is not int or seq % self.modulus(pattern, header) == 0
