"""Sampling on the device (issue 51): a sampled-out tap of a gathered computation moves
nothing, as a dormant one does.

A site's tap is sent where its seq (per consumer and device, counting every execution)
is a multiple of W = K * N: K the site's own `every=K`, N the one-in-N its subscribers
ask (the ring's site table). The ring decides that as it writes (`TakeTap`), so on the
gathered path, where the device keeps every tap of a woken site, a sampled-out tap
used to travel to the host only to be counted there. Now a call's flags give each
sampled site its W and its phase: the seq its first tap in the call will take, modulo
W. The device keeps the taps whose phase plus the site's taps so far this call is a
multiple of W (rewrite.`_kept`), and each record carries its place among its site's
taps, so that the writer gives it exactly the seq its tap takes, counting the taps
before it as skipped (`tapd_ring_write_gathered`). The ring then checks it as before:
where a phase was guessed wrong, a kept tap whose seq is not a multiple of W is counted
as skipped, never sent with a wrong seq, and the guess is right again once the calls
before it are written.

The phase is the seq the consumer takes next on that device (`tapd_ring_next_seq`), or,
while calls dispatched before this one have not yet been written, what they leave it
at: once a consumer has been sampled, each call that taps it reserves its taps as it is
dispatched, where their count is known (`Reservations`; a call with a tapping `while`,
or a branch that taps in one arm only, reserves nothing, and the next call guesses from
the ring).

Where it applies: a site with a ring, not `always` (id_tap's), the only site of its
consumer in the computation (a seq counts a consumer's taps over all its sites), with
W below 2**30 (an int32's modulo). Elsewhere the device keeps every tap of a woken site
and the ring samples, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from tapd.native import library
from tapd.protocol.ring_format import EVERY_ALL, EVERY_ALWAYS_BIT, EVERY_DORMANT

MOST = 2**30  # the largest W the device samples (above it, the ring does)


def keep_flag(own_every: int, wanted: int) -> int:
    """A site's flag (`Gathered.awake`): 0 dormant, 1 every tap kept, W > 1 one in W.
    `own_every`: the site's K (with the always bit); `wanted`: its N in the ring's
    table (EVERY_ALL, EVERY_DORMANT or N)."""
    if own_every & EVERY_ALWAYS_BIT:
        return 1
    if wanted == EVERY_DORMANT:
        return 0
    own = own_every or 1
    every = own * (1 if wanted == EVERY_ALL else wanted)
    if every < MOST:
        return every
    # (The device keeps one in K, the ring the rest of its sampling: a log sized for
    # one in K, choose.most_kept, holds them.)
    return own if own < MOST else 1


class Reservations:
    """The seq each (ring, consumer, device) takes next once the calls dispatched so
    far are written, where their counts were known (see the module docstring)."""

    def __init__(self) -> None:
        self._next: dict[tuple[int, int, int], int | None] = {}
        self._lock = threading.Lock()

    def start(self, ring: int, consumer: int, device: int, taps: int | None, idle: bool) -> int:
        """The seq a call's first tap of `consumer` on `device` takes, its `taps` (None:
        not known) reserved after it. `idle`: no call's taps wait to be written."""
        lib = library.load()
        now = int(lib.tapd_ring_next_seq(ring, consumer, device)) if lib is not None else 0
        key = (ring, consumer, device)
        with self._lock:
            reserved = self._next.get(key)
            start = now if idle or reserved is None else max(now, reserved)
            self._next[key] = None if taps is None else start + taps
        return start


reservations = Reservations()
# (ring, consumer) that has had a site sampled (W > 1): from then on every gathered call
# that taps it reserves its taps, so that a sampled call after it knows its phase.
_sampled: set[tuple[int, int]] = set()


def note(ring: int, consumer: int, every: int) -> None:
    """A site of `consumer` in `ring` is sampled one in `every` now."""
    if every > 1:
        _sampled.add((ring, consumer))


def wanted(sites: Sequence[Any]) -> bool:
    """Whether a call of `sites` (gathered.host.SiteWriter) needs phases or reservations:
    one of its consumers has been sampled."""
    return bool(_sampled) and any((site.ring, site.consumer_id) in _sampled for site in sites)


def phases(
    keeps: Sequence[int],
    sites: Sequence[Any],
    device: int,
    counts: Sequence[int] | None,
    idle: bool,
) -> list[int]:
    """Each site's phase for a call: its first seq modulo its W (0 where W <= 1). Every
    sampled consumer's taps in the call are reserved (all its sites', kept or not).
    `sites`: the gathered.host.SiteWriter of each; `counts`: each site's taps in the
    call, where known."""
    taps: dict[tuple[int, int], int | None] = {}
    for i, site in enumerate(sites):
        key = (site.ring, site.consumer_id)
        if site.ring is None or key not in _sampled:
            continue
        # (the counts are known for every site of a call, or for none)
        taps[key] = None if counts is None else (taps.get(key) or 0) + int(counts[i])
    starts = {
        key: reservations.start(key[0], key[1], device, count, idle) for key, count in taps.items()
    }
    result = []
    for keep, site in zip(keeps, sites, strict=True):
        start = starts.get((site.ring, site.consumer_id))
        result.append(start % keep if keep > 1 and start is not None else 0)
    return result
