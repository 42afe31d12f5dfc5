"""The host side of the gathered path: a gathered computation's buffers, packed into one
byte array on the device (`pack`), written as its taps' records (`Flush`).

The same packed bytes come to the host two ways: as a flush's host callback's operand
(`tapd.emitter.gathered.flush`), and as the output a computation ends with
(`tapd.emitter.taps_as_outputs`). Either way one call of the ring library
(`tapd_ring_write_gathered_runs`) writes every record, in the log's order, as the tap's
own host callback would have (the same record: site, seq, step, device), and counts the
taps of dormant sites as skipped. It writes them in runs: up to 1024 records back to
back take their seqs and their room in the ring at once and are committed at once, so
that a small record costs its copy (~30 ns for 64 B on the benchmark machine, ~65 one by
one, `tapd_ring_write_gathered`: the seq lock, the clock, two fences a record). Sites
without a ring (the sender's path) are written here, one record at a time, by the tap's
own host function.

The packed layout (`packed_layout`, in bytes; the device packs them as uint32 words):
the log's length (int32), the log (an int32 site index a record), each record's place
among its site's taps since the last flush (int32, kept or not: the writer gives each
record the seq its tap would have taken alone), each site's count of taps not kept
(dormant or sampled out on the device; int32), then each site's operand buffers
([capacity, *shape] each); every piece padded to 8 bytes.
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import core

from tapd.emitter import host_writers, lifecycle, taps_as_outputs
from tapd.emitter.gathered import live, sampling
from tapd.emitter.primitive import TapSiteParams
from tapd.native import library
from tapd.protocol.ring_format import EVERY_ALWAYS_BIT, EVERY_DORMANT

# The packed pieces, in order (`packed_layout`); each site's buffers from BUFFERS on.
COUNT, LOG, ORDER, SKIPPED, BUFFERS = range(5)


def packed_layout(
    sites: int, capacity: int, operand_avals: Sequence[Sequence[Any]]
) -> list[tuple[np.dtype[Any], tuple[int, ...], int]]:
    """(dtype, shape, offset) of each piece `pack` packs, in order (the module docstring)."""
    int32 = np.dtype(np.int32)
    pieces = [(int32, ()), (int32, (capacity,)), (int32, (capacity,)), (int32, (sites,))]
    for avals in operand_avals:
        pieces += [(np.dtype(a.dtype), (capacity, *a.shape)) for a in avals]
    layout, offset = [], 0
    for dtype, shape in pieces:
        layout.append((dtype, shape, offset))
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        offset += size + (-size % 8)
    return layout


def packed_size(layout: Sequence[tuple[np.dtype[Any], tuple[int, ...], int]]) -> int:
    """The bytes `pack` packs, in `layout` (`packed_layout`): its last piece's end."""
    return layout[-1][2] + _padded(layout[-1])


def pack(count: Any, log: Any, order: Any, skipped: Any, buffers: Sequence[Any]) -> Any:
    """The pieces as one uint32 array (traced, on the device): `packed_layout`'s bytes,
    in words. Words, not bytes: on a TPU a uint8 array is laid out in tiles of its own,
    so that bitcasting 8 MiB of float32 to bytes costs ~2.4 ms a call (a relayout) and
    fetching them twice what the float32 costs, where the same as uint32 words costs
    ~0.01 ms (tpu_big_probe, retired, bench/RESULTS-tpu.md). The host reads the words'
    bytes (`as_bytes`)."""
    pieces = (count, log, order, skipped, *buffers)
    return lax.concatenate([_words(piece) for piece in pieces], 0)


def as_bytes(packed: Any) -> np.ndarray:
    """Packed words (or bytes made on the host; or words in rows, `as_rows`) as the
    bytes `packed_layout` places."""
    array = np.ascontiguousarray(packed)
    return (array if array.dtype == np.uint8 else array.view(np.uint8)).reshape(-1)


# A computation's output of packed words at least this large leaves in rows of
# ROW_WORDS (`as_rows`): a TPU lays a vector out in tiles of its own, which the host
# reorders as it fetches; rows of 128 words are its (8, 128) tiles as they lie. The
# TPU v5e fetched 16 MiB in 2.90 ms as rows, 3.74 as a vector; 28 MiB 4.27 against 5.82
# (tpu_fetch_probe, retired, session 21). Smaller outputs stay vectors (a small tap's).
ROWS_FROM = 2**20
ROW_WORDS = 128


def as_rows(packed: Any) -> Any:
    """`pack`'s words (traced) as the output a computation ends with: where they are
    ROWS_FROM bytes or more, zero-padded to a whole row and shaped (rows, ROW_WORDS)."""
    if packed.shape[0] * 4 < ROWS_FROM:
        return packed
    return _padded_to(packed, ROW_WORDS).reshape(-1, ROW_WORDS)


def output_size(size: int) -> int:
    """The bytes of the output `as_rows` makes of `size` packed bytes."""
    row = 4 * ROW_WORDS
    return size if size < ROWS_FROM else -(-size // row) * row


def _words(piece: Any) -> Any:
    """`piece`'s bytes as uint32 words (little-endian, as the host reads them), padded
    to a whole number of 8 bytes."""
    piece = jnp.asarray(piece)
    if piece.dtype == np.bool_:
        piece = piece.astype(np.uint8)
    elif jnp.iscomplexobj(piece):  # (real, imaginary): a complex number's bytes
        piece = jnp.stack([piece.real, piece.imag], axis=-1)
    itemsize = piece.dtype.itemsize
    if itemsize >= 4:  # (8 bytes an element: two words each)
        flat = lax.bitcast_convert_type(piece, np.uint32).reshape(-1)
    else:  # (1 or 2 bytes: grouped into words)
        same_width = np.dtype(f"uint{8 * itemsize}")
        flat = lax.bitcast_convert_type(piece, same_width).reshape(-1)
        per_word = 4 // itemsize
        flat = _padded_to(flat, 2 * per_word)
        flat = lax.bitcast_convert_type(flat.reshape(-1, per_word), np.uint32)
    return _padded_to(flat, 2)


def _padded_to(flat: Any, multiple: int) -> Any:
    padding = -flat.size % multiple
    return jnp.concatenate([flat, jnp.zeros(padding, flat.dtype)]) if padding else flat


class SiteWriter:
    """How one site's records are written: into a ring (its ids), or, with no ring, by
    the tap's own host function, one by one. A record's operands are the tap's (leaves,
    step, coords); the ring takes the leaves and the coordinates, the step apart."""

    def __init__(
        self,
        site: TapSiteParams,
        avals: Sequence[core.ShapedArray],
        platform: str | None,
        devices_at: host_writers.DeviceOrdinals,
    ) -> None:
        local = lifecycle.local_path_of(site.consumer)
        native = local if local is not None else lifecycle.get_sender().native
        leaves = site.leaf_count(len(avals))
        self.step = leaves if site.has_step else None
        self.tapped = [*range(leaves), *([leaves + site.has_step] if site.has_coords else [])]
        tapped_avals = [avals[i] for i in self.tapped]
        fields = host_writers.site_fields(site, platform)
        self.ring: int | None = None
        self.site_id, self.consumer_id, self.every = 0, 0, 0
        # May be sampled on the device: its consumer's only site in the computation
        # (tapd.emitter.gathered.sampling; set by `Flush`).
        self.sampled = False
        if native is not None:
            self.site_id, self.consumer_id, self.every, lib = host_writers.ring_site(
                native, site, fields, tapped_avals
            )
            self.ring = native.ring.handle
            self.site_every = lib.tapd_ring_site_every
            self._rely_on_site = lib.tapd_ring_rely_on_site
            self._release_site = lib.tapd_ring_release_site
            return
        write = host_writers.sender_writer(native, site, fields, tapped_avals, devices_at)
        order = [*self.tapped, *([self.step] if self.step is not None else [])]
        self.write_one = lambda operands: write(*[operands[i] for i in order])

    def keep(self) -> int:
        """Which of the site's taps the device keeps (`Gathered.awake`): 0 none (no
        taker: dormant), 1 all (or one without a ring, or id_tap's, which takes no notice
        of takers), W > 1 one in W where it may be sampled on the device (`sampled`;
        elsewhere the ring samples what the device keeps)."""
        if self.ring is None or self.every & EVERY_ALWAYS_BIT:
            return 1
        wanted = self.site_every(self.ring, self.site_id)
        keep = sampling.keep_flag(self.every, wanted)
        if keep > 1:
            sampling.note(self.ring, self.consumer_id, keep)
        return keep if self.sampled else min(keep, 1)

    def rely_on_dormancy(self) -> bool:
        """Mark the site's slot relied on (tapd/emitter/dormant_twin.py: the daemon then
        waits for a wake to be acknowledged, `release_dormancy`) and say whether it is
        dormant now, as read after the mark. A site without a slot, or always sent, is
        never dormant."""
        if self.ring is None or self.every & EVERY_ALWAYS_BIT:
            return False
        return int(self._rely_on_site(self.ring, self.site_id)) == EVERY_DORMANT

    def release_dormancy(self) -> None:
        """The site is relied on no more: a wake is acknowledged."""
        if self.ring is not None:
            self._release_site(self.ring, self.site_id)

    def dormant_now(self) -> bool:
        """Whether the site's slot says dormant now."""
        if self.ring is None:
            return False
        return int(self.site_every(self.ring, self.site_id)) == EVERY_DORMANT


class Flush:
    """Writes a gathered computation's packed buffers (see the module docstring): a
    flush's host function, and the `taps_as_outputs.Receiver` of a computation that
    ends with an output."""

    def __init__(
        self,
        sites: list[SiteWriter],
        device: int,
        capacity: int,
        operand_avals: Sequence[Sequence[core.ShapedArray]],
        pace: live.Pace | None = None,
    ) -> None:
        self.sites = sites
        consumers = collections.Counter(site.consumer_id for site in sites if site.ring)
        for site in sites:
            site.sampled = site.ring is not None and consumers[site.consumer_id] == 1
        self.pace = pace
        self.device = device
        self.capacity = capacity
        self.layout = packed_layout(len(sites), capacity, operand_avals)
        self.size = packed_size(self.layout)
        self.header_size = self.layout[BUFFERS][2] if len(self.layout) > BUFFERS else self.size
        self.unringed = [i for i, site in enumerate(sites) if site.ring is None]
        self._tables = _Tables(sites, self.layout)
        # Its arguments but the first made once: called without ctypes' conversions.
        self._arguments = (
            ctypes.c_int32(device),
            ctypes.c_uint32(len(sites)),
            *self._tables.arguments,
            *[ctypes.c_uint64(piece[2]) for piece in self.layout[:BUFFERS]],
            ctypes.c_uint64(capacity),
        )
        lib = library.load()
        self._write_gathered: Any = None
        if lib is not None and len(self.unringed) < len(sites):
            self._write_gathered = lib._FuncPtr(("tapd_ring_write_gathered_runs", lib))
            self._write_gathered.restype = ctypes.c_int64
        # A dormant call's head, by its counts: the same each call of a computation
        # (and its address, made once: ctypes' conversions cost a dormant call µs).
        self._skipped_heads: dict[tuple[int, ...], tuple[np.ndarray, ctypes.c_void_p]] = {}

    def keeps(self) -> tuple[int, ...]:
        """Each site's keep flag (`SiteWriter.keep`): the head of `wake_flags`."""
        return tuple([site.keep() for site in self.sites])

    def wake_flags(self, counts: Sequence[int] | None = None) -> tuple[int, ...]:
        """A call's flags (`taps_as_outputs.Receiver.wake_flags`): each site's keep flag,
        a live chunk's first steps (the pace known), each site's sampling phase."""
        interval = 1 if self.pace is None else self.pace.interval()
        keeps = [site.keep() for site in self.sites]
        if not sampling.wanted(self.sites):  # (no consumer sampled: no phase)
            return (*keeps, interval, *[0] * len(keeps))
        idle = taps_as_outputs.collector.pending() == 0
        phases = sampling.phases(keeps, self.sites, self.device, counts, idle)
        return (*keeps, interval, *phases)

    def __call__(self, packed: Any) -> tuple[()]:
        lifecycle.host_callback_ran()
        taps_as_outputs.write_ready()  # (the outputs of computations before this one)
        self.write_packed(np.asarray(packed))
        return ()

    def answered(self, packed: Any, ask: Any) -> tuple[np.ndarray]:
        """A flush that answers (one device, tapd.emitter.gathered.live): the wake flags
        and the next chunk's steps at once; the records are written by the outputs'
        thread, in order (the device waits for this answer, not for the ring)."""
        lifecycle.host_callback_ran()
        copied = as_bytes(np.array(packed))  # (the operand lives only during the call)
        if not taps_as_outputs.collector.write_later(copied, self):
            self.write_packed(copied)
        return self._answer(ask)

    def poll(self, ask: Any) -> tuple[np.ndarray]:
        """A live chunk's end that logged nothing: the answer alone."""
        lifecycle.host_callback_ran()
        return self._answer(ask)

    def _answer(self, ask: Any) -> tuple[np.ndarray]:
        steps, polls = (int(v) for v in np.asarray(ask))
        interval = 1 if self.pace is None else self.pace.answered(steps, polls)
        flags = [site.keep() for site in self.sites]
        return (np.array([*flags, interval], np.int32),)

    def write_skipped(self, counts: Sequence[int]) -> None:
        """A dormant call's taps, `counts` a site, counted as skipped (no buffers)."""
        key = tuple(counts)
        made = self._skipped_heads.get(key)
        if made is None:
            header = np.zeros(self.header_size, np.uint8)
            offset = self.layout[SKIPPED][2]
            header[offset : offset + 4 * len(key)] = np.asarray(key, np.int32).view(np.uint8)
            made = (header, ctypes.c_void_p(header.ctypes.data))
            if len(self._skipped_heads) < 64:  # (a computation has one; a few more at most)
                self._skipped_heads[key] = made
        if self._write_gathered is not None:  # (its log is empty: `write_header`'s case)
            self._write_gathered(made[1], *self._arguments)

    def write_header(self, header: np.ndarray) -> bool:
        """Where the log is empty (dormant sites' taps only), their count from the
        packed bytes' head alone, its buffers never moved; False where it is not."""
        header = as_bytes(header)
        if header.size < self.header_size or int(self._piece(header, COUNT)) != 0:
            return False
        if self._write_gathered is not None:
            self._write_gathered(ctypes.c_void_p(header.ctypes.data), *self._arguments)
        return True

    def write_packed(self, packed: np.ndarray) -> None:
        packed = as_bytes(packed)
        if packed.size not in (self.size, output_size(self.size)):
            raise ValueError(f"gathered buffers of {packed.size} bytes, not {self.size}")
        if self._write_gathered is not None:
            written = self._write_gathered(ctypes.c_void_p(packed.ctypes.data), *self._arguments)
            if written < 0:
                raise ValueError("a gathered log names a site it has not, or overflows")
        if self.unringed:
            self._write_unringed(packed)

    def records(self, packed: np.ndarray) -> tuple[int, int]:
        """(records in the log, dormant taps counted): what `packed` holds."""
        packed = as_bytes(packed)
        count = int(self._piece(packed, COUNT))
        return count, int(self._piece(packed, SKIPPED).sum())

    def _piece(self, packed: np.ndarray, index: int) -> np.ndarray:
        dtype, shape, offset = self.layout[index]
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        return packed[offset : offset + size].view(dtype).reshape(shape)

    def _write_unringed(self, packed: np.ndarray) -> None:
        """The records of sites without a ring, by their own host functions, in order."""
        count = int(self._piece(packed, COUNT))
        log = self._piece(packed, LOG)[:count].tolist()
        rows = [0] * len(self.sites)
        first = BUFFERS
        starts = []
        for site in self.sites:
            starts.append(first)
            first += len(site.tapped) + (site.step is not None)
        for index in log:
            row = rows[index]
            rows[index] += 1
            site = self.sites[index]
            if site.ring is not None:
                continue
            width = len(site.tapped) + (site.step is not None)
            operands = [self._piece(packed, starts[index] + k)[row] for k in range(width)]
            site.write_one(operands)


class PerDevice:
    """The host function of a flush that every device of a shard_map or pmap body runs:
    its last operand is the device's index in the computation's device assignment,
    whose `Flush` (made the first time, `make(index)`) writes its log. Devices call it
    at once, each on a thread of its own.

    Also the `taps_as_outputs.ShardedReceiver` of a body whose buffers leave as its
    shard of the computation's output: `of_device` is then the `Flush` of the device
    that holds a shard (`devices`: the computation's device assignment)."""

    def __init__(
        self,
        make: Callable[[int], Flush],
        indices: Sequence[int] = (),
        devices: Sequence[Any] = (),
    ) -> None:
        self._make = make
        self._flushes: dict[int, Flush] = {index: make(index) for index in indices}
        self._lock = threading.Lock()
        self._index_of = {device: index for index, device in enumerate(devices)}

    @property
    def header_size(self) -> int:
        return self._any().header_size

    def __call__(self, packed: Any, index: Any) -> tuple[()]:
        return self.of_index(int(index))(packed)

    def of_index(self, key: int) -> Flush:
        flush = self._flushes.get(key)
        if flush is None:
            with self._lock:
                flush = self._flushes.get(key)
                if flush is None:
                    flush = self._flushes[key] = self._make(key)
        return flush

    def of_device(self, device: Any) -> Flush:
        return self.of_index(self._index_of[device])

    def wake_flags(self, counts: Sequence[int] | None = None) -> tuple[int, ...]:
        """The call's flags (every device's flush registers the same sites; a sampled
        site's phase is the first device's: where another's differs, its ring counts
        the taps it then keeps as skipped)."""
        return self._any().wake_flags(counts)

    def _any(self) -> Flush:
        """One device's `Flush` (the layout and the sites are every device's)."""
        return self.of_index(min(self._flushes, default=0))


def _padded(piece: tuple[np.dtype[Any], tuple[int, ...], int]) -> int:
    dtype, shape, _ = piece
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return size + (-size % 8)


class _Tables:
    """The per-site arrays `tapd_ring_write_gathered_runs` reads, made once a computation."""

    def __init__(
        self, sites: list[SiteWriter], layout: list[tuple[np.dtype[Any], tuple[int, ...], int]]
    ) -> None:
        count = len(sites)
        self.rings = (ctypes.c_void_p * count)(*[site.ring or None for site in sites])
        self.site_ids = np.array([site.site_id for site in sites], np.uint64)
        self.consumers = np.array([site.consumer_id for site in sites], np.uint32)
        self.everys = np.array([site.every for site in sites], np.uint64)
        first_leaf: list[int] = []
        nleaves: list[int] = []
        leaf_offsets: list[int] = []
        leaf_bytes: list[int] = []
        step_bytes: list[int] = []
        step_offsets: list[int] = []
        piece = BUFFERS
        for site in sites:
            operands = len(site.tapped) + (site.step is not None)
            first_leaf.append(len(leaf_offsets))
            nleaves.append(len(site.tapped))
            for k in site.tapped:
                dtype, shape, offset = layout[piece + k]
                leaf_offsets.append(offset)
                leaf_bytes.append(int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
            if site.step is not None:
                dtype, _, offset = layout[piece + site.step]
                step_bytes.append(dtype.itemsize)
                step_offsets.append(offset)
            else:
                step_bytes.append(0)
                step_offsets.append(0)
            piece += operands
        self.first_leaf = np.array(first_leaf, np.uint32)
        self.nleaves = np.array(nleaves, np.uint32)
        self.leaf_offsets = np.array(leaf_offsets or [0], np.uint64)
        self.leaf_bytes = np.array(leaf_bytes or [0], np.uint64)
        self.step_bytes = np.array(step_bytes, np.int32)
        self.step_offsets = np.array(step_offsets, np.uint64)
        self.arguments = (
            self.rings,
            *[
                ctypes.c_void_p(array.ctypes.data)
                for array in (
                    self.site_ids, self.consumers, self.everys, self.first_leaf,
                    self.nleaves, self.leaf_offsets, self.leaf_bytes, self.step_bytes,
                    self.step_offsets,
                )
            ],
        )  # fmt: skip
