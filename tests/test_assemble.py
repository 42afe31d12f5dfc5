"""Assembler: shards of a step become one global value; stale steps are reported."""

from __future__ import annotations

from typing import Any

import numpy as np

from tapd_client import Assembler, TapMeta


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
