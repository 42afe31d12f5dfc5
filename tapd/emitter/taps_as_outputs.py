"""A gathered computation's way out without a host callback: its buffers as an output.

On a TPU an executable that holds any host callback costs 1.7-2.2 ms a call more, even
when the callback never runs (bench/RESULTS-tpu.md), while an output of the same bytes,
copied to the host asynchronously, costs about a tenth of that. So the end of a gathered
computation (`tapd.emitter.gathered`) is an output: its buffers packed into one byte
array, taken from JAX's execution as the result of an ordered effect of tapd's own
(`OutputsEffect`), and written into the ring here, off the step, by one thread.

JAX threads an ordered effect's token through each call: it passes one in
(`RuntimeTokenSet.get_token_input`) and keeps the one that comes out
(`set_token_result`). tapd's module pass (`tapd.emitter.gathered.module_pass`) turns the
effect's token result into the packed buffers, and its token argument into the sites'
wake flags: whether each site has a taker now, read from the ring's site table when the
call is dispatched (then a live loop's first chunk of steps: tapd.emitter.gathered.live).
A dormant site's taps are not kept, and a call dispatched with every site dormant moves
nothing: its taps' counts, where known before it ran, are written here, or else only the
head of its output is read. This module intercepts the two token calls for
`OutputsEffect` (`install`) and keeps the arrays that come out, in dispatch order, until
their bytes are written (`Collector`). A live loop's flushes hand their bytes to the
same queue (`Collector.write_later`), ahead of their computation's output.

Over several devices (gathered.slices, gathered.threaded) the effect is shardable: the
flags go to every device, and each device's packed buffers come out as its own token
buffer, which JAX would join into one array of shape (0,); `_wrap_shards` takes them
first, and each is written by its device's writer (`ShardedReceiver`).

Order with taps that are host callbacks: each of those first writes the outputs whose
computations have finished (`write_ready`; on one device a computation runs after those
dispatched before it), and every barrier, drain and print catch-up of the emitter waits
for all of them (`drain`, from `lifecycle.flush_devices`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import numpy as np
from jax._src import effects

logger = logging.getLogger("tapd.emitter")


class Receiver(Protocol):
    """What one gathered computation hands its way out (gathered.host.Flush)."""

    header_size: int  # the packed bytes' head: the log's length, the log, dormant counts

    def keeps(self) -> tuple[int, ...]:
        """Each site's keep flag now (the head of `wake_flags`, without its phases)."""

    def wake_flags(self, counts: Sequence[int] | None = None) -> tuple[int, ...]:
        """A call's flags: per site, which of its taps the device keeps (0 none: dormant,
        1 all, W > 1 one in W: tapd.emitter.gathered.sampling); a live loop's first chunk
        of steps (tapd.emitter.gathered.live); per site, the phase of its sampling.
        `counts`: each site's taps in the call, where known before it runs."""

    def write_packed(self, packed: np.ndarray) -> None:
        """The computation's packed buffers (gathered.host.pack's words, or their
        bytes), written into the ring."""

    def write_header(self, header: np.ndarray) -> bool:
        """The dormant taps a head of packed bytes counts, where its log is empty
        (False where it is not: the whole is then read)."""

    def write_skipped(self, counts: Sequence[int]) -> None:
        """Each site's dormant taps of a call, counted as skipped (their seqs used)."""


class ShardedReceiver(Protocol):
    """What a gathered computation over several devices hands its way out
    (gathered.host.PerDevice): each device's packed buffers come out as its shard of one
    output, written by that device's own `Receiver`."""

    @property
    def header_size(self) -> int: ...

    def wake_flags(self, counts: Sequence[int] | None = None) -> tuple[int, ...]:
        """As `Receiver.wake_flags` (the same flags go to every device)."""

    def of_device(self, device: Any) -> Receiver:
        """The writer of the packed buffers that `device` computed."""


class OutputsEffect(effects.Effect):
    """The ordered effect of one gathered computation's way out (ordered once
    `install` has run). Equal only to itself: JAX keeps one token per effect."""

    def __init__(self, sites: int) -> None:
        self.sites = sites  # (the call's flags begin with each site's wake flag)
        # Set when the computation is lowered; a ShardedReceiver over several devices.
        self.receiver: Receiver | ShardedReceiver | None = None
        self._flags: tuple[tuple[int, ...], Any, Any] | None = None
        # Whether the computation's flushes or polls bring fresh flags while it runs: if
        # not, a call dispatched with every site dormant logs nothing, and only the head
        # of its buffers is read (its dormant taps counted), the rest never moved.
        self.refreshed = True
        # Whether the call this thread is dispatching had every site dormant (a call's
        # flags are read and its result taken in one thread; two threads may dispatch).
        self._dispatching = threading.local()
        # Each site's taps in every call, where known before it runs: a dormant call's
        # are then counted here, and nothing of its output moves (not even its head);
        # a sampled consumer's are reserved (tapd.emitter.gathered.sampling).
        self.call_counts: tuple[int, ...] | None = None
        # Its output's aval and sharding, once a call has returned it: what a call on
        # JAX's C++ path makes of its buffer (tapd.emitter.outputs_fast_path).
        self.packed_output: tuple[Any, Any] | None = None
        # A consumer was found sampled on the C++ path, which then gave way to Python.
        self.sampled_when_fast = False
        # Its log is sized for the taps the device samples out (FlushPlan.sampled_bound):
        # every call takes the flags, never the C++ path's, which keep every tap.
        self.sampled_bound = False
        self._keep_all: Any = None
        # Its twin, compiled without its taps, for dormant calls on the C++ path: kept at
        # lowering where it may have one (tapd.emitter.dormant_twin).
        self.twin: Any = None

    def __str__(self) -> str:
        return "tapd.taps_as_outputs"

    def dormant_call(self) -> bool:
        """Whether the call this thread dispatches now had every site dormant."""
        return bool(getattr(self._dispatching, "dormant", False))

    def last_keeps(self) -> tuple[int, ...]:
        """Each site's keep flag as the last call on the Python path read them."""
        return () if self._flags is None else self._flags[0][: self.sites]

    def lowered_for_fast_path(self) -> bool:
        """What lowering decides of `fast_path_allowed`: one device, no flags while it
        runs, its taps counted before it runs, a log not sized for sampling."""
        return (
            not self.refreshed
            and not self.sampled_bound
            and self.call_counts is not None
            and self.receiver is not None
            and not hasattr(self.receiver, "of_device")
        )

    def fast_path_allowed(self) -> bool:
        """Whether its calls may take JAX's C++ path (outputs_fast_path): as lowered
        for it, its output's form known (a first call made), no site sampled."""
        return (
            self.packed_output is not None
            and self._flags is not None
            and self.lowered_for_fast_path()
            and not any(keep > 1 for keep in self.last_keeps())
        )

    def fast_flags(self, device: Any) -> Any:
        """The flags a call on the C++ path takes, on `device`: every site keeps every
        tap (its writer then decides, as it writes: outputs_fast_path)."""
        if self._keep_all is None:
            assert self._flags is not None
            count = len(self._flags[0])
            flags = [1] * self.sites + [1] + [0] * (count - self.sites - 1)
            self._keep_all = jax.device_put(np.asarray(flags, np.int32), device)
        return self._keep_all

    def flags_on(self, devices: Sequence[Any]) -> Any:
        """The wake flags as an int32 array on `devices` (this process's of the
        computation: on each, the same flags); the last one made is kept while they do
        not change (one table read a call, no transfer)."""
        assert self.receiver is not None  # (lowered before it runs)
        flags = self.receiver.wake_flags(self.call_counts)
        self._dispatching.dormant = not self.refreshed and not any(flags[: self.sites])
        kept = self._flags
        placed = tuple(devices)
        if kept is not None and kept[0] == flags and kept[1] == placed:
            return kept[2]
        array = jax.device_put(np.asarray(flags, np.int32), _replicated(placed))
        self._flags = (flags, placed, array)
        return array


def _replicated(devices: tuple[Any, ...]) -> Any:
    """Where the flags go: the one device, or each of `devices` (a computation over
    several devices takes them on each, as JAX places an ordered effect's first token)."""
    if len(devices) == 1:
        return devices[0]
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    every = PartitionSpec()  # type: ignore[no-untyped-call]
    return NamedSharding(Mesh(np.array(devices, dtype=object), ("devices",)), every)


# The most bytes of flushes handed to the thread at once (`Collector.write_later`).
LATER_BYTES = 64 * 2**20


class Collector:
    """The outputs not yet written, in dispatch order, and the thread that writes them
    as their computations finish.

    `received` runs in JAX's dispatch, once a call: it appends, starts the copy to the
    host (`copy_ahead`), and wakes the thread only if it sleeps. The thread writes every
    output that is ready at once, so a busy program's calls cost it little more."""

    copy_ahead = False  # start each output's copy in the dispatch (else the thread copies)

    def __init__(self) -> None:
        # (the packed buffers, their writer, what of them to read: `received`)
        self._pending: collections.deque[tuple[Any, Any, Any]] = collections.deque()
        self._changed = threading.Condition()
        self._sleeping = False  # the thread waits for `_changed`
        self._writing = threading.Lock()  # held while outputs are written: their order
        self._thread: threading.Thread | None = None
        self._later_bytes = 0  # flushes' bytes waiting (`write_later`)
        # Writes a flush's handed bytes at once: the outputs' thread is then most likely
        # waiting for the running computation's output, behind them.
        self._later_wanted = threading.Event()
        self._later_thread: threading.Thread | None = None

    def received(
        self, array: Any, receiver: Receiver | ShardedOutputs, dormant: Any = False
    ) -> None:
        """A computation's packed buffers, as its call returns them (not yet computed;
        over several devices, a list of each device's); `dormant`: dispatched with
        every site dormant (`OutputsEffect.dormant_call`): True (read the head only),
        or each site's count of taps (read nothing; the array is then None)."""
        if array is None and not self._pending and self._writing.acquire(blocking=False):
            # A dormant call's counts, nothing before them to write: written now, in the
            # dispatching thread (a few µs), rather than by waking the thread for them.
            try:
                if not self._pending:
                    _write(None, receiver, dormant)
                    return
            finally:
                self._writing.release()
        if self.copy_ahead and not dormant:
            for shard in array if isinstance(array, list) else [array]:
                try:
                    shard.copy_to_host_async()
                except Exception:  # (the copy is then made when the thread reads it)
                    pass
        self._pending.append((array, receiver, dormant))  # (a deque's append is atomic)
        self._wake()

    def _wake(self) -> None:
        if self._sleeping or self._thread is None:
            with self._changed:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="tapd-gathered-outputs", daemon=True
                    )
                    self._thread.start()
                self._changed.notify()

    def pending(self) -> int:
        return len(self._pending)

    def write_ready(self) -> None:
        """Write every output, oldest first, whose computation has finished; stop at the
        first that has not (never waits for a device)."""
        if not self._pending:
            return
        with self._writing:
            self._write_ready_held()

    def _write_ready_held(self) -> None:
        # Each leaves the queue once written, not before: a host callback that finds
        # the queue empty (`write_ready`'s test, without the lock) may then write its
        # own tap at once, so nothing may be in flight then. (Only `write_later` adds at
        # the head, under the lock held here: the head stays the one being written.)
        while self._pending and _is_ready(self._pending[0][0]):
            array, receiver, dormant = self._pending[0]
            _write(array, receiver, dormant)
            self._pending.popleft()
            if isinstance(array, np.ndarray):
                self._later_bytes -= array.nbytes

    def write_later(self, packed: np.ndarray, receiver: Receiver) -> bool:
        """A flush's packed bytes (the host's copy), to be written by the thread, so that
        the device, which waits for a flush that answers, does not wait for the ring.
        They go after the outputs of the computations that ran before (written now, or
        queued), and before the output of the one that flushes, which has not finished:
        the first output not ready. A thread of their own writes them at once (the
        outputs' thread waits for that output, behind them). False where `LATER_BYTES`
        already wait: the caller then writes them itself (under `block`, a full ring
        still slows the device)."""
        with self._writing:
            self._write_ready_held()
            if self._later_bytes + packed.nbytes > LATER_BYTES:
                return False
            self._pending.appendleft((packed, receiver, False))
            self._later_bytes += packed.nbytes
            if self._later_thread is None:
                self._later_thread = threading.Thread(
                    target=self._run_later, name="tapd-gathered-flushes", daemon=True
                )
                self._later_thread.start()
        self._later_wanted.set()
        return True

    def _run_later(self) -> None:
        """Write the flushes' handed bytes as they come (`write_later`); they head the
        queue, so `write_ready` writes them, and stops at the first output not ready."""
        while True:
            self._later_wanted.wait()
            self._later_wanted.clear()
            self.write_ready()

    def drain(self) -> None:
        """Return once every output received before the call is written."""
        while self._pending:
            try:
                head = self._pending[0][0]
            except IndexError:  # (written meanwhile)
                continue
            _wait(head)
            self.write_ready()
        with self._writing:  # (one taken by another thread is written by now)
            pass

    def _run(self) -> None:
        while True:
            with self._changed:
                # Asleep before looking: an output appended after the look wakes it.
                self._sleeping = True
                while not self._pending:
                    self._changed.wait()
                self._sleeping = False
            try:
                head = self._pending[0][0]
            except IndexError:  # (written meanwhile by a host callback's write_ready)
                continue
            _wait(head)
            self.write_ready()


def _is_ready(array: Any) -> bool:
    if array is None:  # (nothing to read: a dormant call's counts)
        return True
    if isinstance(array, list):  # (each device's shard)
        return all(_is_ready(shard) for shard in array)
    try:
        return bool(array.is_ready())
    except Exception:  # deleted, or failed: reading it says which
        return True


def _wait(array: Any) -> None:
    if array is None:
        return
    if isinstance(array, list):
        for shard in array:
            _wait(shard)
        return
    try:
        array.block_until_ready()
    except Exception:  # a failed computation: said where its outputs are read
        pass


def _write(array: Any, receiver: Any, dormant: Any) -> None:
    if isinstance(receiver, ShardedOutputs):
        for device, shard in receiver.shards(array):
            _write(shard, receiver.receiver.of_device(device), dormant)
        return
    try:
        if isinstance(dormant, tuple):
            receiver.write_skipped(dormant)
            return
        if dormant:  # (the head only, in words: gathered.host.pack)
            head = receiver.header_size // array.dtype.itemsize
            if array.ndim == 2:  # (in rows: gathered.host.as_rows)
                head = -(-head // array.shape[1])
            if receiver.write_header(np.asarray(array[:head])):
                return
        packed = np.asarray(array)
    except Exception as exc:
        logger.warning("a gathered computation failed; its taps are lost: %s", exc)
        return
    try:
        receiver.write_packed(packed)
    except Exception:
        logger.exception("tapd could not write a gathered computation's taps")


class ShardedOutputs:
    """A computation over several devices as the collector holds it: its receiver, and
    which device each of its output's shards (or, for a dormant call, each of its
    receiver's devices) belongs to."""

    def __init__(self, receiver: ShardedReceiver, devices: Sequence[Any]) -> None:
        self.receiver = receiver
        self.devices = list(devices)

    def shards(self, array: Any) -> list[tuple[Any, Any]]:
        if array is None:  # (a dormant call's counts: for each device)
            return [(device, None) for device in self.devices]
        return [(_device_of(shard), shard) for shard in array]


def _device_of(shard: Any) -> Any:
    (device,) = shard.devices()
    return device


collector = Collector()


def write_ready() -> None:
    """Before a host callback writes a tap: the finished computations' outputs first."""
    if collector.pending():
        collector.write_ready()


def drain() -> None:
    collector.drain()


# ---- JAX's token calls, for OutputsEffect ------------------------------------------------

_installed: bool | None = None


def install() -> bool:
    """Let JAX's runtime tokens carry `OutputsEffect`s (see the module docstring);
    False where this JAX does not pass ordered effects' tokens that way (the gathered
    path then ends with a host callback, as before)."""
    global _installed
    if _installed is not None:
        return _installed
    _installed = False
    try:
        from jax._src import core, dispatch
        from jax._src.interpreters import pxla
    except ImportError:
        return False
    tokens = getattr(dispatch, "RuntimeTokenSet", None)
    execute = getattr(pxla, "ExecuteReplicated", None)
    if (
        tokens is None
        or not callable(getattr(tokens, "get_token_input", None))
        or not callable(getattr(tokens, "set_token_result", None))
        or not callable(getattr(execute, "_handle_token_bufs", None))
        or not hasattr(core, "Token")
    ):
        return False
    effects.ordered_effects.add_type(OutputsEffect)
    # Over several devices too (pxla lowers ordered effects there only if shardable):
    # each device's buffers leave as its shard of the output (`_wrap_shards`).
    effects.shardable_ordered_effects.add_type(OutputsEffect)
    _wrap_tokens(tokens, core.Token)
    _wrap_shards(execute)
    _installed = True
    return True


def _wrap_tokens(tokens: Any, token: Callable[[Any], Any]) -> None:
    get_input, set_result = tokens.get_token_input, tokens.set_token_result

    def get_token_input(self: Any, effect: Any, devices: Sequence[Any]) -> Any:
        if isinstance(effect, OutputsEffect):
            return token(effect.flags_on(devices))
        return get_input(self, effect, devices)

    def set_token_result(self: Any, effect: Any, result: Any) -> None:
        if isinstance(effect, OutputsEffect):
            _received(effect, result._buf)
            return
        set_result(self, effect, result)

    tokens.get_token_input = get_token_input
    tokens.set_token_result = set_token_result


def _wrap_shards(execute: Any) -> None:
    """A computation over several devices returns an ordered effect's token as one
    buffer a device, which JAX joins into one array of shape (0,); an `OutputsEffect`'s
    (each device's packed buffers, `ShardedReceiver`) are taken before that, as they
    are. The rest go on to JAX's own handling."""
    handle = execute._handle_token_bufs

    def _handle_token_bufs(self: Any, token_bufs: Any, sharded_token: Any) -> Any:
        effects_in = list(self.ordered_effects)
        ours = [
            i
            for i, effect in enumerate(effects_in)
            if isinstance(effect, OutputsEffect) and len(token_bufs[i]) > 1
        ]
        if not ours:
            return handle(self, token_bufs, sharded_token)
        for i in ours:
            _received(effects_in[i], list(token_bufs[i]))
        rest = [i for i in range(len(effects_in)) if i not in ours]
        others = _TokenHandling(self._local_devices, [effects_in[i] for i in rest])
        return handle(others, [token_bufs[i] for i in rest], sharded_token)

    execute._handle_token_bufs = _handle_token_bufs


class _TokenHandling:
    """What JAX's `_handle_token_bufs` reads of its executable: its devices, and the
    ordered effects whose tokens it is given."""

    def __init__(self, local_devices: Any, ordered_effects: list[Any]) -> None:
        self._local_devices = local_devices
        self.ordered_effects = ordered_effects


def _received(effect: OutputsEffect, result: Any) -> None:
    """A call's packed buffers (one array, or a list of each device's), to the
    collector; a dormant call's only as much as `OutputsEffect.dormant_call` says."""
    receiver = effect.receiver
    assert receiver is not None  # (lowered before it runs)
    dormant = effect.dormant_call()
    writer: Any = receiver
    if hasattr(receiver, "of_device"):
        shards = result if isinstance(result, list) else [result]
        sharded = cast(ShardedReceiver, receiver)
        writer = ShardedOutputs(sharded, [_device_of(shard) for shard in shards])
        result = shards
    if on_python_path is not None and writer is receiver:
        on_python_path(effect, result, effect.last_keeps())
    if dormant and effect.call_counts is not None:
        collector.received(None, writer, effect.call_counts)
        return
    collector.received(result, writer, dormant)


# Told of each call of a one-device way out on JAX's Python path (with its buffers, and
# the keep flags it took): tapd.emitter.outputs_fast_path, once installed.
on_python_path: Callable[[OutputsEffect, Any, tuple[int, ...]], None] | None = None
