"""`tapd start --forward`: a daemon that sends every tap on to an upstream daemon, so a
job's subscribers connect to one place. Real daemons A (upstream) and B (forwarding),
real emitters on B, subscribers on A only (and on B, for comparison)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq

from conftest import APPS, Daemon, SubscriberProcess, keygen, run_emitter, tapd_cmd, wait_until
from tapd import config as config_module
from tapd.cli.exit_codes import ExitCode
from tapd.errors import ConfigError
from tapd.protocol import Message, decode, encode

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

# What a subscriber sees of a tap; a forwarded one must look exactly like a local one.
SEEN = ("consumer", "seq", "step", "device", "process", "emitter", "transforms", "meta", "value")


def seen(records: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [tuple(str(r[k]) for k in SEEN) for r in records]


def forward_stats(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.stats()["forward"])


def test_taps_through_a_forwarder_reach_the_upstream_as_if_local_and_the_barrier_waits(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    upstream = start_daemon(name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    far = start_subscriber(upstream, "loss", sleep_ms=20)  # slow: the barrier must wait
    near = start_subscriber(forwarder, "loss")  # local subscribers of B still work
    result = run_emitter(forwarder.endpoint, "steps", "20")

    # run_emitter returned after barrier_wait(): the upstream's slow handler is done.
    far_records, near_records = far.records(), near.records()
    assert [r["step"] for r in far_records] == list(range(20))
    assert seen(far_records) == seen(near_records)  # same emitter, seq, step, values...
    assert far_records[0]["emitter"] != f"{socket.gethostname()}:{forwarder.process.pid}"
    assert result["loop_s"] + result["barrier_s"] >= 20 * 0.020 * 0.9, result
    assert result["stats"]["delivered"] == 20 and result["stats"]["unrouted"] == 0

    counters = forwarder.counters()
    assert counters["forward_sent"] == counters["forward_confirmed"] == 20
    assert counters["forward_upstream_delivered"] == 20
    stats = forward_stats(forwarder)
    assert (stats["waiting"], stats["unconfirmed"]) == (0, 0)
    assert stats["upstream"] is not None
    assert upstream.counters()["deliveries_acked"] == 20


def test_a_handler_error_upstream_surfaces_in_barrier_wait_on_the_forwarding_host(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    upstream = start_daemon(name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    far = start_subscriber(upstream, "bad", "good", raise_on="bad")
    result = run_emitter(forwarder.endpoint, "raising")
    assert result["raised"] is not None, "barrier_wait did not raise TapFunctionException"
    # The far subscriber's traceback ends the "Last one was:" part, as host_callback's.
    assert re.search(
        "There were exceptions during callback processing. Last one was:.*"
        r'subscriber_app\.py", line \d+, in handle\n.*'
        "ValueError: deliberate failure at seq 0\n\n",
        result["raised"],
        re.DOTALL,
    ), result["raised"]
    [error] = result["errors"]  # one line, naming where it ran
    assert re.fullmatch(
        r"bad#0: main\.<locals>\.handle raised ValueError\('deliberate failure at seq 0'\) "
        rf"\(in subscriber .+ at {re.escape(upstream.endpoint)}\)",
        error,
    ), error
    assert [r["consumer"] for r in far.records()] == ["good"]


def test_a_forwarded_header_keeps_every_field_and_the_barrier_waits_for_the_upstream(
    start_daemon: StartDaemon,
) -> None:
    """At the protocol level, with raw sockets: a tap with a field this version does not
    know, from an emitter that is not even on this host."""
    upstream = start_daemon(name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    context = zmq.Context()

    def peer(endpoint: str, hello: dict[str, Any]) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart(encode("hello", hello))
        assert receive(sock).kind == "welcome"
        return sock

    def receive(sock: zmq.Socket[bytes]) -> Message:
        assert sock.poll(10_000), "no answer within 10 s"
        return decode(sock.recv_multipart())

    try:
        subscriber = peer(upstream.endpoint, {"role": "subscriber", "consumers": ["x"],
                                              "window": 8, "name": "raw"})  # fmt: skip
        # B sends upstream only what A's subscribers want: a tap B gets before A's word
        # that "x" is wanted is unrouted (A told B its wants when B connected, maybe first).
        wait_until(lambda: forward_stats(forwarder)["upstream_wants"] == [["x", 1]], "A's wants")
        emitter = peer(forwarder.endpoint, {"role": "emitter", "host": "elsewhere",
                                            "pid": 4242, "process": 3})  # fmt: skip
        fields = {"consumer": "x", "seq": 7, "step": 2, "device": 1, "process": 3,
                  "host": "elsewhere", "pid": 4242, "time": 123, "transforms": [],
                  "meta": {"note": "hi"}, "tree": ["*"], "future": {"axes": ["i"]}}  # fmt: skip
        emitter.send_multipart(encode("tap", fields, [np.arange(3.0)]))
        emitter.send_multipart(encode("barrier", {"id": 0}))
        tap = receive(subscriber)
        assert {k: tap.header[k] for k in fields} == fields  # every field, "future" too
        assert tap.header["emitter"] == "elsewhere:4242"
        assert tap.arrays()[0].tolist() == [0.0, 1.0, 2.0]
        wait_until(lambda: forward_stats(forwarder)["unconfirmed"] == 1, "B waiting for A")
        so_far = []  # B's credit for the tap, but no barrier_done: A has not finished it
        while emitter.poll(0):
            so_far.append(receive(emitter).kind)
        assert "barrier_done" not in so_far
        subscriber.send_multipart(encode("ack", {"upto": tap.header["tid"], "errors": []}))
        while (done := receive(emitter)).kind != "barrier_done":
            pass
        assert (done.header["id"], done.header["delivered"]) == (0, 1)
    finally:
        context.destroy(linger=0)


def test_upstream_started_after_the_forwarder_gets_the_buffered_taps(
    start_daemon: StartDaemon,
    start_subscriber: StartSubscriber,
    runtime_dir: Path,
    backend: str,
) -> None:
    # B forwards to a.sock, where nothing listens yet.
    forwarder = start_daemon("--forward", f"ipc://{runtime_dir}/a.sock", name="b.sock")
    emitter = subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), "steps", "15"],
        env={**os.environ, "TAPD_ENDPOINT": forwarder.endpoint},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: forward_stats(forwarder)["waiting"] == 15, "15 taps waiting at B")
        assert forward_stats(forwarder)["upstream"] is None
        assert emitter.poll() is None, "barrier_wait returned before the upstream existed"
        # The upstream appears with its subscriber already there: it listens on another
        # name, and a.sock becomes a link to it once the subscriber is connected.
        upstream = start_daemon(name="real-a.sock")
        far = start_subscriber(upstream, "loss")
        os.symlink(runtime_dir / "real-a.sock", runtime_dir / "a.sock")
        _, err = emitter.communicate(timeout=60)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    assert emitter.returncode == 0, err  # its barrier passed once the upstream had them
    assert [r["step"] for r in far.records()] == list(range(15))
    assert forwarder.counters()["forward_confirmed"] == 15


def test_a_slow_upstream_backpressures_through_the_forwarder_losing_nothing(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    # Tiny bounds everywhere: the upstream's slow subscriber holds back its credit, the
    # forwarder's queue fills, its emitters stop getting credit, and the emitter blocks.
    small = ("--policy", "block", "--queue-bytes", "40000", "--emitter-window-bytes", "40000")
    upstream = start_daemon(*small, name="a.sock")
    forwarder = start_daemon(*small, "--forward", upstream.endpoint, name="b.sock")
    far = start_subscriber(upstream, "big", sleep_ms=10, window=2)
    result = run_emitter(forwarder.endpoint, "many_bytes", "60", "16",
                         env={"TAPD_BUFFER_BYTES": "40000"})  # fmt: skip
    assert result["stats"]["dropped"] == 0
    assert [r["step"] for r in far.records()] == list(range(60))
    counters = forwarder.counters()
    assert counters["forward_confirmed"] == 60
    assert "deliveries_dropped" not in counters and "deliveries_lost" not in counters


def test_drops_and_losses_at_the_forwarder_are_counted(
    start_daemon: StartDaemon, runtime_dir: Path
) -> None:
    # No upstream at all, drop_newest and room for two 4-byte taps: eight are dropped
    # (and counted), two wait for the upstream, and are counted lost at shutdown.
    forwarder = start_daemon("--policy", "drop_newest", "--queue-bytes", "8", "--forward",
                             f"ipc://{runtime_dir}/nobody.sock", "--drain-timeout", "0.5",
                             name="b.sock")  # fmt: skip
    result = run_emitter(forwarder.endpoint, "steps", "10", "no_barrier",
                         env={"TAPD_EXIT_TIMEOUT": "0.5"})  # fmt: skip
    assert "barrier_wait timed out" in result["stderr"]
    wait_until(lambda: forwarder.counters().get("taps_received") == 10, "10 taps at B")
    stats = forwarder.stats()
    assert stats["counters"]["deliveries_dropped"] == 8
    [queue] = [s for s in stats["subscribers"] if s["name"].startswith("forward to")]
    assert (queue["dropped"], queue["queued"] + queue["in_flight"]) == (8, 2)
    assert (stats["forward"]["waiting"], stats["forward"]["upstream"]) == (2, None)
    assert forwarder.stop() == 0
    assert "2 taps for the upstream daemon" in forwarder.log()
    assert "'deliveries_lost': 2" in forwarder.log()


def test_an_upstream_restart_gets_the_unconfirmed_taps_again(
    start_daemon: StartDaemon,
    start_subscriber: StartSubscriber,
    runtime_dir: Path,
) -> None:
    link = runtime_dir / "a.sock"  # B forwards here; it points at the upstream of the day

    def upstream_at(name: str) -> tuple[Daemon, SubscriberProcess]:
        daemon = start_daemon(name=name)
        subscriber = start_subscriber(daemon, "loss", sleep_ms=20)
        (runtime_dir / "next").symlink_to(runtime_dir / name)
        os.replace(runtime_dir / "next", link)
        return daemon, subscriber

    first, first_subscriber = upstream_at("a1.sock")
    forwarder = start_daemon("--forward", f"ipc://{link}", name="b.sock")
    emitter = subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), "paced", "40", "25"],
        env={**os.environ, "TAPD_ENDPOINT": forwarder.endpoint},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: len(first_subscriber.records()) >= 5, "taps at the first upstream")
        first.process.kill()  # no drain: what it held unconfirmed is gone with it
        first.process.wait(timeout=30)
        _, second_subscriber = upstream_at("a2.sock")
        _, err = emitter.communicate(timeout=60)
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()
    assert emitter.returncode == 0, err  # its barrier passed at the second upstream
    records = first_subscriber.records() + second_subscriber.records()
    assert {r["step"] for r in records} == set(range(40))  # every tap arrived
    assert all(r["seq"] == r["step"] for r in records)  # a tap sent again keeps its seq
    # What was in transit during the restart may come before what is sent again, but
    # the resending replays in order: by their last arrival, the taps are in order.
    last = {r["step"]: i for i, r in enumerate(second_subscriber.records())}
    assert sorted(last, key=last.__getitem__) == sorted(last)
    assert forwarder.counters()["forward_confirmed"] == 40
    assert "upstream daemon at ipc://" in forwarder.log() and "restarted" in forwarder.log()


def test_forwarding_over_curve_tcp_admits_known_keys_only(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path
) -> None:
    upstream_public, upstream_secret = keygen(tmp_path / "upstream", "upstream")
    forwarder_public, forwarder_secret = keygen(tmp_path / "forwarder", "forwarder")
    _, stranger_secret = keygen(tmp_path / "stranger", "stranger")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    shutil.copy(forwarder_public, allowed / "forwarder.key")
    upstream = start_daemon("--tcp", "tcp://127.0.0.1:0", "--curve-secret-key",
                            str(upstream_secret), "--curve-allowed", str(allowed),
                            name="a.sock")  # fmt: skip
    remote = upstream.endpoints[1]
    far = start_subscriber(upstream, "loss")
    forwarder = start_daemon("--forward", remote, "--forward-server-key", str(upstream_public),
                             "--curve-secret-key", str(forwarder_secret),
                             name="b.sock")  # fmt: skip
    stranger = start_daemon("--forward", remote, "--forward-server-key", str(upstream_public),
                            "--curve-secret-key", str(stranger_secret),
                            name="c.sock")  # fmt: skip
    wait_until(lambda: upstream.counters().get("auth_refused", 0) >= 1, "the stranger refused")
    result = run_emitter(forwarder.endpoint, "steps", "5")
    assert [r["step"] for r in far.records()] == list(range(5))
    assert result["stats"]["delivered"] == 5
    assert forward_stats(stranger)["upstream"] is None  # never welcomed
    assert "not in the allowed keys" in upstream.log()


def test_a_daemon_forwarding_to_itself_says_so_and_stops_forwarding(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # Two names for one address: the configuration cannot see the loop, the welcome can.
    daemon = start_daemon("--tcp", f"tcp://127.0.0.1:{port}", "--insecure",
                          "--forward", f"tcp://localhost:{port}")  # fmt: skip
    wait_until(lambda: "leads back to this daemon" in daemon.log(), "the loop to be noticed")
    local = start_subscriber(daemon, "loss")
    run_emitter(daemon.endpoint, "steps", "3")
    assert [r["step"] for r in local.records()] == [0, 1, 2]
    assert daemon.counters()["taps_received"] == 3  # none came round again


def test_forward_settings_are_checked_and_layered(tmp_path: Path) -> None:
    for endpoint in ("foo", "tcp://nohost", "tcp://host:99999", "ipc://"):
        result = tapd_cmd("start", "--endpoint", f"ipc://{tmp_path}/x.sock",
                          "--forward", endpoint)  # fmt: skip
        assert result.returncode == ExitCode.CONFIG, result.stderr
        assert f"--forward {endpoint!r}" in result.stderr
    no_key = tapd_cmd("start", "--endpoint", f"ipc://{tmp_path}/x.sock", "--forward",
                      "tcp://127.0.0.1:5555", "--forward-server-key", str(tmp_path / "none.key"),
                      "--curve-secret-key", str(tmp_path / "none.key_secret"))  # fmt: skip
    assert no_key.returncode == ExitCode.CONFIG and "none.key" in no_key.stderr
    with pytest.raises(ConfigError, match=r"needs CurveZMQ.*--forward-server-key"):
        config_module.Config(forward="tcp://upstream:5555")
    with pytest.raises(ConfigError, match="own endpoint"):
        config_module.Config(endpoint="ipc:///tmp/x.sock", forward="ipc:///tmp/x.sock")
    insecure = config_module.Config(forward="tcp://upstream:5555", insecure=True)
    assert insecure.forward == "tcp://upstream:5555"

    toml = tmp_path / "tapd.toml"
    toml.write_text('[daemon]\nforward = "ipc:///tmp/from-toml.sock"\n')
    env = {"TAPD_FORWARD": "ipc:///tmp/from-env.sock", "TAPD_FORWARD_SERVER_KEY": "/k.key"}
    assert config_module.load({}, toml, environ={}).forward == "ipc:///tmp/from-toml.sock"
    layered = config_module.load({}, toml, environ=env)
    assert (layered.forward, layered.forward_server_key) == (env["TAPD_FORWARD"], Path("/k.key"))
    flagged = config_module.load({"forward": "ipc:///tmp/flag.sock"}, toml, environ=env)
    assert flagged.forward == "ipc:///tmp/flag.sock"

    help_text = tapd_cmd("start", "--help").stdout
    assert "--forward ENDPOINT" in help_text and "--forward-server-key" in help_text


def test_a_tap_the_upstream_never_finished_is_reported_lost_not_confirmed(
    start_daemon: StartDaemon,
) -> None:
    """The upstream refuses the tap (too large for it): its barriers still answer, without
    the tap among what they finished. Sent again, refused again; after the last try it
    counts as dropped for the emitter, a loss and not a handler error."""
    # (--no-dormant: the upstream, which has no subscriber, says it wants everything;
    # else the forwarder would keep the tap, unrouted, once told that nobody wants it)
    upstream = start_daemon("--max-message-bytes", "16", "--no-dormant", name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    context = zmq.Context()
    emitter = context.socket(zmq.DEALER)
    try:
        emitter.connect(forwarder.endpoint)
        emitter.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1,
                                                "process": 0}))  # fmt: skip
        fields = {"consumer": "x", "seq": 0, "step": None, "device": None, "process": 0,
                  "host": "h", "pid": 1, "time": 0, "transforms": [], "meta": {},
                  "tree": ["*"]}  # fmt: skip
        emitter.send_multipart(encode("tap", fields, [np.arange(3.0)]))  # 24 bytes > 16
        emitter.send_multipart(encode("barrier", {"id": 0}))
        kinds = {}
        while "barrier_done" not in kinds:
            assert emitter.poll(10_000), f"no barrier_done within 10 s; got {list(kinds)}"
            message = decode(emitter.recv_multipart())
            kinds[message.kind] = message.header
        done = kinds["barrier_done"]
        assert (done["delivered"], done["dropped"], done["unrouted"]) == (0, 1, 0)
        assert "error" not in kinds
        assert forwarder.counters()["forward_lost"] == 1
        assert upstream.counters()["rejected_too_large"] == 3  # sent three times
        assert "never received (after 3 sends)" in forwarder.log()
    finally:
        emitter.close(linger=0)
        context.term()


def test_a_forwarder_refuses_an_ipc_upstream_in_a_directory_others_can_enter(
    tmp_path: Path,
) -> None:
    """Issue 10, item 4: every client checks the runtime directory before it connects,
    the forwarding daemon too (another user's fake upstream would get every tap)."""
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    squatted = tmp_path / "squatted"
    squatted.mkdir()
    squatted.chmod(0o777)
    upstream = f"ipc://{squatted}/up.sock"
    result = tapd_cmd("start", "--endpoint", f"ipc://{mine}/d.sock", "--pidfile",
                      str(mine / "pid"), "--forward", upstream, timeout=60)  # fmt: skip
    assert result.returncode == ExitCode.CONFIG, result.stderr
    assert str(squatted) in result.stderr and "mode" in result.stderr
