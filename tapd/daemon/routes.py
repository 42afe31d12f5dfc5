"""The daemon's table from consumer to target: which routing targets take the taps of a
consumer from an emitter, looked up twice per tap and so cached until the targets change
(a hello, a bye, a subscriber found silent: tapd/daemon/subscribers.py says `changed`).
"""

from __future__ import annotations

from collections.abc import Callable

from tapd.daemon.deliveries import Emitter
from tapd.daemon.targets.base import Target

# Consumer and emitter names whose routing targets are memoized: a peer may send taps of
# a million distinct names; past this many the memo starts again (tapd/daemon/bounds.py).
_TARGETS_CACHED = 4096


class Routes:
    """`targets()`: every routing target (a pool is one; its members are not)."""

    def __init__(self, targets: Callable[[], list[Target]]) -> None:
        self._targets = targets
        # by (consumer, emitter name or None); cleared on any change of the targets
        self._table: dict[tuple[str, str | None], list[Target]] = {}
        self.generation = 0  # grows with each change of the targets (tapd/daemon/wants.py)
        self._sampling: bool | None = None  # whether any target samples (None: not known)

    def changed(self) -> None:
        """The targets changed: forget what was looked up."""
        self._table.clear()
        self.generation += 1
        self._sampling = None

    def targets_of(self, consumer: str, emitter: Emitter | None = None) -> list[Target]:
        """The targets that want `consumer`; for a tap of `emitter` that none of them
        takes (`Subscription.takes`), also that emitter's fallback subscribers for it."""
        key = (consumer, None if emitter is None else emitter.name)
        targets = self._table.get(key)
        if targets is None:
            every = self._targets()
            targets = [t for t in every if t.subscription.wants(consumer)]
            if emitter is not None and not any(t.subscription.takes(consumer) for t in targets):
                targets += [
                    t
                    for t in every
                    if t not in targets and t.subscription.falls_back(consumer, emitter.name)
                ]
            if len(self._table) >= _TARGETS_CACHED:  # (names are the peers' to pick)
                self._table.clear()
            self._table[key] = targets
        return targets

    def samples_any(self) -> bool:
        """Whether any target asks for `every` (else no tap is thinned: one check)."""
        if self._sampling is None:
            self._sampling = any(
                t.subscription.every or any(n > 1 for _, n in t.subscription.wanted or ())
                for t in self._targets()
            )
        return self._sampling
