"""When a daemon with no clients stops by itself (`--idle-exit`; a daemon started on
demand has 600 s unless told otherwise, one started by hand or by a service never)."""

from __future__ import annotations


class IdleExit:
    """Says when there have been no clients (emitters, their rings, subscribers) and
    nothing to deliver for `limit` seconds, counted from the start or the last client."""

    def __init__(self, limit: float | None, now: float) -> None:
        self.limit = limit
        self._idle_since = now

    def due(self, has_clients: bool, now: float) -> bool:
        if self.limit is None:
            return False
        if has_clients:
            self._idle_since = now
            return False
        return now - self._idle_since >= self.limit
