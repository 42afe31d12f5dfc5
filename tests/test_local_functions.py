"""Tap functions that run in the emitting process (issue 9, item 9): lambdas, closures,
bound methods and callable objects always; importable functions when no subscriber
takes them. Real daemon, real JAX processes (tests/apps/local_app.py), real tqdm and
wandb; and the router's fallback rule in process."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zygote import run_program

import tapd
from conftest import APPS, PROCESS_TIMEOUT, Daemon, MakeRouter, SubscriberProcess, wait_until
from tapd.emitter.host_callback import importable_form
from tapd.protocol import decode, encode

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def run_app(
    endpoint: str, scenario: str, *args: str, env: dict[str, str] | None = None,
    expect_rc: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Run one scenario of tests/apps/local_app.py; the JSON object it prints last (with
    its "stdout" and "stderr")."""
    result = run_program(
        [sys.executable, str(APPS / "local_app.py"), scenario, *args],
        env={**os.environ, "TAPD_ENDPOINT": endpoint, **(env or {})},
        timeout=PROCESS_TIMEOUT * 2,
    )
    assert result.returncode == expect_rc, f"{scenario}: rc {result.returncode}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    output: dict[str, Any] = json.loads(lines[-1]) if lines and expect_rc == 0 else {}
    output.update(stdout=result.stdout, stderr=result.stderr)
    return output


# ---- in the emitting process, with real processes ---------------------------------------


@pytest.mark.usefixtures("backend")
def test_closures_bound_methods_and_a_tqdm_bar_run_in_the_emitting_process(
    start_daemon: StartDaemon,
) -> None:
    pytest.importorskip("tqdm")
    daemon = start_daemon()
    got = run_app(daemon.endpoint, "closures")
    steps = 6
    xs = [float(i) for i in range(steps)]
    assert got["total"] == sum(xs)
    assert got["pbar_n"] == steps and got["pbar_output_has_100"]  # a real tqdm bar, driven
    # Program order across the taps of one step, and step after step, as host_callback.
    assert got["log"] == [entry for x in xs for entry in (["first", x], ["partial", x + 1])]
    assert got["recorder"] == [c for x in xs for c in (10 * x, ["called", 100 * x])]
    assert got["counter"] == [x + 0.5 for x in xs]  # a bound method of an importable class
    assert got["printed"] == "".join(f"what: x\n{x:.0f}.\n" for x in xs)  # id_print's format
    assert got["types"] == ["Pair:State"] * steps  # the site's own pytree classes
    assert got["devices"] == ["cpu:0"] * steps  # device= is the jax.Device
    stats = got["stats"]
    assert stats["delivered"] == stats["submitted"] == 9 * steps
    assert stats["unrouted"] == stats["errors"] == 0


@pytest.mark.usefixtures("backend")
def test_an_exception_in_a_closure_surfaces_at_barrier_wait(start_daemon: StartDaemon) -> None:
    daemon = start_daemon()
    got = run_app(daemon.endpoint, "raising")
    assert got["seen"] == [0.0, 1.0, 3.0]  # the other taps still ran, in order
    # As host_callback's: the closure's exception as Python formats it (its own frame
    # last), matched as JAX's host_callback test did, then the list of failures.
    assert re.search(
        "There were exceptions during callback processing. Last one was:.*"
        r'local_app\.py", line \d+, in tap\n.*'
        "ValueError: deliberate failure at 2\n\n",
        got["raised"],
        re.DOTALL,
    ), got["raised"]
    assert re.search(
        r"\n\n1 tap function call\(s\) raised:\n  local/\S+/raising\.<locals>\.tap#2: "
        r"tap function raised ValueError\('deliberate failure at 2'\)$",
        got["raised"],
    ), got["raised"]
    assert got["cause"] == "ValueError('deliberate failure at 2')"  # chained, as host_callback
    assert got["alias"]
    assert "deliberate failure at 2" in got["stderr"]  # and logged with its traceback


def test_a_closure_calling_wandb_log_offline(start_daemon: StartDaemon, tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    daemon = start_daemon()
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    got = run_app(daemon.endpoint, "wandb", str(tmp_path), env=env)
    w, expected = np.float32(0.0), []
    for step in range(20):
        expected.append((step, float((w - np.float32(3.0)) ** 2)))
        w = w - np.float32(0.1) * np.float32(2) * (w - np.float32(3.0))
    assert [tuple(s) for s in got["logged"]] == [(s, pytest.approx(v)) for s, v in expected]
    # wandb drops a step that goes backwards; every one arrived, in order.
    assert got["run_step"] == 19
    assert "less than the current step" not in got["stderr"]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_a_slow_closure_does_not_slow_the_loop_and_barrier_wait_waits_for_it(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    got = run_app(daemon.endpoint, "slow", "20", "50")
    handler_s = 20 * 0.050
    assert got["loop_s"] < handler_s / 2, got
    assert got["total_s"] >= handler_s * 0.9, got
    assert got["done"] == [float(i) for i in range(20)]


def test_exit_waits_for_the_processes_own_tap_functions(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    daemon = start_daemon()
    sink = tmp_path / "sink.txt"
    run_app(daemon.endpoint, "exit_drain", str(sink))
    assert sink.read_text().split() == [str(i) for i in range(30)]
    wait_until(lambda: daemon.subscriber_count() == 0, "the receiver to say goodbye")


def test_without_a_daemon_id_tap_of_a_closure_runs_here_and_starts_none(tmp_path: Path) -> None:
    """A closure's taps stay in the process (the local ring): no daemon is asked for,
    none is started, and its failure still reaches barrier_wait."""
    endpoint = tmp_path / "none.sock"
    got = run_app(f"ipc://{endpoint}", "raising", env={"TAPD_CONNECT_TIMEOUT": "0.5"})
    assert got["seen"] == [0.0, 1.0, 3.0]
    assert "deliberate failure at 2" in got["raised"]
    assert "ValueError" in got["cause"]
    assert not endpoint.exists()


# ---- importable functions: a subscriber's if one takes them, else here -----------------


def _calls_in(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith('{"pid"')]


EXPECTED_CALLS = [
    ([], {}, 0.0), ([], {}, 1.0), ([], {}, 2.0), ([], {"what": "loss", "n": 2}, 7.0),
]  # fmt: skip


@pytest.mark.usefixtures("backend")
def test_an_importable_function_no_subscriber_takes_runs_in_the_emitting_process(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    got = run_app(daemon.endpoint, "fallback")
    calls = got["calls"]
    assert {c["pid"] for c in calls} == {got["pid"]}  # this process, as host_callback
    assert [(c["transforms"], c["kwargs"], c["arg"]) for c in calls] == EXPECTED_CALLS
    # id_print, nobody subscribed to tapd.printing: printed here, as host_callback did
    assert "transforms: [('batch', {'batch_dims': (0,)})] what: a * 2\n[0. 2.]\n" in got["stdout"]
    assert "device: cpu:0 what: pair\n( 5. 10. )\n" in got["stdout"]
    assert got["stats"]["unrouted"] == 0 and got["stats"]["delivered"] == 6


def test_a_subscriber_that_takes_the_function_runs_it_instead_and_a_watcher_takes_nothing(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path
) -> None:
    daemon = start_daemon()
    watcher = start_subscriber(daemon, "*")  # like `tapd tail '*'`: a copy of everything
    out = tmp_path / "subscribe.out"
    with open(out, "w") as stdout:
        subscribe = subprocess.Popen(
            [sys.executable, "-m", "tapd", "subscribe", "local_funcs", "--endpoint",
             daemon.endpoint], stdout=stdout, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(APPS)},
        )  # fmt: skip
    try:
        wait_until(lambda: daemon.subscriber_count() == 2, "tapd subscribe to connect")
        got = run_app(daemon.endpoint, "fallback")
    finally:
        subscribe.terminate()
        subscribe.wait(timeout=30)
    assert got["calls"] == []  # not run here: the subscriber took them
    calls = _calls_in(out.read_text())
    assert [(c["transforms"], c["kwargs"], c["arg"]) for c in calls] == EXPECTED_CALLS
    assert {c["pid"] for c in calls} == {subscribe.pid}  # the partial rebuilt there
    assert "what: a * 2\n[0. 2.]" in got["stdout"]  # tapd.printing: nobody took it
    assert len(watcher.records()) == 6  # the watcher saw every tap, and took none


def test_with_the_fallback_off_an_untaken_importable_function_is_unrouted(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon()
    got = run_app(daemon.endpoint, "fallback", env={"TAPD_LOCAL_FALLBACK": "0"})
    assert got["calls"] == []
    assert got["stats"]["unrouted"] == 6
    assert daemon.subscriber_count() == 0  # no receiver was started


# ---- which functions can run elsewhere --------------------------------------------------


def module_level(arg: object, transforms: object, **kwargs: object) -> None:
    pass


class Holder:
    def method(self, arg: object, transforms: object) -> None:
        pass


@pytest.mark.fast
def test_only_functions_another_process_can_import_and_call_the_same_way_leave() -> None:
    name = f"{__name__}:module_level"
    assert importable_form(module_level) == (name, {})
    assert importable_form(functools.partial(module_level, what="x", n=2, s=None)) == (
        name, {"what": "x", "n": 2, "s": None})  # fmt: skip
    assert importable_form(tapd.printing.print_tap) == ("tapd.printing:print_tap", {})

    def closure(arg: object, transforms: object) -> None:
        pass

    local = [
        lambda a, t: None,
        closure,
        Holder().method,  # bound: `module:Holder.method` would lose its object
        functools.partial(module_level, 1),  # positional arguments
        functools.partial(module_level, scale=np.float32(2)),  # not a plain value
        functools.partial(module_level, sink=[]),
        functools.partial(module_level, key_impl="x"),  # a name tapd reserves
        functools.partial(closure, what="x"),
        functools.wraps(module_level)(lambda a, t: None),  # a copy under its name
    ]
    assert [importable_form(f) for f in local] == [None] * len(local)
    in_main = type(module_level)(module_level.__code__, {}, "module_level")
    in_main.__module__ = "__main__"  # the script's module is another module elsewhere
    assert importable_form(in_main) is None


@pytest.mark.fast
def test_partial_keywords_and_device_index_travel_as_metadata_not_as_keywords() -> None:
    from tapd_client.meta import TapMeta
    from tapd_client.tap_functions import tap_function_keywords

    meta = TapMeta("m:f", 0, None, 3, 0, "h", 1, "h:1", (), 0.0,
                   {"what": "x", "tap_with_device": True, "device_index": 1,
                    "key_impl": "fry"})  # fmt: skip
    assert tap_function_keywords(meta) == {"what": "x", "device": 3}
    assert tap_function_keywords(meta, device="cpu:3") == {"what": "x", "device": "cpu:3"}


# ---- the router's fallback rule -------------------------------------------------------


class Peers:
    """Two emitters, "em" (pid 1) and "other" (pid 2), of host "h", at an in-process
    Router (tests/conftest.py); subscribers come as the test says."""

    def __init__(self, make: MakeRouter) -> None:
        self.box = make()
        self.router = self.box.router
        self.sent = self.box.sent
        self.taken = self.box.taken
        for key, pid in (("em", 1), ("other", 2)):
            self.box.emitter(key, pid)

    def subscribe(self, key: str, consumers: list[str], **fields: Any) -> None:
        self.box.subscribe(key, consumers, **fields)

    def tap(self, emitter: str, consumer: str) -> None:
        pid = 1 if emitter == "em" else 2
        fields = {"consumer": consumer, "seq": 0, "step": None, "device": None, "process": 0,
                  "host": "h", "pid": pid, "time": 0, "transforms": [], "meta": {},
                  "tree": ["*"]}  # fmt: skip
        self.router.tap(emitter, decode(encode("tap", fields, [np.zeros(1, np.int8)])))
        self.router.subscribers.pump()


@pytest.mark.fast
def test_a_fallback_gets_its_own_emitters_taps_that_nobody_else_takes(
    in_process_router: MakeRouter,
) -> None:
    peers = Peers(in_process_router)
    peers.subscribe("receiver", ["local/h:1/x/*", "m:f"], fallback=["m:f"], fallback_for="h:1")
    peers.sent.clear()
    peers.tap("em", "m:f")
    peers.tap("other", "m:f")  # another process's: not this fallback's
    peers.tap("em", "local/h:1/x/0/f")
    assert peers.taken() == [("receiver", "m:f"), ("receiver", "local/h:1/x/0/f")]
    assert peers.router.emitters["other"].unrouted == 1

    peers.subscribe("watcher", ["*"])  # `tapd tail '*'`, a forwarder: a copy, no takeover
    peers.sent.clear()
    peers.tap("em", "m:f")
    assert sorted(peers.taken()) == [("receiver", "m:f"), ("watcher", "m:f")]

    peers.subscribe("runner", ["m:*"])  # `tapd subscribe m`: it takes them
    peers.sent.clear()
    peers.tap("em", "m:f")
    peers.tap("em", "local/h:1/x/0/f")  # a local name is the receiver's, whoever else runs
    local = "local/h:1/x/0/f"
    assert sorted(peers.taken()) == [("receiver", local), ("runner", "m:f"),
                                     ("watcher", local), ("watcher", "m:f")]  # fmt: skip

    peers.router.subscribers.drop("runner", "left")
    peers.tap("em", "m:f")
    assert sorted(peers.taken()) == [("receiver", "m:f"), ("watcher", "m:f")]


@pytest.mark.fast
def test_a_subscriber_adds_consumers_without_losing_what_it_holds(
    in_process_router: MakeRouter,
) -> None:
    peers = Peers(in_process_router)
    peers.subscribe("receiver", ["local/h:1/x/*"], fallback_for="h:1")
    peers.tap("em", "local/h:1/x/0/f")  # in flight, not acknowledged
    peers.sent.clear()
    peers.subscribe("receiver", ["local/h:1/x/*", "m:f"], fallback=["m:f"], fallback_for="h:1",
                    update=True)  # fmt: skip
    assert [decode(f).kind for _, f in peers.sent] == ["welcome"]
    assert peers.router.counters["deliveries_lost"] == 0
    peers.sent.clear()
    peers.tap("em", "m:f")
    assert peers.taken() == [("receiver", "m:f")]
    peers.router.subscribers.ack("receiver", {"upto": 1, "errors": []}, now=0.0)
    assert peers.router.emitters["em"].delivered == 2

    peers.subscribe("stranger", ["m:f"], update=True)  # unknown here (a restarted daemon)
    assert [decode(f).kind for key, f in peers.sent if key == "stranger"] == ["rehello"]
    assert "stranger" not in peers.router.subscribers.peers


@pytest.mark.fast
def test_a_subscribers_welcome_comes_before_any_tap_while_it_is_held(
    in_process_router: MakeRouter,
) -> None:
    """The daemon's loop holds a welcome while a wake waits for an emitter's
    acknowledgment (tapd/daemon/wants.py): meanwhile the subscriber, already a taker, is
    sent no tap; once the welcome goes, the taps follow it."""
    peers = Peers(in_process_router)
    subscribers = peers.router.subscribers
    subscribers.hello("held", {"consumers": ["m:f"], "window": 64, "name": "held"}, now=0.0)
    peers.tap("em", "m:f")  # (routed to it, and pumped: nothing goes yet)
    subscribers.send_welcomes(unless=lambda: True)  # (a wake not yet acknowledged)
    subscribers.pump()
    assert [decode(f).kind for key, f in peers.sent if key == "held"] == []
    subscribers.send_welcomes(unless=lambda: False)
    subscribers.pump()
    assert [decode(f).kind for key, f in peers.sent if key == "held"] == ["welcome", "tap"]
