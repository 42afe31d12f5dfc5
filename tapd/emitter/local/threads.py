"""Which threads of this process are tapd's receivers: a tap function runs there, and
must not wait for what its own run is part of (a barrier, a print's catch-up, a notebook
cell's drain). Each receiver adds its thread as it makes it (tapd.emitter.local.path,
tapd.emitter.local.fallback); everyone else asks `on_receiver_thread()`, which a write to
stdout asks each time (tapd.emitter.print_order.stdout): one set lookup."""

from __future__ import annotations

import threading

_receivers: frozenset[threading.Thread] = frozenset()  # (replaced whole: read unlocked)
_lock = threading.Lock()


def add(thread: threading.Thread) -> None:
    """`thread` runs tap functions (for the life of the process)."""
    global _receivers
    with _lock:
        _receivers = _receivers | {thread}


def on_receiver_thread() -> bool:
    """Whether the caller is a tap function run by one of tapd's receivers."""
    return threading.current_thread() in _receivers
