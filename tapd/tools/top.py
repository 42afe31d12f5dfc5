"""`tapd top`: a live view of one daemon, from its control socket (`tapd status --json`).

Each frame compares two `stats` replies: rates are the change of the daemon's totals
over the time between them. Per emitter: taps/s and MB/s received, its ring's fill (the
emitter's queue, on the native path), taps pending, dropped, unrouted. Per subscriber
(one row per subscriber process, with the consumers it takes): taps/s and MB/s handled
(acknowledged), its queue's fill (bytes held of the daemon's `--queue-bytes`), queued and
in-flight taps, dropped, handler errors, and lag: how long ago (by the daemon's clock)
the last tap it handled was tapped (its `meta.time`, by the emitter's clock; "-" until
it has handled one). The first line has the daemon's totals, taps
lost with subscribers that died among them.

`frame()` is pure (stats in, lines out); `run()` draws with plain ANSI escapes, reads
keys without echo when stdin is a terminal (`q` quits, `s` changes the sort), and prints
one frame and returns with `once`.
"""

from __future__ import annotations

import dataclasses
import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

SORTS = ("rate", "name", "drops")


@dataclasses.dataclass(frozen=True)
class Sample:
    stats: dict[str, Any]
    at: float  # time.monotonic() when it came


def _rate(now: float, before: float | None, seconds: float) -> float:
    return 0.0 if before is None or seconds <= 0 else max(0.0, now - before) / seconds


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], width: int) -> list[str]:
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = []
    for row in cells:
        text = "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        out.append(text[:width])
    return out


def frame(
    previous: Sample | None,
    current: Sample,
    *,
    endpoint: str,
    sort: str = "rate",
    width: int = 160,
) -> list[str]:
    """The lines of one frame of `tapd top`."""
    stats = current.stats
    seconds = current.at - previous.at if previous is not None else 0.0
    old = previous.stats if previous is not None else {}
    counters = stats.get("counters", {})
    old_counters = old.get("counters", {})

    def counter_rate(name: str) -> float:
        return _rate(counters.get(name, 0), old_counters.get(name), seconds)

    lines = [
        f"tapd top - {endpoint} - daemon {stats.get('daemon', '?')} (pid {stats.get('pid', '?')})"
        f" - {time.strftime('%H:%M:%S')} - sort: {sort} (s), quit: q",
        f"received {counters.get('taps_received', 0):,} taps "
        f"({_num(counter_rate('taps_received'))}/s, "
        f"{counter_rate('bytes_received') / 1e6:.1f} MB/s), "
        f"handled {counters.get('deliveries_acked', 0):,}, "
        f"dropped {counters.get('deliveries_dropped', 0):,}, "
        f"lost {counters.get('deliveries_lost', 0):,}, "
        f"unrouted {counters.get('taps_unrouted', 0):,}, "
        f"refused {counters.get('taps_refused', 0):,}, "
        f"handler errors {counters.get('handler_errors', 0):,}",
        "",
    ]
    now = stats.get("time") or time.time()  # the daemon's clock, when it answered
    rings = {ring.get("writer_pid"): ring for ring in stats.get("rings", [])}
    old_emitters = {e["name"]: e for e in old.get("emitters", [])}
    rows = []
    for e in stats.get("emitters", []):
        before = old_emitters.get(e["name"], {})
        taps = _rate(e["taps"], before.get("taps"), seconds)
        mb = _rate(e.get("bytes", 0), before.get("bytes"), seconds) / 1e6
        pid = e["name"].rpartition(":")[2]
        ring = rings.get(int(pid)) if pid.isdigit() else None
        fill = "-"
        dropped = e["dropped"]
        if ring is not None:
            fill = f"{100 * (ring['committed'] - ring['released']) / max(1, ring['capacity']):.0f}%"
            dropped += ring.get("dropped", 0)
        rows.append(
            (
                taps,
                e["name"],
                dropped,
                [
                    e["name"],
                    _num(taps),
                    f"{mb:.1f}",
                    fill,
                    f"{e['pending']:,}",
                    f"{e['taps']:,}",
                    f"{dropped:,}",
                    f"{e['unrouted']:,}",
                    _lag(now, e.get("last_handled_time")),
                ],
            )
        )
    header = [
        "name",
        "taps/s",
        "MB/s",
        "ring fill",
        "pending",
        "taps",
        "dropped",
        "unrouted",
        "lag",
    ]
    if rows:
        lines += ["EMITTERS", *_table(header, _sorted(rows, sort), width)]
    else:
        lines.append("EMITTERS: none")
    lines.append("")
    queue_bytes = stats.get("queue_bytes") or 0
    # A worker pool is a row of its own (its queue, its members' taps), beside its members.
    peers = [*stats.get("subscribers", []), *stats.get("groups", [])]
    old_subscribers = {s["name"]: s for s in [*old.get("subscribers", []), *old.get("groups", [])]}
    rows = []
    for s in peers:
        before = old_subscribers.get(s["name"], {})
        taps = _rate(s["delivered"], before.get("delivered"), seconds)
        mb = _rate(s.get("delivered_bytes", 0), before.get("delivered_bytes"), seconds) / 1e6
        fill = f"{100 * s['held_bytes'] / queue_bytes:.0f}%" if queue_bytes else "-"
        consumers = ",".join(s["consumers"])
        who = f"pool:{s['group']}[{len(s['members'])}]" if "members" in s else s["name"]
        rows.append(
            (
                taps,
                consumers,
                s["dropped"],
                [
                    consumers[:40],
                    who,
                    _num(taps),
                    f"{mb:.1f}",
                    fill,
                    f"{s['queued']:,}",
                    f"{s['in_flight']:,}",
                    f"{s['delivered']:,}",
                    f"{s['dropped']:,}",
                    f"{s['errors']:,}",
                    _lag(now, s.get("last_handled_time")),
                ],
            )
        )
    header = [
        "consumers",
        "subscriber",
        "taps/s",
        "MB/s",
        "queue fill",
        "queued",
        "in flight",
        "handled",
        "dropped",
        "errors",
        "lag",
    ]
    if rows:
        lines += [
            "CONSUMERS (one row per subscriber, and per worker pool)",
            *_table(header, _sorted(rows, sort), width),
        ]
    else:
        lines.append("CONSUMERS: no subscriber")
    if forward := stats.get("forward"):
        lines += ["", f"forwarding to {forward.get('endpoint')}: held {forward.get('held', 0)}"]
    return lines


def _lag(now: float, handled: float | None) -> str:
    if handled is None:
        return "-"
    return f"{now - handled:.1f}s"  # (negative: the emitter's clock is ahead of ours)


def _sorted(rows: list[tuple[float, str, int, list[str]]], sort: str) -> list[list[str]]:
    if sort == "name":
        rows = sorted(rows, key=lambda r: r[1])
    elif sort == "drops":
        rows = sorted(rows, key=lambda r: (-r[2], r[1]))
    else:
        rows = sorted(rows, key=lambda r: (-r[0], r[1]))
    return [r[3] for r in rows]


def run(
    fetch: Callable[[], dict[str, Any]],
    *,
    endpoint: str,
    interval: float = 1.0,
    once: bool = False,
    out: TextIO = sys.stdout,
    keys: TextIO | None = None,
) -> None:
    """Draw frames until `q` (or, with `once`, print one frame: two samples `interval`
    apart, so that rates mean something). `fetch` returns the daemon's stats and raises
    TimeoutError if it does not answer."""
    previous = Sample(fetch(), time.monotonic())
    if once:
        time.sleep(interval)
        current = Sample(fetch(), time.monotonic())
        out.write("\n".join(frame(previous, current, endpoint=endpoint)) + "\n")
        return
    tty = out.isatty()
    sort = SORTS[0]
    restore = _cbreak(keys) if keys is not None else None
    try:
        if tty:
            out.write("\x1b[?1049h\x1b[?25l")  # the alternate screen, no cursor (as top)
        current = previous
        while True:
            width = os.get_terminal_size(out.fileno()).columns if tty else 160
            lines = frame(previous, current, endpoint=endpoint, sort=sort, width=width)
            if tty:
                out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
            else:
                out.write("\n".join(lines) + "\n\n")
            out.flush()
            key = _key(keys, interval)
            if key == "q":
                return
            if key == "s":
                sort = SORTS[(SORTS.index(sort) + 1) % len(SORTS)]
            else:
                previous, current = current, Sample(fetch(), time.monotonic())
    finally:
        if tty:
            out.write("\x1b[?25h\x1b[?1049l")
            out.flush()
        if restore is not None:
            restore()


def _key(keys: TextIO | None, timeout: float) -> str | None:
    """A key pressed within `timeout` s (None: none, or no terminal to read)."""
    if keys is None:
        time.sleep(timeout)
        return None
    ready, _, _ = select.select([keys], [], [], timeout)
    if not ready:
        return None
    text = os.read(keys.fileno(), 32).decode(errors="replace")
    return text[-1:].lower() if text else "q"  # (end of input: quit)


def _cbreak(keys: TextIO) -> Callable[[], None] | None:
    """Keys without Enter and without echo, while top runs; what undoes it."""
    if not keys.isatty():
        return None
    import termios
    import tty

    saved = termios.tcgetattr(keys.fileno())
    tty.setcbreak(keys.fileno())
    return lambda: termios.tcsetattr(keys.fileno(), termios.TCSADRAIN, saved)
