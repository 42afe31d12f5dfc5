"""The gathered path's buffers: how many records a log holds (`choose.plan_buffers`) and
the packed bytes the host reads (`host.pack`, as uint32 words on the device).

End to end, tests/test_gathered.py and tests/test_live.py check that every tap arrives
through them; here, the two pieces of arithmetic they rest on, against what they
promise: flushes as even as the log allows, and packed words whose bytes are exactly
`packed_layout`'s, for every dtype a tap may have."""

from __future__ import annotations

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src import core

from tapd.emitter.gathered import host
from tapd.emitter.gathered.choose import plan_buffers
from tapd.emitter.gathered.rewrite import stored_shape


def plan(
    records: int,
    taps: int,
    row_bytes: int = 4,
    max_bytes: int = 2**30,
    log_bytes: int = 0,
    long: bool = True,
) -> int:
    """A log's capacity; `log_bytes` (gather_log_bytes) twice `max_bytes` unless given;
    `long`: a run that may be paced live (one log only within `taps` records and twice
    `max_bytes`), else one whose count fits `log_bytes` takes one log however many."""
    aval = core.ShapedArray((row_bytes // 4,), np.dtype(np.float32))
    log_bytes = log_bytes or 2 * max_bytes
    made = plan_buffers(
        [],
        [[aval]],
        records,
        taps=taps,
        max_bytes=max_bytes,
        log_bytes=log_bytes,
        may_run_long=long,
    )
    return made.capacity


@settings(max_examples=300, deadline=None)
@given(records=st.integers(1, 5000), taps=st.integers(1, 1100))
def test_a_known_count_is_flushed_in_as_few_and_as_even_logs_as_fit(
    records: int, taps: int
) -> None:
    capacity = plan(records, taps)
    flushes = math.ceil(records / capacity)
    assert capacity <= taps  # (never more than the log may hold)
    assert flushes == math.ceil(records / taps)  # (no more flushes than the most full logs)
    assert capacity * flushes - records < flushes  # (each log within one of the others)


def test_examples_of_the_plan() -> None:
    assert plan(9, 8) == 5  # (5 and 4, not 8 and 1)
    assert plan(16, 8) == 8
    assert plan(17, 8) == 6
    assert plan(7, 8) == 7  # (one log of its records)
    assert plan(0, 8) == 8  # (a count not known: the whole log)
    mib = 2**20  # (logs of 8 MiB of 1 MiB rows; a known count packed in 16 MiB in one)
    assert plan(9, 1024, row_bytes=mib, max_bytes=8 * mib) == 9  # (no flush while it runs)
    assert plan(15, 1024, row_bytes=mib, max_bytes=8 * mib) == 15
    assert plan(16, 1024, row_bytes=mib, max_bytes=8 * mib) == 8  # (16 MiB and the head)
    assert plan(17, 1024, row_bytes=mib, max_bytes=8 * mib) == 6  # (6, 6 and 5)
    assert plan(0, 1024, row_bytes=mib, max_bytes=8 * mib) == 8  # (a count not known)
    assert plan(9, 8, row_bytes=4, max_bytes=8 * mib) == 5  # (the count of taps still holds)


def test_examples_of_a_run_that_does_not_run_long() -> None:
    """A counted run not paced live takes one log wherever its records pack into
    gather_log_bytes, past gather_taps too: no host callback while it runs."""
    mib = 2**20
    bounds = {"row_bytes": mib, "max_bytes": 8 * mib, "log_bytes": 128 * mib}
    assert plan(5000, 1024, long=False) == 5000  # (4-byte taps: far within the bytes)
    assert plan(100, 1024, **bounds, long=False) == 100
    assert plan(100, 1024, **bounds) == 8  # (paced live: logs of 8 MiB)
    assert plan(200, 1024, **bounds, long=False) == 8  # (past the bound: even logs of 8)
    assert plan(0, 1024, **bounds, long=False) == 8  # (not counted)


@settings(max_examples=300, deadline=None)
@given(
    records=st.integers(0, 3000),
    taps=st.integers(1, 1100),
    row_bytes=st.sampled_from([4, 64, 4096, 2**16, 2**20, 2**22]),
    max_bytes=st.sampled_from([1, 2**16, 2**20, 8 * 2**20]),
    log_bytes=st.sampled_from([1, 2**17, 16 * 2**20, 128 * 2**20]),
    long=st.booleans(),
)
def test_a_log_holds_no_more_bytes_than_the_bound_allows(
    records: int, taps: int, row_bytes: int, max_bytes: int, log_bytes: int, long: bool
) -> None:
    """A log never holds more than `gather_taps` records, nor more bytes than
    `gather_bytes` (at least one record), but for a count known before the run that
    packs into `gather_log_bytes`, which is one log: no flush while it runs. A run that
    may be paced live takes one log only within `gather_taps` records and twice
    `gather_bytes` (each chunk's flush sends the whole log)."""
    capacity = plan(records, taps, row_bytes, max_bytes, log_bytes, long)
    aval = core.ShapedArray((row_bytes // 4,), np.dtype(np.float32))
    packed = host.packed_size(host.packed_layout(0, records, [[aval]]))
    bound = min(log_bytes, 2 * max_bytes) if long else log_bytes
    fits_once = records > 0 and (records <= taps or not long) and packed <= bound
    if fits_once:
        assert capacity == records
    else:
        assert 1 <= capacity <= taps
        assert capacity * row_bytes <= max(max_bytes, row_bytes)


DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.uint16,
    np.float16,
    ml_dtypes.bfloat16,
    np.int32,
    np.float32,
    np.complex64,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (5, 3), (0, 2), (7, 1, 3)])
def test_packed_words_hold_each_piece_s_bytes_where_the_layout_places_them(
    dtype: type, shape: tuple[int, ...]
) -> None:
    capacity, sites = 3, 2
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(capacity, *shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    buffer = raw.view(dtype).reshape(capacity, *shape)
    if np.dtype(dtype) == np.bool_:
        buffer = raw[..., 0] % 2 == 1
    elif np.issubdtype(dtype, np.floating) or np.dtype(dtype) == ml_dtypes.bfloat16:
        buffer = np.nan_to_num(buffer.astype(np.float32)).astype(dtype)  # (no NaN payloads)
    log = np.array([1, 0, 1], np.int32)
    order = np.array([0, 0, 1], np.int32)
    skipped = np.array([4, 9], np.int32)
    scalars = np.full((capacity,), 2.5, np.float32)  # (a second site's, of scalars)
    packed = np.asarray(
        host.pack(np.int32(2), log, order, skipped, [jnp.asarray(buffer), jnp.asarray(scalars)])
    )
    assert packed.dtype == np.uint32
    data = host.as_bytes(packed)
    avals = [[core.ShapedArray(shape, np.dtype(dtype))], [core.ShapedArray((), np.float32)]]
    layout = host.packed_layout(sites, capacity, avals)
    assert data.size == layout[-1][2] + 16  # (the last piece: 3 float32s, padded to 8s)

    def piece(index: int) -> np.ndarray:
        piece_dtype, piece_shape, offset = layout[index]
        size = int(np.prod(piece_shape, dtype=np.int64)) * piece_dtype.itemsize
        return data[offset : offset + size].view(piece_dtype).reshape(piece_shape)

    assert int(piece(host.COUNT)) == 2
    assert piece(host.LOG).tolist() == log.tolist()
    assert piece(host.ORDER).tolist() == order.tolist()
    assert piece(host.SKIPPED).tolist() == skipped.tolist()
    expected = np.asarray(buffer)
    if np.dtype(dtype) == np.bool_:
        expected = expected.astype(np.uint8)
        assert piece(host.BUFFERS).view(np.uint8).tolist() == expected.tolist()
    else:
        assert piece(host.BUFFERS).tobytes() == expected.tobytes()
    assert piece(host.BUFFERS + 1).tolist() == [2.5] * capacity


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("elements", [0, 1, 128, 1000, 1024, 2048, 4096, 8192, 1024 * 1024 + 128])
def test_a_stored_vector_is_whole_tiles_or_left_as_it_is(dtype: type, elements: int) -> None:
    """`stored_shape`: a vector of whole (sublanes, 128) tiles (8 rows of 4-byte
    elements, 16 of 2-byte, 32 of 1-byte) is stored [n / 128, 128], so that a record of
    a buffer is whole tiles of a TPU's layout; any other vector, and any array of rank
    2 or more (whose own last dimensions are the tiled ones), is stored as it is."""
    sublanes = max(8, 32 // np.dtype(dtype).itemsize)
    stored = stored_shape(core.ShapedArray((elements,), np.dtype(dtype)))
    if elements and elements % (128 * sublanes) == 0:
        assert stored == (elements // 128, 128)
        assert stored[0] % sublanes == 0
    else:
        assert stored == (elements,)
    for shape in [(4, elements), (elements, 1), (2, 3, elements)]:
        assert stored_shape(core.ShapedArray(shape, np.dtype(dtype))) == shape


@pytest.mark.parametrize("words", [1, 127, 2**18 - 1, 2**18, 2**18 + 1, 2**18 + 129])
def test_an_output_of_a_mebibyte_or_more_leaves_in_rows_holding_the_same_bytes(
    words: int,
) -> None:
    """`as_rows`: packed words of ROWS_FROM bytes or more leave as (rows, 128) words,
    zero-padded to a whole row (`output_size`); fewer stay a vector. The host reads the
    same bytes from either (`as_bytes`), the padding after them."""
    packed = np.arange(words, dtype=np.uint32) * np.uint32(2654435761)
    out = np.asarray(host.as_rows(jnp.asarray(packed)))
    size = 4 * words
    if size >= host.ROWS_FROM:
        assert out.shape == (-(-words // host.ROW_WORDS), host.ROW_WORDS)
    else:
        assert out.shape == (words,)
    data = host.as_bytes(out)
    assert data.ndim == 1 and data.size == host.output_size(size)
    assert data[:size].tobytes() == packed.tobytes()
    assert not data[size:].any()
