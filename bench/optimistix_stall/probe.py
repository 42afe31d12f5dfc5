"""Session 23's stall probe: which tapd host functions run, how long each takes, and
where every thread is while a timed loop runs (stack samples)."""

import collections
import os
import sys
import threading
import time
import traceback

CALLS = collections.defaultdict(list)  # name -> [(start, seconds, thread)]


def _timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            CALLS[name].append((t0, time.perf_counter() - t0, threading.current_thread().name))

    wrapper.__wrapped__ = fn
    return wrapper


def instrument():
    from tapd.emitter import host_writers, taps_as_outputs
    from tapd.emitter.gathered import host

    for meth in ("answered", "poll", "__call__", "write_packed"):
        setattr(host.Flush, meth, _timed(f"Flush.{meth}", getattr(host.Flush, meth)))
    original = host_writers.ring_writer

    def ring_writer(*a, **k):
        return _timed("per_tap.write_record", original(*a, **k))

    host_writers.ring_writer = ring_writer
    c = taps_as_outputs.Collector
    for meth in ("write_later", "received"):
        setattr(c, meth, _timed(f"Collector.{meth}", getattr(c, meth)))


def summary(since=0.0):
    lines = []
    for name, calls in sorted(CALLS.items()):
        calls = [c for c in calls if c[0] >= since]
        if not calls:
            continue
        d = sorted(c[1] for c in calls)
        threads = collections.Counter(c[2] for c in calls)
        lines.append(
            f"  {name}: n={len(d)} total={sum(d):.4f}s max={d[-1] * 1e3:.2f}ms "
            f"median={d[len(d) // 2] * 1e3:.3f}ms threads={dict(threads)}"
        )
    return "\n".join(lines)


class Sampler:
    def __init__(self, period=0.005):
        self.period = period
        self.samples = collections.Counter()
        self.total = 0
        self._on = False

    def __enter__(self):
        self._on = True
        self._thread = threading.Thread(target=self._run, name="s23-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._on = False
        self._thread.join()

    def _run(self):
        me = threading.get_ident()
        while self._on:
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = traceback.extract_stack(frame)[-7:]
                key = (
                    names.get(ident, f"foreign-{ident}"),
                    " <- ".join(
                        f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                        for f in reversed(stack)
                    ),
                )
                self.samples[key] += 1
            self.total += 1
            time.sleep(self.period)

    def report(self, top=14):
        out = [f"  stack samples: {self.total}"]
        for (thread, stack), n in self.samples.most_common(top):
            out.append(f"  {n:5d} [{thread}] {stack}")
        return "\n".join(out)


def timeline(since, printed=(), limit=120):
    """Each timed call's start (ms after `since`) and duration; the printed lines' times."""
    out = []
    for name, calls in sorted(CALLS.items()):
        calls = [c for c in calls if c[0] >= since][:limit]
        if calls and not name.startswith("Collector.received"):
            out.append(
                f"  timeline {name}: "
                + " ".join(f"{(c[0] - since) * 1e3:.0f}+{c[1] * 1e3:.1f}" for c in calls)
            )
    lines = [t for t in printed if t >= since][:limit]
    if lines:
        out.append("  timeline printed: " + " ".join(f"{(t - since) * 1e3:.0f}" for t in lines))
    return "\n".join(out)


class NoSampler:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def report(self, top=0):
        return "  (not sampled)"
