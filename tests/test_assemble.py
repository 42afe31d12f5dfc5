"""Assembler: shards of a step become one global value; stale steps are reported."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tapd_client import Assembler, ShardInfo, TapMeta

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)


def meta(process: int, device: int, step: int, consumer: str = "g") -> TapMeta:
    return TapMeta(consumer=consumer, seq=step, step=step, device=device, process=process,
                   host="h", pid=1, emitter="h:1", transforms=(), time=0.0,
                   meta={})  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_shards_are_stacked_in_process_device_order_once_all_arrived() -> None:
    calls: list[tuple[Any, list[TapMeta]]] = []
    assembler = Assembler(lambda value, metas: calls.append((value, metas)), shards=4)
    for process, device in [(1, 1), (0, 1), (1, 0), (0, 0)]:  # arrival order scrambled
        assert not calls
        assembler({"x": np.array([10 * process + device])}, meta(process, device, step=3))
    [(value, metas)] = calls
    assert value["x"].tolist() == [[0], [1], [10], [11]]
    assert [(m.process, m.device) for m in metas] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_redelivered_shard_replaces_rather_than_completes() -> None:
    calls: list[Any] = []
    assembler = Assembler(lambda value, metas: calls.append(value), shards=2)
    assembler(np.array(1), meta(0, 0, step=0))
    assembler(np.array(1), meta(0, 0, step=0))  # the same device again
    assert calls == []
    assembler(np.array(2), meta(0, 1, step=0))
    assert [c.tolist() for c in calls] == [[1, 2]]


def test_incomplete_steps_are_reported_after_the_timeout_not_waited_for() -> None:
    clock = Clock()
    reported: list[tuple[str, int | None, int]] = []
    calls: list[Any] = []
    assembler = Assembler(
        lambda value, metas: calls.append(value), shards=3, timeout=5.0, clock=clock,
        on_incomplete=lambda consumer, step, metas: reported.append((consumer, step, len(metas))),
    )  # fmt: skip
    assembler(np.array(0), meta(0, 0, step=7))
    assembler(np.array(1), meta(0, 1, step=7))
    clock.now = 4.0
    assembler.expire()
    assert reported == []
    clock.now = 6.0
    assembler.expire()
    assert reported == [("g", 7, 2)]
    assembler(np.array(2), meta(0, 2, step=7))  # a late shard starts over, alone
    assert calls == []


def sharded_meta(coords: tuple[int, ...], layout: list[Any], step: int = 0) -> TapMeta:
    shard = ShardInfo.from_header({"axes": ["a", "b"], "sizes": [2, 2], "coords": list(coords),
                                   "layout": layout})  # fmt: skip
    return dataclasses.replace(meta(0, 0, step), device=None, shard=shard)


def test_shard_info_names_the_block_of_each_leaf() -> None:
    tiled = [[4, 6], [["a"], ["b"]]]
    stacked = [[2, 2, 3], [["a"], ["b"], []]]
    info = sharded_meta((1, 0), [tiled, stacked]).shard
    assert info is not None
    assert (info.index, info.count, info.mesh_coords) == (2, 4, {"a": 1, "b": 0})
    assert info.block(0) == (slice(2, 4), slice(0, 3))
    assert info.block(1) == (slice(1, 2), slice(0, 1), slice(0, 3))


def test_blocks_are_placed_by_their_layout_whatever_the_arrival_order() -> None:
    grid = np.arange(24.0).reshape(4, 6)
    calls: list[Any] = []
    assembler = Assembler(lambda value, metas: calls.append(value))  # count from the layout
    for a, b in [(1, 1), (0, 0), (1, 0), (0, 1)]:
        assert not calls
        block = grid[2 * a : 2 * a + 2, 3 * b : 3 * b + 3]
        rows = grid[2 * a : 2 * a + 2, 0]  # split over "a", the same on both "b" devices
        assembler({"g": block, "rows": rows},
                  sharded_meta((a, b), [[[4, 6], [["a"], ["b"]]], [[4], [["a"]]]]))  # fmt: skip
    [value] = calls
    assert value["g"].tolist() == grid.tolist()
    assert value["rows"].tolist() == grid[:, 0].tolist()


def test_taps_with_neither_layout_nor_shards_are_counted_not_assembled() -> None:
    calls: list[Any] = []
    assembler = Assembler(lambda value, metas: calls.append(value))
    assembler(np.array(1), meta(0, 0, step=0))
    assert (calls, assembler.unplaced) == ([], 1)
