"""`tapd status`: a daemon's stats (its `stats_reply`) as lines for people."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def summarize(stats: dict[str, Any]) -> Sequence[str]:
    """Human-readable lines for `tapd status`."""
    counters = stats["counters"]
    lines = [", ".join(f"{k}={v}" for k, v in sorted(counters.items())) or "no traffic yet"]
    started = stats.get("started") or {}
    idle = started.get("idle_exit")
    leaves = f"; stops after {idle:g} s without clients" if idle is not None else ""
    if started.get("on_demand"):
        lines.insert(0, f"started on demand by pid {started.get('by')}{leaves}")
    elif leaves:
        lines.insert(0, f"started by hand{leaves}")
    lines += [f"emitter {e['name']}: {e}" for e in stats["emitters"]]
    lines += [f"subscriber {s['name']}: {s}" for s in stats["subscribers"]]
    lines += [f"{g['name']}: {g}" for g in stats.get("groups", [])]
    lines += [f"ring {r['path']}: {r}" for r in stats.get("rings", [])]
    for path, sites in stats.get("wants", {}).items():
        if sites:
            wanted = ", ".join(f"{consumer} {_wanted(every)}" for _, consumer, every in sites)
            lines.append(f"tap sites of {path.rpartition('/')[2]}: {wanted}")
    if forward := stats.get("forward"):
        lines.append(f"forward to {forward['endpoint']}: {forward}")
    if metrics := stats.get("metrics"):
        lines.append(f"Prometheus metrics at {metrics}")
    return lines


def _wanted(every: int) -> str:
    """What the daemon wrote in a site's slot, in words (tapd/daemon/wants.py)."""
    from tapd.protocol.ring_format import EVERY_ALL, EVERY_DORMANT

    if every == EVERY_DORMANT:
        return "dormant"
    return "all" if every in (EVERY_ALL, 1) else f"every {every}"
