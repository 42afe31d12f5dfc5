"""Program order against the references, on every path (issue 49).

- Random programs (tests/apps/order_property_app.py: Hypothesis draws them, with taps
  nested in fori_loop, scan, while_loop, cond, switch, nested jit, vmap, grad and
  checkpoint) deliver, under `jax.jit`, the taps the same program gives run eagerly
  (`jax.disable_jit()`), and tapd.debug's those of `jax.debug.callback(ordered=True)`:
  the same taps, values and order. On the native backend, the portable one, and the
  gathered path with logs of 2 records and of 1 (flushes inside every loop and
  branch), and with every loop paced a step a chunk (a latency of a nanosecond). A
  fixed seed set here (TAPD_ORDER_EXAMPLES a path); many more in the soak tier
  (`pytest -m soak`, which `.ci/run` runs), for as long as its time budget allows.
- The programs Hypothesis shrank from failures, kept as regressions.
- The two shapes the issue names, for `tapd.tap` (a subscriber in another process),
  `id_tap` and `tapd.debug.callback(ordered=True)`, on both CPU backends: 12 of 12.
- A tap larger than its whole ring, under `block`, is refused as it is traced, naming
  its size and the setting; under `drop_newest` it is dropped and counted.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import pytest
from zygote import run_program

from conftest import APPS, Daemon, SubscriberProcess, native_unavailable, wait_until

pytestmark = [
    pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable())),
    pytest.mark.timeout(900),
]

SETTINGS = {
    "native": {"TAPD_BACKEND": "native"},
    "portable": {"TAPD_BACKEND": "portable", "TAPD_GATHER": "off"},
    "gathered_taps2": {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "TAPD_GATHER_TAPS": "2",
        "TAPD_GATHER_LOG_BYTES": "1",
    },
    "gathered_bytes1": {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "TAPD_GATHER_BYTES": "1",
        "TAPD_GATHER_LOG_BYTES": "1",
    },
    # Every loop at the top paced, one step a chunk (tapd.emitter.gathered.live).
    "gathered_paced": {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "TAPD_GATHER_LATENCY": "1e-9",
    },
    # No loop paced, every one chunked by a log of 2 (what a loop over several devices
    # gets: rewrite's chunked scan and while).
    "gathered_unpaced": {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "TAPD_GATHER_TAPS": "2",
        "TAPD_GATHER_LOG_BYTES": "1",
        "TAPD_GATHER_LATENCY": "0",
    },
    # Logs of 1024: most programs take one log, and their second call JAX's C++ path.
    "gathered": {"TAPD_BACKEND": "portable", "TAPD_GATHER": "on"},
}
BASE_ENV = {"JAX_PLATFORMS": "cpu", "TAPD_AUTOSTART": "0"}

# Programs Hypothesis found and shrank (Program.source), each with what it caught.
REGRESSIONS = [
    # Two taps in a nested jit, then one after it: the one after ran between them.
    "[('jit', 0, [('tap', 0, 'a', False), ('tap', 0, 'a', False)], [], []),"
    " ('tap', 0, 'b', False)]",
    # A tap of a loop-invariant value under grad of a scan: once a step, as eagerly
    # (it ran once); tapd.debug's once, as jax.debug's.
    "[('grad', 0, [('scan', 3, [('tap', 0, 'b', False)], [], [])], [], [])]",
    # The same under checkpoint, in a loop that runs no step: no tap (one ran).
    "[('tap', 0, 'a', False), ('grad', 0, [('checkpoint', 0, [('fori', 0, [('tap', 0, 'a',"
    " False)], [], [])], [], [])], [], [])]",
    # tapd.debug under grad of checkpoint: staged again, as jax.debug.
    "[('tap', 0, 'a', False), ('grad', 0, [('checkpoint', 0, [('tap', 0, 'a', False)], [],"
    " [])], [], [])]",
    # A while that passes a tapped value through, in a fori_loop (the issue's shape 1).
    "[('fori', 2, [('tap', 0, 'b', True), ('while', 2, [('bump', 'a'), ('tap', 1, 'a', True)],"
    " [], [])], [], [])]",
    # A nested jit whose cond taps, then a tap (shape 2).
    "[('jit', 0, [('tap', 0, 'a', False), ('cond', 0, [('tap', 1, 'a', False)], [('tap', 2,"
    " 'v', False)], [])], [], []), ('tap', 3, 'a', False)]",
    # A vmapped loop whose carry is partly batched.
    "[('tap', 0, 'a', False), ('bump', 'a'), ('vmap', 0, [('fori', 1, [('tap', 0, 'v', False),"
    " ('bump', 'v')], [], [])], [], [])]",
]


def run_app(args: list[str], env: dict[str, str], timeout: float = 800) -> dict[str, Any]:
    full_env = {**os.environ, **BASE_ENV, **env}
    result = run_program(
        [sys.executable, str(APPS / "order_property_app.py"), *args], env=full_env, timeout=timeout
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {result.returncode})\n{result.stdout}\n{result.stderr}"
    outcome: dict[str, Any] = json.loads(lines[-1])
    assert result.returncode == (0 if outcome["ok"] else 1), result.stderr
    return outcome


# Programs a path in the suite's fixed-seed run: 10 (~30 s of CPU on a gathered path);
# `.ci/run` gives the oldest jax fewer (its seams are what it checks), and the soak tier
# many more, from other seeds.
EXAMPLES = int(os.environ.get("TAPD_ORDER_EXAMPLES", "10"))


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_random_programs_keep_program_order(setting: str) -> None:
    outcome = run_app(
        [str(EXAMPLES), str(49_000 + list(SETTINGS).index(setting))], SETTINGS[setting]
    )
    assert outcome["ok"], f"{outcome['program']}\n{outcome['failure']}"
    assert outcome["checked"] == EXAMPLES
    if setting == "gathered":  # (the C++ path was taken, and checked)
        assert outcome["fast_calls"] > 0


# The soak tier is sized by time (issue 64): each path checks random programs for
# TAPD_SOAK_SECONDS (75 by default: the tier's 8 tests in two workers fit `.ci/run`'s
# share) and at least SOAK_FLOOR programs (25, what the suite checked a path before),
# in rounds of ten, a seed a round, from a first seed of its own. Set it higher when
# hunting (TAPD_SOAK_SECONDS=3600).
SOAK_SECONDS = float(os.environ.get("TAPD_SOAK_SECONDS", "75"))
# (a paced program chunks every loop a step a chunk: several times as long)
SOAK_FLOOR = {"gathered_paced": 10}


@pytest.mark.soak
@pytest.mark.timeout(SOAK_SECONDS + 900)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_many_random_programs_keep_program_order(setting: str) -> None:
    floor = SOAK_FLOOR.get(setting, 25)
    first_seed = 4_900_000 + 1_000 * list(SETTINGS).index(setting)
    outcome = run_app(
        ["--seconds", str(SOAK_SECONDS), str(floor), str(first_seed)],
        SETTINGS[setting],
        timeout=SOAK_SECONDS + 800,
    )
    assert outcome["ok"], (
        f"round seed {outcome['round_seed']}:\n{outcome['program']}\n{outcome['failure']}"
    )
    assert outcome["checked"] >= floor
    print(f"{setting}: {outcome['checked']} programs in {outcome['rounds']} rounds")


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_shrunk_programs_stay_fixed(setting: str) -> None:
    outcome = run_app(["--programs", json.dumps(REGRESSIONS)], SETTINGS[setting])
    assert outcome["ok"], json.dumps(outcome["failures"], indent=1)
    assert outcome["checked"] == len(REGRESSIONS)


PROGRAM_ORDER = {
    "shape_1": ["before", "inside", "inside", "before", "inside", "inside"],
    "shape_2": ["first", "in_cond", "after"],
}
NAMES = ["before", "inside", "in_cond", "first", "after"]
BACKENDS = {"native": {"TAPD_BACKEND": "native"}, "portable": {"TAPD_BACKEND": "portable"}}


def shapes(kind: str, env: dict[str, str], endpoint: str = "") -> dict[str, Any]:
    full_env = {**os.environ, **BASE_ENV, **env}
    if endpoint:
        full_env["TAPD_ENDPOINT"] = endpoint
    argv = [sys.executable, str(APPS / "order_shapes_app.py"), "shapes", kind]
    result = run_program(argv, env=full_env, timeout=300)
    assert result.returncode == 0, result.stderr
    outcome: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return outcome


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("kind", ["id_tap", "debug"])
def test_the_issues_shapes_in_program_order(kind: str, backend: str) -> None:
    assert shapes(kind, BACKENDS[backend]) == PROGRAM_ORDER


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_issues_shapes_reach_a_subscriber_in_program_order(
    backend: str,
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "order")
    shapes("tap", BACKENDS[backend], daemon.endpoint)
    expected = [*PROGRAM_ORDER["shape_1"], *PROGRAM_ORDER["shape_2"]]
    wait_until(lambda: len(subscriber.records()) >= len(expected), "every tap at the subscriber")
    records = subscriber.records()
    assert [record["seq"] for record in records] == list(range(len(expected)))
    assert [NAMES[record["value"]["tag"]] for record in records] == expected


def test_a_tap_larger_than_its_ring_is_refused_under_block() -> None:
    env = {**os.environ, **BASE_ENV}
    result = run_program([sys.executable, str(APPS / "order_shapes_app.py"), "too_big"], env=env)
    refused = json.loads(result.stdout.splitlines()[-1])["refused"]
    assert refused is not None, result.stderr
    assert "4194360 bytes" in refused and "65536" in refused and "TAPD_BUFFER_BYTES" in refused
    assert "'block'" in refused


def test_a_tap_larger_than_its_ring_is_dropped_and_counted_under_drop_newest() -> None:
    env = {**os.environ, **BASE_ENV, "TAPD_EMITTER_POLICY": "drop_newest"}
    result = run_program([sys.executable, str(APPS / "order_shapes_app.py"), "too_big"], env=env)
    assert json.loads(result.stdout.splitlines()[-1])["refused"] is None
    assert "larger than the whole ring; dropped" in result.stderr
    assert "1 dropped under drop_newest" in result.stderr
