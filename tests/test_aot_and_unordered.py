"""Taps in executables compiled ahead of time, and taps lowered without the ordering
token (`ordered=False`, TAPD_ORDERED=0): real daemon, subscriber and JAX processes, once
per emitter backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from conftest import Daemon, SubscriberProcess, run_emitter

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def by_seq(records: list[dict[str, Any]], consumer: str) -> list[dict[str, Any]]:
    return sorted((r for r in records if r["consumer"] == consumer), key=lambda r: r["seq"])


@pytest.mark.parametrize("ordered", ["1", "0"])
def test_an_executable_compiled_ahead_of_time_taps_on_every_one_of_100_calls(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str, ordered: str
) -> None:
    # JAX's C++ fast path serves an AOT executable from its second call on; it used to
    # drop an ordered native tap's token ("Execution supplied 1 arguments but compiled
    # program expected 2", docs/UPSTREAM.md).
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "aot")
    result = run_emitter(daemon.endpoint, "ahead_of_time", "100", ordered)
    assert result["backend"] == backend
    assert result["results"] == [10 * call + 3 for call in range(100)]
    records = by_seq(subscriber.records(), "aot")
    assert [r["seq"] for r in records] == list(range(300))
    assert [(r["step"], r["value"]) for r in records] == [
        (i, 10 * call + i) for call in range(100) for i in range(3)
    ]


@pytest.mark.parametrize("setting", ["0", "1"])
def test_unordered_taps_deliver_every_tap_numbered_by_seq(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str, setting: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "unordered.a", "unordered.b")
    result = run_emitter(daemon.endpoint, "unordered", "50", env={"TAPD_ORDERED": setting})
    assert result["outs"] == [2 * i + 1 for i in range(50)]
    # ordered=False says so itself; TAPD_ORDERED decides the other tap. Without an
    # ordered tap the program threads no token at all.
    assert (result["tokens_in_hlo"] == 0) == (setting == "0")
    records = subscriber.records()
    for consumer, offset in (("unordered.a", 0), ("unordered.b", 1)):
        taps = by_seq(records, consumer)
        assert [r["seq"] for r in taps] == list(range(50)), consumer
        assert [(r["step"], r["value"]) for r in taps] == [(i, 2 * i + offset) for i in range(50)]
    assert result["stats"]["delivered"] == 100


@pytest.mark.fast
def test_tap_refuses_an_ordered_that_is_not_a_bool_nor_strict() -> None:
    import jax.numpy as jnp

    import tapd

    with pytest.raises(
        tapd.TapDefinitionError, match=r"ordered='no' must be True, False or 'strict'"
    ):
        tapd.tap(jnp.ones(2), "x", ordered="no")
