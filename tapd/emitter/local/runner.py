"""The running of a local ring's taps: the receiver thread (tapd.emitter.local.path)
hands each read's records here, which calls their tap functions in ring order.

The taps run as a subscriber runs a daemon's (tapd_client.handlers on `SiteRun`s; a run
of a plain site, whose function takes no `device=`, directly, with what the run's taps
share looked up once), from a copy of the ring's bytes, so that a function that keeps
its argument keeps an intact value. What a function raised is kept for the next barrier
(`failures`, `last_exception`); `running` and `calls` say what the receiver is doing and
whether it makes progress (the barrier's and the exit drain's messages).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from tapd import printing
from tapd.emitter.local.functions import CallsByRun, LocalFunction, Named, rebuild
from tapd.emitter.local.sites import LocalSites
from tapd.errors import failure_text
from tapd.native.ring import Records, Ring
from tapd.native.sites import Site
from tapd.print_worker import PrintWorker
from tapd.protocol.batch import SiteRun
from tapd.protocol.message import StaticEntry, stacked_leaves, tap_values
from tapd_client.daemon_link import ERROR_CHARS
from tapd_client.handlers import Handlers
from tapd_client.meta import MetaTemplate, TapMeta
from tapd_client.tap_functions import tap_function_keywords

logger = logging.getLogger("tapd.emitter")

# A run of at least this many taps of an id_print site has its arrays rendered by the
# print worker (tapd/print_worker.py), under TAPD_PRINT_WORKER=auto.
_PRINT_WORKER_FROM = 16
_ERRORS_KEPT = 100  # failures kept for the next barrier (each one's first line counted)


class _PlainSite(NamedTuple):
    """What every tap of a plain local site shares (LocalPath._plain_site)."""

    static: StaticEntry
    local: LocalFunction
    consumer: str
    transforms: Any
    keywords: dict[str, Any]
    printing: _Printing | None  # an id_print site whose arrays the print worker may render


class _Printing(NamedTuple):
    """An id_print site's call, taken apart: what `print_tap` would print around the
    value, and where (tapd.printing)."""

    header: str
    stream: Any
    threshold: int | None


def _printing(local: LocalFunction, meta: TapMeta, keywords: dict[str, Any]) -> _Printing | None:
    """An id_print site's call taken apart (`functools.partial(print_tap, ...)` of one
    array), for the print worker; None for any other function."""
    function = local.function
    if not (
        isinstance(function, functools.partial)
        and function.func is printing.print_tap
        and not function.args
        and local.leaf
    ):
        return None
    given = {**function.keywords, **keywords}
    stream, threshold = given.pop("output_stream", None), given.pop("threshold", None)
    header = printing.header_line(meta.transforms, given.pop("device", None), given)
    return _Printing(header, stream, threshold)


def _runs_of_equal(column: list[int]) -> Iterator[tuple[int, int]]:
    """(first, end) of each run of equal values in `column`: in one pass in C where the
    whole column is one value (a loop that taps one site), else by numpy."""
    count = len(column)
    if column.count(column[0]) == count:
        yield 0, count
        return
    starts = np.flatnonzero(np.diff(np.array(column))) + 1
    bounds = [0, *starts.tolist(), count]
    yield from itertools.pairwise(bounds)


class _Failures:
    """What `Handlers` reports of the taps it ran (the link it acknowledges to, for a
    subscriber): which failed, for the next barrier."""

    endpoint = "this process's local ring"

    def __init__(self) -> None:
        self.last_tid = -1
        self.taps: dict[int, tuple[str, int]] = {}  # tid -> (consumer, seq), this read
        self.errors: list[str] = []
        self.count = 0

    def fail(self, tid: int, text: str) -> None:
        consumer, seq = self.taps.get(tid, ("?", -1))
        self.count += 1
        if len(self.errors) >= _ERRORS_KEPT:
            del self.errors[0]
        # (only the newest keeps its traceback, as a subscriber's acks keep it)
        if self.errors:
            self.errors[-1] = self.errors[-1].partition("\n")[0]
        self.errors.append(f"{consumer}#{seq}: {text[:ERROR_CHARS]}")


class Runner:
    """Runs the tap functions of a local ring's records, in ring order."""

    def __init__(self, ring: Ring, sites: LocalSites, print_worker: str) -> None:
        self.ring = ring
        self._sites = sites
        self._functions = sites.functions  # (the same dict, one lookup less a tap)
        self._devices = {
            int(d.local_hardware_id): d
            for d in jax.local_devices()
            if d.local_hardware_id is not None
        }
        self._plain: dict[int, _PlainSite | None] = {}  # by site id: _plain_site
        self.print_worker = PrintWorker(print_worker)
        self._handlers = Handlers()
        self._handlers.add(
            sites.prefix + "*", Named(self._run, "tap function"), False, False, 1, None
        )
        self.failures = _Failures()
        self.last_exception: BaseException | None = None
        self.running: tuple[str, float] | None = None  # (function, since) while one runs
        self.calls = 0  # tap functions that returned (or raised): the receiver's progress
        self.abandoned = False  # exit gave up waiting: run nothing more
        self.not_run = 0  # taps read after that, not run

    def run(self, span: memoryview, records: Records, position: int) -> int:
        """Run the tap functions of `records` (read from `position` on, viewed by
        `span`), in order; the position after them (their ring space is the caller's
        to release)."""
        body = memoryview(bytes(span[: records.ends[-1] - position]))  # (a copy: docstring)
        failures = self.failures
        failures.taps.clear()
        sites = self._sites.registered()
        tid = failures.last_tid + 1  # the delivery id of the run's first tap
        column = records.sites
        for first, end in _runs_of_equal(column):
            site_id = column[first]
            if site_id >= len(sites):  # (a record is written after its site is registered)
                raise RuntimeError(
                    f"local ring record {records.starts[first]} of unknown site {site_id}"
                )
            if site_id not in self._plain:
                self._plain[site_id] = self._plain_site(sites[site_id][1], records, first)
            plain = self._plain[site_id]
            ran = plain is not None and self._run_plain(
                plain, body, records, first, end, position, tid
            )
            if not ran:
                self._run_handled(sites[site_id], body, records, first, end, position, tid)
            tid += end - first
        failures.last_tid = tid - 1
        return records.ends[-1]

    def _run_handled(
        self, entry: tuple[Site, StaticEntry], body: memoryview, records: Records,
        first: int, end: int, position: int, tid: int,
    ) -> None:  # fmt: skip
        """Taps first..end-1 of one site, run by `Handlers` as a subscriber runs a
        daemon's: `device=`, shards, odd metadata (which it reports)."""
        site, static = entry
        failures = self.failures
        rows = []
        for i in range(first, end):
            failures.taps[tid] = (site.consumer, records.seqs[i])
            start = records.starts[i] + self.ring.header_bytes - position
            coords = None
            if site.shard is not None:
                coords = site.coords(body[start : records.ends[i] - position])
            rows.append([0, tid, records.seqs[i], records.steps[i], records.devices[i],
                         records.times[i], coords, 0, start])  # fmt: skip
            tid += 1
        self._handlers.handle_taps(failures, [SiteRun(static, body, rows)])  # type: ignore[arg-type]

    def _plain_site(self, static: StaticEntry, records: Records, i: int) -> _PlainSite | None:
        """What every tap of a site whose function takes no per-tap keyword (no
        `device=`, no shard) needs, looked up once for the life of the site (record i is
        one of its taps); None for any other site, or one whose metadata is odd
        (`Handlers` runs those, and reports what is odd)."""
        fields = static.fields
        if fields.get("shard") is not None or fields.get("meta", {}).get("tap_with_device"):
            return None
        try:
            seq, step, device, time_ns = (records.seqs[i], records.steps[i],
                                          records.devices[i], records.times[i])  # fmt: skip
            header = static.tap_header([0, 0, seq, step, device, time_ns, None, 0, 0])
            meta = MetaTemplate(header).meta_of(seq, step, device, time_ns, None)
            local = self._functions[meta.consumer]
            keywords = tap_function_keywords(meta)
        except Exception:
            return None
        return _PlainSite(
            static,
            local,
            meta.consumer,
            meta.transforms,
            keywords,
            _printing(local, meta, keywords),
        )

    def _run_plain(
        self, plain: _PlainSite, body: memoryview, records: Records,
        first: int, end: int, position: int, tid: int,
    ) -> bool:  # fmt: skip
        """Taps first..end-1 of a plain site: what `Handlers` would do, with what the
        taps share looked up once (the per-call cost of an id_tap in a hot step,
        bench/RESULTS.md §9), and no per-tap bookkeeping but the call's. False, having
        run nothing, where the values cannot be read (`Handlers` reports what is odd)."""
        local = plain.local
        try:
            offsets = np.array(records.starts[first:end], np.int64)
            offsets += self.ring.header_bytes - position
            leaves = stacked_leaves(plain.static, body, offsets)
            values = tap_values(plain.static.fields["tree"], leaves, end - first)
        except Exception:
            return False
        prints, texts = plain.printing, None
        if prints is not None:  # id_print: its texts rendered on another core?
            many = end - first >= _PRINT_WORKER_FROM
            texts = self.print_worker.texts(leaves[0], prints.threshold, many=many)
        # (a site's values are all of one type: whether they go as they are is the
        # first's answer)
        as_is = (local.leaf and not isinstance(values[0], tuple | list | dict)) or (
            local.flat and type(values[0]) is tuple
        )
        function, transforms, keywords = local.function, plain.transforms, plain.keywords
        if texts is None and as_is and not isinstance(function, CallsByRun):
            self._call_each(plain, values, records, first, tid)  # (most id_tap closures)
            return True
        by_run = function.calls(transforms) if isinstance(function, CallsByRun) else None
        with by_run if by_run is not None else contextlib.nullcontext() as call:
            for k, value in enumerate(values):
                if self.abandoned:  # (the exit drain gave up: LocalPath.close)
                    self.not_run += end - first - k
                    break
                self.running = (local.name, time.monotonic())
                try:
                    if texts is not None and prints is not None:
                        printing.emit(prints.header, texts[k], prints.stream)
                    elif call is not None:
                        call(value if as_is else rebuild(local.treedef, value))
                    else:
                        function(
                            value if as_is else rebuild(local.treedef, value),
                            transforms,
                            **keywords,
                        )
                except Exception as exc:
                    self._tap_failed(plain, records, first + k, tid + k, exc)
                finally:
                    self.running = None
                    self.calls += 1
        return True

    def _call_each(
        self, plain: _PlainSite, values: Sequence[Any], records: Records, first: int, tid: int
    ) -> None:
        """`_run_plain`'s loop where each value goes to the function as it is (no text
        to print, nothing to rebuild, no call made per run): per tap, only the call and
        what the barrier and the exit drain read (`abandoned`, `running`, `calls`): half
        the general loop's time a tap (~0.2 µs), on a thread that holds the GIL the
        dispatching thread needs (bench/RESULTS.md §9)."""
        call = plain.local.function
        if plain.keywords:
            call = functools.partial(call, **plain.keywords)
        transforms, name, monotonic = plain.transforms, plain.local.name, time.monotonic
        count = len(values)
        k = 0
        while k < count:  # (entered again after a function that raised)
            try:
                for k in range(k, count):  # noqa: B020 (k says where a raise left off)
                    if self.abandoned:  # (the exit drain gave up: LocalPath.close)
                        self.not_run += count - k
                        return
                    self.running = (name, monotonic())
                    call(values[k], transforms)
                    self.calls += 1
                return
            except Exception as exc:
                self.calls += 1
                self._tap_failed(plain, records, first + k, tid + k, exc)
                k += 1
            finally:
                self.running = None

    def _tap_failed(
        self, plain: _PlainSite, records: Records, i: int, tid: int, exc: Exception
    ) -> None:
        """Record i's function raised `exc` (its delivery id `tid`)."""
        self.last_exception = exc
        self.failures.taps[tid] = (plain.consumer, records.seqs[i])
        self._failed(tid, plain.consumer, records.seqs[i], exc)

    def _failed(self, tid: int, consumer: str, seq: int, exc: Exception) -> None:
        """A tap function raised: logged now, raised by the next barrier (as
        `Handlers` reports a handler's failure)."""
        logger.error(
            "handler tap function for %r (seq %s) raised:\n%s",
            consumer,
            seq,
            traceback.format_exc(),
        )
        self.failures.fail(tid, failure_text("tap function", exc, ERROR_CHARS))

    def _run(self, value: Any, meta: TapMeta) -> None:
        if self.abandoned:  # (the exit drain gave up: LocalPath.close)
            self.not_run += 1
            return
        local = self._functions[meta.consumer]
        as_is = (local.leaf and not isinstance(value, tuple | list | dict)) or (
            local.flat and type(value) is tuple
        )
        arg = value if as_is else rebuild(local.treedef, value)
        device = self._devices.get(meta.device) if meta.device is not None else None
        self.running = (local.name, time.monotonic())
        try:
            local.function(arg, meta.transforms, **tap_function_keywords(meta, device))
        except Exception as exc:
            self.last_exception = exc
            raise
        finally:
            self.running = None
            self.calls += 1
