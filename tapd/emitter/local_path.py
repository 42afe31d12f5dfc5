"""Tap functions that live in this process, fed without a daemon: the local ring.

A tap whose function runs in this process (a `tapd.debug` site; an `id_tap` of a
lambda, closure, bound method or callable object) has no reason to leave it. Its
records go to this process's *local ring*, which the FFI handler (or the portable
backend's host callback) writes exactly as it writes the daemon's ring (the handler's
`ring` attribute says which: tapd/native/ring.h, kRingLocal), and which a receiver
thread of this process drains itself. No daemon is involved and none is started; the
step never waits for a tap function. Taps of named sites and of importable tap
functions keep the daemon's ring (tapd/emitter/local_functions.py runs the importable
ones here where no subscriber takes them).

What holds on the daemon's path holds here:

- order: the receiver runs records in ring order, which is program order within a
  computation (tapd's order token) and JAX's order for `ordered="strict"` taps; a
  site's `seq` counts every execution per device;
- the bounded ring and its policy: `block` pauses a writer until the receiver has run
  enough, `drop_newest` drops and counts;
- `barrier_wait` (tapd.emitter.lifecycle) returns once the receiver has run every
  record committed before it; what a function raised is raised there, as
  `CallbackException`, with its name and traceback; a barrier that times out says what
  it waits for: which sites' taps, and what the receiver thread is doing;
- the exit drain: at interpreter exit the receiver runs what was committed, as long as
  it makes progress (it gives up after `exit_timeout` seconds without one tap run, and
  then runs no function while JAX and the interpreter shut down); an exact count of
  what it did not run is logged;
- the counters, in `tapd.stats()["local"]`.

The receiver runs the taps as a subscriber runs a daemon's (tapd_client.handlers on
`SiteRun`s; a run of a plain site, whose function takes no `device=`, directly, with
what the run's taps share looked up once), from a copy of the ring's bytes, so that a
function that keeps its argument keeps an intact value. No daemon sees these taps, so
`tapd tail '*'` does not either (docs/TAPPING.md, "Taps that stay in the process").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import select
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from tapd import printing
from tapd.emitter.settings import EmitterSettings
from tapd.errors import BarrierTimeout, TapFunctionException, failure_text
from tapd.native.ring import Records, Ring
from tapd.native.sites import Site
from tapd.native.wake import WakeSocket
from tapd.print_worker import PrintWorker
from tapd.protocol.batch import SiteRun
from tapd.protocol.message import StaticEntry, stacked_leaves, tap_values
from tapd.protocol.schema import check_batch_static
from tapd.runtime import SHM_DIR, ensure_private_dir, local_ring_dir_name
from tapd_client.daemon_link import ERROR_CHARS
from tapd_client.handlers import Handlers
from tapd_client.meta import MetaTemplate, TapMeta
from tapd_client.tap_functions import tap_function_keywords

logger = logging.getLogger("tapd.emitter")

LOCAL_PREFIX = "local/"  # every local consumer's name starts so (docs/TAPPING.md)
_MAX_QUALNAME = 96  # of the function's name in a local consumer name
_RECORDS_PER_READ = 4096
# The receiver sleeps until a writer's wake-up, or this long: a wake-up lost (none is
# known to be) would cost this much delay, never a hang.
_IDLE_LOOK = 0.5  # s
# After a read that did not take every tap there was room for (nor a MiB), the receiver
# lets taps gather this long before it reads again, unless a barrier, a print or exit hurries it,
# or half the ring waits (its writers wake it then: no writer finds it full meanwhile).
# Woken for each tap of a loop that dispatches small steps one by one, it took the GIL
# from the dispatching thread at every step (bench/RESULTS.md §10 (b): 65 µs a call of
# a 4.5 µs step). Each time it wakes costs the step too (the GIL passed back and forth
# between two cores, a core taken from the step's own threads): 10 ms rather than 2
# took (b) from 0.136 to 0.11 of JAX's cost, (b2) from ~25 µs added a step to ~13. The
# daemon coalesces the same way (--coalesce).
_GATHER = 0.010  # s
# Reads of this many bytes or more do not wait: what gathering saves is per read, small
# beside such taps, and their bytes go cold meanwhile (a 1 MiB id_tap a step: ~2x the
# time, gathered 10 ms).
_GATHER_BELOW = 1 << 20
# A run of at least this many taps of an id_print site has its arrays rendered by the
# print worker (tapd/print_worker.py), under TAPD_PRINT_WORKER=auto.
_PRINT_WORKER_FROM = 16
_ERRORS_KEPT = 100  # failures kept for the next barrier (each one's first line counted)


@dataclasses.dataclass(frozen=True)
class LocalFunction:
    """A tap function of this process and what it needs of each tap: the site's pytree
    structure (so that it gets the very types it would have got from host_callback)."""

    function: Callable[..., Any]
    treedef: Any  # jax.tree_util.PyTreeDef
    flat: bool  # a tuple of leaves, which a tap's value already is (no rebuild)
    name: str  # for people (describe)
    leaf: bool = False  # one leaf, no container: a tap's value is the argument itself


class CallsByRun:
    """A local tap function that makes a run of its site's taps with what they share
    looked up once (tapd.debug's `Delivery`): the receiver runs a plain site's taps
    through `calls(transforms)`, a context whose value is a function of one tap's value,
    instead of calling the function once a tap."""

    def calls(self, transforms: Any) -> contextlib.AbstractContextManager[Callable[[Any], None]]:
        raise NotImplementedError


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
    import functools

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


def describe(function: Any) -> str:
    """A tap function's name for people: its qualified name (a bound method's is
    `Class.method`), `partial(name)`, or its class's name for a callable object."""
    import functools

    if isinstance(function, functools.partial):
        return f"partial({describe(function.func)})"
    qualname = getattr(function, "__qualname__", None)
    return qualname if isinstance(qualname, str) else type(function).__qualname__


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


class LocalPath:
    """This process's local ring, its sites and functions, and the receiver thread."""

    def __init__(self, settings: EmitterSettings, process_index: int) -> None:
        self.settings = settings
        self.emitter = f"{socket.gethostname()}:{os.getpid()}"
        self.prefix = f"{LOCAL_PREFIX}{self.emitter}/{secrets.token_hex(4)}/"
        self.directory = _private_directory()
        try:
            self.ring = Ring.create(
                self.directory / f"{os.getpid()}-{secrets.token_hex(4)}.ring",
                settings.buffer_bytes,
                settings.policy,
            )
            self.ring.path.unlink()  # mapped by this process alone: nothing to find
            self._wake = WakeSocket(self.directory)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.ring.set_reader(os.getpid())
        self.ring.install("local")
        self._identity = {"process": process_index, "host": socket.gethostname(),
                          "pid": os.getpid(), "emitter": self.emitter}  # fmt: skip
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)  # `handled` moved on
        self._functions: dict[str, LocalFunction] = {}
        self._names: dict[tuple[int, Any], tuple[Callable[..., Any], str]] = {}
        self._named: collections.Counter[str] = collections.Counter()
        self._site_keys: dict[tuple[str, str], int] = {}
        self._sites: list[tuple[Site, StaticEntry]] = []
        self._consumer_ids: dict[str, int] = {}
        self._devices = {
            int(d.local_hardware_id): d
            for d in jax.local_devices()
            if d.local_hardware_id is not None
        }
        self._plain: dict[int, _PlainSite | None] = {}  # by site id: _plain_site
        self._print_worker = PrintWorker(settings.print_worker)
        self._handlers = Handlers()
        self._handlers.add(
            self.prefix + "*", _Named(self._run, "tap function"), False, False, 1, None
        )
        self._failures = _Failures()
        self._last_exception: BaseException | None = None
        self._errors_seen = 0  # failures already raised by a barrier
        self.handled = 0  # ring position up to which every record was run (and released)
        self.ran = 0  # taps run (whatever they raised)
        self._running: tuple[str, float] | None = None  # (function, since) while one runs
        self.calls = 0  # tap functions that returned (or raised): the receiver's progress
        self._abandoned = False  # exit gave up waiting: run nothing more
        self.not_run = 0  # taps read after that, not run
        self._closing = False
        self._hurry = _Hurry()  # someone waits for the receiver: read at once
        self._stop_read, self._stop_write = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="tapd-receiver", daemon=True)
        self._thread.start()

    # ---- trace time ----------------------------------------------------------------

    def consumer(self, function: Callable[..., Any], treedef: Any) -> str:
        """The consumer name of a site whose function runs here: the same for the same
        function and tree. The function is kept for the life of the process, as
        host_callback kept it."""
        key = (id(function), treedef)
        with self._lock:
            known = self._names.get(key)
            if known is not None:
                return known[1]
            shown = describe(function)[:_MAX_QUALNAME]
            # (numbered among the functions of that name: the same in every run of a
            # program, whatever else it traced first; see entry_name)
            name = f"{self.prefix}{self._named[shown]}/{shown}"
            self._named[shown] += 1
            flat = treedef == jax.tree_util.tree_structure((0,) * treedef.num_leaves)
            leaf = treedef.num_nodes == 1 and treedef.num_leaves == 1
            self._functions[name] = LocalFunction(function, treedef, flat, describe(function), leaf)
            self._names[key] = (function, name)  # keeps the function, so its id stays unique
            return name

    def entry_name(self, consumer: str) -> str:
        """The name a computation's custom call gives a local consumer: `consumer`
        without this process's part (host, pid, a random tag), so that a program traced
        again in another process lowers to the same module, which JAX's persistent
        compilation cache then serves (the entry is put into this process's ring as it
        lowers; no other process resolves it: tapd.emitter.entries)."""
        assert self.owns(consumer)
        return LOCAL_PREFIX + consumer[len(self.prefix) :]

    def owns(self, consumer: str) -> bool:
        """Whether `consumer` names a function of this process's local ring."""
        return consumer.startswith(self.prefix)

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int:
        """The id of this tap site in the local ring (the same for the same site)."""
        entry = {"consumer": consumer, **fields, "leaves": leaves}
        import msgpack

        key = (consumer, msgpack.packb(entry, use_bin_type=True))
        with self._lock:
            site_id = self._site_keys.get(key)
            if site_id is None:
                site = Site(entry, self._identity)
                static = StaticEntry(
                    site.batch_static, check_batch_static(len(self._sites), site.batch_static)
                )
                site_id = self._site_keys[key] = len(self._sites)
                self._sites.append((site, static))
                self._consumer_ids.setdefault(consumer, len(self._consumer_ids))
            return site_id

    def has_sites(self) -> bool:
        """Whether any tap site writes the local ring (else there is nothing to wait for)."""
        return bool(self._sites)

    def consumer_id(self, consumer: str) -> int:
        with self._lock:
            return self._consumer_ids[consumer]

    # ---- the receiver thread -----------------------------------------------------------

    def on_receiver_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def _serve(self) -> None:
        ring = self.ring
        position = self.handled
        try:
            while True:
                span, records = ring.read_span(position, _RECORDS_PER_READ)
                if len(records):
                    start, position = position, self._run_records(span, records, position)
                    if len(records) < _RECORDS_PER_READ and position - start < _GATHER_BELOW:
                        self._gather()
                    continue
                if self._closing:
                    return
                if ring.sleep(position):
                    waits = [self._wake.fileno(), self._stop_read]
                    ready, _, _ = select.select(waits, [], [], _IDLE_LOOK)
                    if waits[0] in ready:
                        self._wake.drain()
        except Exception:
            logger.exception(
                "tapd's local receiver failed; this process's tap functions no longer run"
            )
        finally:
            with self._lock:
                self._closing = True
                self._progress.notify_all()

    def _gather(self) -> None:
        """Let taps gather before the next read (see _GATHER): wait until _GATHER has
        passed, someone waits for the receiver (a barrier, a print, exit), or half the
        ring waits (its writers say so: `Ring.gather`)."""
        hurry = self._hurry
        if hurry.is_set() or not self.ring.gather():
            hurry.clear()
            return
        waits = [self._wake.fileno(), self._stop_read, hurry.fileno()]
        ready, _, _ = select.select(waits, [], [], _GATHER)
        self.ring.gather(False)
        if waits[0] in ready:
            self._wake.drain()
        hurry.clear()

    def _run_records(self, span: memoryview, records: Records, position: int) -> int:
        """Run the tap functions of `records` (read from `position` on, viewed by
        `span`), in order; release their ring space; the position after them."""
        body = memoryview(bytes(span[: records.ends[-1] - position]))  # a copy: see above
        failures = self._failures
        failures.taps.clear()
        with self._lock:
            sites = self._sites
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
        end_position = records.ends[-1]
        self.ring.release(end_position)
        with self._lock:
            self.handled = end_position
            self.ran += len(records)
            self._progress.notify_all()
        return end_position

    def _run_handled(
        self, entry: tuple[Site, StaticEntry], body: memoryview, records: Records,
        first: int, end: int, position: int, tid: int,
    ) -> None:  # fmt: skip
        """Taps first..end-1 of one site, run by `Handlers` as a subscriber runs a
        daemon's: `device=`, shards, odd metadata (which it reports)."""
        site, static = entry
        failures = self._failures
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
            texts = self._print_worker.texts(leaves[0], prints.threshold, many=many)
        # (a site's values are all of one type: whether they go as they are is the
        # first's answer)
        as_is = (local.leaf and not isinstance(values[0], tuple | list | dict)) or (
            local.flat and type(values[0]) is tuple
        )
        function, transforms, keywords = local.function, plain.transforms, plain.keywords
        by_run = function.calls(transforms) if isinstance(function, CallsByRun) else None
        with by_run if by_run is not None else contextlib.nullcontext() as call:
            for k, value in enumerate(values):
                if self._abandoned:  # (the exit drain gave up: see `close`)
                    self.not_run += end - first - k
                    break
                self._running = (local.name, time.monotonic())
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
                    self._last_exception = exc
                    self._failures.taps[tid + k] = (plain.consumer, records.seqs[first + k])
                    self._failed(tid + k, plain.consumer, records.seqs[first + k], exc)
                finally:
                    self._running = None
                    self.calls += 1
        return True

    def _failed(self, tid: int, consumer: str, seq: int, exc: Exception) -> None:
        """A tap function raised: logged now, raised by the next barrier (as
        `Handlers` reports a handler's failure)."""
        logger.error(
            "handler tap function for %r (seq %s) raised:\n%s",
            consumer,
            seq,
            traceback.format_exc(),
        )
        self._failures.fail(tid, failure_text("tap function", exc, ERROR_CHARS))

    def _run(self, value: Any, meta: TapMeta) -> None:
        if self._abandoned:  # (the exit drain gave up: see `close`)
            self.not_run += 1
            return
        local = self._functions[meta.consumer]
        as_is = (local.leaf and not isinstance(value, tuple | list | dict)) or (
            local.flat and type(value) is tuple
        )
        arg = value if as_is else rebuild(local.treedef, value)
        device = self._devices.get(meta.device) if meta.device is not None else None
        self._running = (local.name, time.monotonic())
        try:
            local.function(arg, meta.transforms, **tap_function_keywords(meta, device))
        except Exception as exc:
            self._last_exception = exc
            raise
        finally:
            self._running = None
            self.calls += 1

    # ---- barriers, exit, counters ---------------------------------------------------------

    def barrier(
        self, timeout: float | None, *, asked: float | None = None, keep_errors: bool = False
    ) -> None:
        """Return once every tap committed so far has been run (the devices flushed
        first: lifecycle.barrier_wait); raise what the functions raised meanwhile
        (`keep_errors`: leave them for the next barrier). `asked`: the caller's whole
        timeout, of which `timeout` is what is left."""
        target = self.ring.settled()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self.handled < target and not self._closing:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    shown = asked if asked is not None else (timeout or 0.0)
                    raise BarrierTimeout(self._waiting_for(target, shown))
                self._hurry.set()  # (each time: the receiver clears it as it goes)
                self._progress.wait(left)
            failures = self._failures
            errors = failures.errors[:] if failures.count > self._errors_seen else []
            if not keep_errors:
                self._errors_seen = failures.count
                failures.errors.clear()
        if self.handled < target:
            raise BarrierTimeout(
                "tapd's local receiver stopped before it ran every tap (see the log)"
            )
        if errors and not keep_errors:
            exc = TapFunctionException(errors)
            exc.__cause__ = self._last_exception
            raise exc

    def catch_up(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) until every record committed so far has been run:
        the taps of computations that have finished. Whether it was; never raises."""
        target = self.ring.counters().committed
        if self.handled >= target:  # (most prints from the main thread: cheaply)
            return True
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.handled < target and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._hurry.set()
                self._progress.wait(left)
        return True

    def _waiting_for(self, target: int, timeout: float) -> str:
        """A timed-out barrier's message: which sites' taps wait, and what the receiver
        thread does (its stack), so that a wait never goes unexplained."""
        waiting: dict[str, int] = {}
        try:
            _, records = self.ring.read_span(self.handled, _RECORDS_PER_READ)
            for site_id in records.sites:
                consumer = self._sites[site_id][0].consumer
                waiting[consumer] = waiting.get(consumer, 0) + 1
        except Exception as exc:  # (what it says is a hint: never fail the report)
            waiting[f"(could not read: {exc})"] = 0
        sites = ", ".join(f"{name} ({n} taps)" for name, n in waiting.items()) or "none read yet"
        running = self._running
        doing = (
            f"running {running[0]} for {time.monotonic() - running[1]:.1f} s"
            if running is not None
            else "not running a tap function"
        )
        frame = sys._current_frames().get(self._thread.ident or -1)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        return (
            f"barrier_wait timed out after {timeout:g} s: tapd's local receiver has run the "
            f"taps of this process's own tap functions up to ring position {self.handled} of "
            f"{target}; waiting: {sites}. The receiver thread is {doing}; its stack:\n{stack}"
        )

    def take_exception(self) -> BaseException | None:
        exc, self._last_exception = self._last_exception, None
        return exc

    def stats(self) -> dict[str, int]:
        """sent (written to the ring), ran, dropped (ring full, drop_newest), skipped
        (sampled out), errors (functions that raised), pending (sent, not yet read),
        not_run (read after the exit drain gave up), blocked_ns (writers' wait for room),
        printed_by_worker (id_print taps whose text the print worker rendered)."""
        counters = self.ring.counters()
        return {
            "sent": counters.taps,
            "ran": self.ran - self.not_run,
            "dropped": counters.dropped,
            "skipped": counters.skipped,
            "errors": self._failures.count,
            "blocked_ns": counters.blocked_ns,
            "pending": counters.taps - self.ran,
            "not_run": self.not_run,
            "printed_by_worker": self._print_worker.rendered,
        }

    def close(self, timeout: float) -> int:
        """At exit: run every tap committed so far, for as long as the receiver makes
        progress (giving up after `timeout` seconds without one tap run), then stop the
        receiver and free the ring. A receiver that gives up runs no further function:
        none may still run when JAX and the interpreter shut down. Returns the number of
        taps not run."""
        target = self.ring.settled()
        self._hurry.set()
        progress = (self.calls, time.monotonic())
        with self._lock:
            while self.handled < target and not self._closing:
                if self.calls != progress[0]:
                    progress = (self.calls, time.monotonic())
                elif time.monotonic() - progress[1] >= timeout:
                    logger.error("tapd at exit: %s", self._waiting_for(target, timeout))
                    self._abandoned = True  # the rest are counted, not run
                    break
                self._hurry.set()
                self._progress.wait(min(0.5, timeout))
            self._closing = True
        os.write(self._stop_write, b"x")
        self._thread.join(timeout)
        if self._thread.is_alive():
            running = self._running
            logger.error(
                "tapd at exit: the local receiver is still running %s; the process ends around it",
                running[0] if running else "(between taps)",
            )
        else:
            self._wake.close()
            self._print_worker.close()
            shutil.rmtree(self.directory, ignore_errors=True)
        counts = self.stats()
        return counts["not_run"] + counts["pending"]


class _Hurry:
    """Someone waits for the receiver (a barrier, a print, exit): it reads again at once
    instead of letting taps gather. A flag, and a pipe that wakes it from its wait (left
    open for the process's life: a late `set` must never write to a reused descriptor)."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        self._flag.set()
        with contextlib.suppress(BlockingIOError):  # (full: it will wake anyway)
            os.write(self._write, b"!")

    def is_set(self) -> bool:
        return self._flag.is_set()

    def fileno(self) -> int:
        return self._read

    def clear(self) -> None:
        """The receiver is about to read: every hurry so far is answered. (The pipe
        first: a hurry between the two leaves its byte, and the next wait is short.)"""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass
        self._flag.clear()


class _Named:
    """A handler whose name (in the error a barrier raises) says what it runs."""

    def __init__(self, handler: Callable[[Any, TapMeta], None], name: str) -> None:
        self._handler = handler
        self.__qualname__ = name

    def __call__(self, value: Any, meta: TapMeta) -> None:
        self._handler(value, meta)


def rebuild(treedef: Any, value: Any) -> Any:
    """The tapped value with the site's own pytree types (namedtuple classes, dataclasses,
    registered nodes) rather than the protocol's stand-ins."""
    leaves: list[Any] = []

    def walk(node: Any) -> None:
        if node is None:
            return
        if isinstance(node, tuple | list):
            for child in node:
                walk(child)
        elif isinstance(node, dict):  # insertion order is the tree spec's order
            for child in node.values():
                walk(child)
        else:
            leaves.append(node)

    walk(value)
    if len(leaves) != treedef.num_leaves:
        return value
    return treedef.unflatten(leaves)


def _private_directory() -> Path:
    """A new 0700 directory for the local ring's wake socket: in /dev/shm beside the
    daemons' ring directories (`tapd clean` removes one whose process is gone), else in
    the temporary directory."""
    parent = (
        SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK) else Path(tempfile.gettempdir())
    )
    directory = parent / local_ring_dir_name(os.getpid(), secrets.token_hex(4))
    return ensure_private_dir(directory)
