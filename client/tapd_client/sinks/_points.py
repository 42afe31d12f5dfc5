"""What every sink writes: the named points a tap becomes.

A tap's value is a pytree; each leaf becomes one `Point` tagged by its path under the
tap's name (`grads/w`, `state/0`, `point/x`: dict keys, sequence indices, namedtuple
fields; `None` leaves and empty arrays are skipped), at step `meta.step` (the tap's `seq`
when it has none) and wall time `meta.time`. A leaf is
- an image: `HxW` or `HxWxC` (C = 1, 3 or 4) tapped with `image=True` in its static
  metadata, uint8 or floats in [0, 1] (made uint8 here, so every tool gets the same);
- else a scalar: one element (a complex number's magnitude);
- else a histogram: the flattened values as float64 (complex: magnitudes).
A per-shard tap (pmap, shard_map) gets `/shard<index>` after its tag, and with
`process_in_tag` each tag starts with the emitting process, `p<index>/`, so that the
processes of a multi-host job do not write over each other's points.

`batch_points` reads a `TapBatch`'s columns (no per-tap `TapMeta` is made);
`assembled_points` takes one step's global value, put together by `Assembler`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from tapd_client.batch import TapBatch
from tapd_client.meta import TapMeta

Kind = Literal["scalar", "histogram", "image"]


@dataclasses.dataclass(frozen=True)
class Point:
    tag: str
    kind: Kind
    value: Any  # float (scalar), float64 1-d array (histogram), uint8 HxW[xC] (image)
    step: int
    time: float  # seconds since the epoch


def batch_points(batch: TapBatch, *, process_in_tag: bool) -> Iterator[Point]:
    """The points of a batch's taps, leaf by leaf, each leaf's taps in order."""
    meta = batch.meta  # the static fields, every tap's
    prefix = f"p{meta.process}/" if process_in_tag else ""
    steps = np.where(batch.step >= 0, batch.step, batch.seq).tolist()
    times = batch.time.tolist()
    shards = None if batch.shard_index is None else batch.shard_index.tolist()
    image = bool(meta.meta.get("image"))
    for path, stacked in leaves(batch.value):
        tag = prefix + "/".join([meta.consumer, *path])
        stacked = np.asarray(stacked)
        for i, (step, time) in enumerate(zip(steps, times, strict=True)):
            suffix = "" if shards is None else f"/shard{shards[i]}"
            point = _point(tag + suffix, stacked[i], step, time, image)
            if point is not None:
                yield point


def assembled_points(value: Any, metas: Sequence[TapMeta]) -> Iterator[Point]:
    """The points of a step's shards put back together: one global value, with neither a
    shard suffix nor a process prefix (it spans the processes), at the last shard's time."""
    meta, time = metas[0], max(m.time for m in metas)
    step = meta.step if meta.step is not None else meta.seq
    image = bool(meta.meta.get("image"))
    for path, leaf in leaves(value):
        point = _point("/".join([meta.consumer, *path]), np.asarray(leaf), step, time, image)
        if point is not None:
            yield point


def _point(tag: str, array: np.ndarray, step: int, time: float, image: bool) -> Point | None:
    """One leaf's point (None for an empty one). Its value never aliases `array`, which
    may be a view of a received message that lives only as long as the handler call."""
    if array.size == 0:
        return None
    if image and _is_image(array):
        return Point(tag, "image", _to_uint8(array), step, time)
    if array.size == 1:
        number = array.reshape(()).item()
        number = abs(number) if isinstance(number, complex) else number
        return Point(tag, "scalar", float(number), step, time)
    if np.iscomplexobj(array):
        array = np.abs(array)
    return Point(tag, "histogram", array.astype(np.float64).reshape(-1), step, time)


def _is_image(value: np.ndarray) -> bool:
    return value.ndim == 2 or (value.ndim == 3 and value.shape[2] in (1, 3, 4))


def _to_uint8(value: np.ndarray) -> np.ndarray:
    if value.dtype == np.uint8:
        return value.copy()
    return np.rint(np.clip(value.astype(np.float32), 0.0, 1.0) * 255).astype(np.uint8)


def leaves(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[list[str], Any]]:
    """(path, leaf) for every leaf of a tapped value, as subscribers rebuild it."""
    if value is None:
        return
    if isinstance(value, dict):
        for key, child in value.items():
            yield from leaves(child, (*path, str(key)))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        for field, child in zip(value._fields, value, strict=True):
            yield from leaves(child, (*path, field))
    elif isinstance(value, tuple | list):
        for index, child in enumerate(value):
            yield from leaves(child, (*path, str(index)))
    else:
        yield list(path), value
