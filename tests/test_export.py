"""Tapped computations that travel (tapd/emitter/entries.py, tapd/emitter/exported.py):
a `jax.export` artifact made in one process, deserialized and called in another, taps
by its sites' names as the traced function does; what cannot travel is refused at export,
naming the site; JAX's persistent compilation cache hits across processes that traced
their sites in another order. Real daemon, subscriber and JAX processes; native backend
(a portable tap is a host callback, which JAX neither exports nor caches)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Daemon, SubscriberProcess, native_unavailable, run_emitter

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

pytestmark = pytest.mark.skipif(
    bool(native_unavailable()), reason=f"needs tapd's native handler: {native_unavailable()}"
)


def run_export(daemon: Daemon, scenario: str, *args: str, **env: str) -> dict[str, Any]:
    return run_emitter(daemon.endpoint, scenario, *args, env=env, app="export_app.py")


def comparable(records: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    """One process's records, without what names the process."""
    mine = [r for r in records if r["process"] is not None and f":{pid}" in str(r["emitter"])]
    return [{k: v for k, v in r.items() if k != "emitter"} for r in mine]


def test_an_exported_function_called_in_another_process_taps_as_the_traced_one(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "export.*")
    artifact = tmp_path / "model.jax"
    run_export(daemon, "export", str(artifact))
    loaded = run_export(daemon, "call", "loaded", str(artifact), "2")
    traced = run_export(daemon, "call", "traced", str(artifact), "2")
    assert loaded["results"] == traced["results"]
    assert loaded["stats"]["delivered"] == traced["stats"]["delivered"] == 8
    records = subscriber.records()
    from_loaded = comparable(records, loaded["pid"])
    from_traced = comparable(records, traced["pid"])
    # seq, step, the tree (a dict of an int and a row), dtypes and shapes, as traced
    assert from_loaded == from_traced
    loop = [r for r in from_loaded if r["consumer"] == "export.loop"]
    assert [(r["seq"], r["step"]) for r in loop] == [(i, i % 3) for i in range(6)]
    assert loop[1]["value"] == {"i": 1, "row": [0.0, 2.0, 4.0, 6.0]}
    out = [r for r in from_loaded if r["consumer"] == "export.out"]
    assert [r["value"] for r in out] == [[0, 8, 16, 24], [8, 16, 24, 32]]


def test_a_process_that_only_imported_tapd_loads_and_calls_the_artifact(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path
) -> None:
    """`jax.export.deserialize` itself, in a process that imported tapd and called
    nothing of it: tapd registered its part as JAX's serialization module loaded."""
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "export.out")
    artifact = tmp_path / "model.jax"
    run_export(daemon, "export", str(artifact))
    loaded = run_export(daemon, "load_bare", str(artifact))
    assert loaded["error"] is None
    assert [r["value"] for r in comparable(subscriber.records(), loaded["pid"])] == [[0, 8, 16, 24]]


def test_what_cannot_travel_is_refused_at_export_naming_the_site(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    errors = run_export(daemon, "refusals")["errors"]
    assert errors["named"] is None
    for name, function in (("id_tap_closure", "keep"), ("debug_callback", "print")):
        assert errors[name] is not None
        assert errors[name].startswith("TapDefinitionError: tap site 'local/")
        assert f"{function}' cannot be exported" in errors[name]
    portable = run_export(daemon, "refusals", TAPD_BACKEND="portable")["errors"]
    assert portable["named"] is not None
    assert "tap site 'export.named' cannot be exported for platform 'cpu'" in portable["named"]


def test_the_persistent_cache_hits_across_processes_whatever_order_they_traced_in(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "cache.*")
    cache = tmp_path / "cache"
    first = run_export(daemon, "cached", str(cache), "ab")
    second = run_export(daemon, "cached", str(cache), "ba")
    assert first["hits"] == 0 and first["misses"] >= 2
    # Every computation of the second process came from the cache, its two tapped
    # functions too, though it traced them the other way round.
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    records = subscriber.records()
    for run in (first, second):
        mine = {r["consumer"]: r for r in comparable(records, run["pid"])}
        assert mine["cache.a"]["value"] == [1.0, 2.0, 3.0] and mine["cache.a"]["step"] == 1
        assert mine["cache.b"]["value"] == [-1, 0, 1] and mine["cache.b"]["step"] == 2


def test_tap_functions_of_the_process_hit_the_persistent_cache_in_the_next_process(
    tmp_path: Path,
) -> None:
    """A `tapd.debug` callback or `id_tap` closure names its function in the computation
    without the process's pid (LocalPath.entry_name), so the next run of the program
    loads its executables from the cache, and each tap still reaches the function this
    process traced: two lambdas of one name too. No daemon takes part."""
    cache = str(tmp_path / "cache")
    nowhere = f"ipc://{tmp_path}/no-daemon"
    first = run_emitter(nowhere, "cached_local", cache, "ab", app="export_app.py")
    second = run_emitter(nowhere, "cached_local", cache, "ba", app="export_app.py")
    assert first["hits"] == 0 and first["misses"] >= 3
    assert second["misses"] == 0 and second["hits"] == first["misses"]
    expected = {
        "ab": [["a", [1.0, 2.0, 3.0]], ["b", [-1.0, 0.0, 1.0]]],
        "ba": [["b", [-1.0, 0.0, 1.0]], ["a", [1.0, 2.0, 3.0]]],
    }
    twins = [["twin0", [0.0, 1.0, 2.0]], ["twin1", [1.0, 2.0, 3.0]]]
    for run, order in ((first, "ab"), (second, "ba")):
        assert run["calls"][:2] == expected[order]
        assert sorted(run["calls"][2:]) == sorted([*twins, ["id_tap", [0.0, 10.0, 20.0]]])
