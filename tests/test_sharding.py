"""Sharded taps end to end: shard_map, jit over a mesh, pmap of vmap, on both backends.

Each tap carries its shard metadata (mesh coordinates, global shapes); a plain
subscriber sees one tap per device, an assembling one the global value per step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from conftest import Daemon, SubscriberProcess, run_emitter

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

CONSUMERS = ("shard_map", "jit_explicit", "jit_auto", "pmap_vmap")
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


@pytest.fixture
def sharded_run(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    daemon = start_daemon()
    plain = start_subscriber(daemon, *CONSUMERS)
    assembling = start_subscriber(daemon, *CONSUMERS, assemble=True)
    result = run_emitter(daemon.endpoint, "sharded", env=FOUR_DEVICES)
    assert result["backend"] == backend
    return result, plain.records(), assembling.records()


def of(records: list[dict[str, Any]], consumer: str) -> list[dict[str, Any]]:
    mine = [r for r in records if r["consumer"] == consumer]
    return sorted(mine, key=lambda r: r.get("shard_index") or 0)  # assembled ones have none


def test_shard_map_taps_each_block_with_its_place_in_the_global_value(
    sharded_run: tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    result, plain, assembled = sharded_run
    grid = np.array(result["grid"])
    taps = of(plain, "shard_map")
    assert [r["shard_index"] for r in taps] == [0, 1, 2, 3]
    for r in taps:
        a, b = r["mesh_coords"]["a"], r["mesh_coords"]["b"]
        assert r["shard_index"] == 2 * a + b
        assert r["global_shapes"] == [[4, 4]]  # spec=P("a", "b") tiles the 2x2 blocks
        assert r["value"] == grid[2 * a : 2 * a + 2, 2 * b : 2 * b + 2].tolist()
    [whole] = of(assembled, "shard_map")
    assert whole["value"] == grid.tolist()


def test_jit_over_an_explicit_mesh_taps_per_shard_not_a_gathered_value(
    sharded_run: tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    result, plain, assembled = sharded_run
    grid = np.array(result["grid"])
    taps = of(plain, "jit_explicit")
    assert len(taps) == 4  # one per device; rows split over "a", replicated over "b"
    for r in taps:
        a = r["mesh_coords"]["a"]
        assert r["value"]["x"] == grid[2 * a : 2 * a + 2].tolist()
        assert r["value"]["y"] == grid[2 * a : 2 * a + 2, :1].tolist()
        assert r["global_shapes"] == [[4, 4], [4, 1]]
    [whole] = of(assembled, "jit_explicit")
    assert whole["value"] == {"x": grid.tolist(), "y": grid[:, :1].tolist()}


def test_jit_with_compiler_chosen_sharding_taps_the_whole_value_once(
    sharded_run: tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    _, plain, assembled = sharded_run
    [tap] = of(plain, "jit_auto")
    assert tap["value"] == [2.0 * i for i in range(8)]
    assert tap["shard_index"] is None and tap["global_shapes"] is None
    assert of(assembled, "jit_auto") == []  # nothing to assemble: the Assembler says so


def test_vmap_inside_pmap_keeps_the_batch_dimension_in_the_layout(
    sharded_run: tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    result, plain, assembled = sharded_run
    grid = np.array(result["grid"]).reshape(4, 2, 2)
    taps = of(plain, "pmap_vmap")
    assert [r["shard_index"] for r in taps] == [0, 1, 2, 3]
    for r in taps:
        assert r["transforms"] == [["batch", {"batch_dims": [0]}]]
        assert r["global_shapes"] == [[2, 4, 2]]  # (batch, pmap axis, row)
        assert r["value"] == grid[r["shard_index"]].tolist()
    [whole] = of(assembled, "pmap_vmap")
    assert whole["value"] == grid.transpose(1, 0, 2).tolist()
