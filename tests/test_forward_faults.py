"""Forwarding under faults (issue 11): upstreams that start late, restart, or lose their
connection; forwarding daemons killed and restarted. Real daemons, emitters and
subscribers; each test counts, step by step, the taps delivered, duplicated and missing,
and checks that whatever is missing is what the emitter was told was lost."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faultproxy import FaultProxy
from tally import Tally, finish, running, start_emitter

from conftest import Daemon, MakeRouter, SubscriberProcess, wait_until
from tapd.protocol.ring_format import EVERY_DORMANT

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def forward_stats(daemon: Daemon) -> dict[str, Any]:
    return dict(daemon.stats()["forward"])


# ---- 1. an upstream without a subscriber yet -------------------------------------------


def test_an_upstream_starting_late_before_its_subscriber_holds_the_backlog_for_it(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path, backend: str
) -> None:
    """The forwarding daemon first, 300 taps, then the upstream, then its subscriber: the
    upstream holds the forwarded backlog for its start-up grace instead of counting it
    as unrouted the moment it arrives."""
    steps = 300
    forwarder = start_daemon("--forward", f"ipc://{runtime_dir}/a.sock", name="b.sock")
    with running(start_emitter(forwarder.endpoint, "steps", str(steps))) as emitter:
        wait_until(lambda: forward_stats(forwarder)["waiting"] == steps, "the taps waiting at B")
        upstream = start_daemon("--startup-grace", "20", name="a.sock")
        # Every tap reached the upstream before its subscriber exists.
        wait_until(lambda: upstream.counters().get("taps_received") == steps, "taps at A")
        far = start_subscriber(upstream, "loss")
        result = finish(emitter)
    assert Tally.of(far.records(), steps) == Tally(steps, 0, 0)
    stats = result["stats"]
    assert (stats["delivered"], stats["unrouted"], stats["daemon_dropped"]) == (steps, 0, 0)
    assert "taps_unrouted" not in upstream.counters()


def site_every(daemon: Daemon, consumer: str) -> int | None:
    """N the daemon wrote into `consumer`'s slot (None: it has not read the site)."""
    for sites in daemon.stats()["wants"].values():
        for _, name, every in sites:
            if name == consumer:
                return int(every)
    return None


def said(emitter: subprocess.Popen[str]) -> dict[str, Any]:
    """The next line a steps_when_told emitter says (tests/apps/emitter_app.py)."""
    assert emitter.stdout is not None and emitter.stderr is not None
    line = emitter.stdout.readline()
    if not line.startswith("{"):
        emitter.kill()
        pytest.fail(f"the emitter said {line!r} (exit {emitter.wait()}): {emitter.stderr.read()}")
    return dict(json.loads(line))


def stopped(daemon: Daemon) -> bool:
    """The daemon's process is stopped (SIGSTOP): proc(5)'s state T."""
    stat = Path(f"/proc/{daemon.process.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def told_emitter(daemon: Daemon, lower_first: str) -> subprocess.Popen[str]:
    """An emitter of 40 taps of "loss" that runs them when told (steps_when_told)."""
    return start_emitter(
        daemon.endpoint, "steps_when_told", "40", lower_first, stdin=subprocess.PIPE
    )


def tell(emitter: subprocess.Popen[str]) -> None:
    assert emitter.stdin is not None
    emitter.stdin.write("go\n")
    emitter.stdin.flush()


def upstream_with_other(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, upstream_says: str
) -> tuple[Daemon, Daemon, SubscriberProcess]:
    """An upstream with a subscriber of "other" only (no grace; a long subscriber
    timeout, so that a stopped forwarder stays its subscriber), and a forwarder to it
    that has the upstream's wants."""
    flags = ["--no-dormant"] if upstream_says == "everything" else []
    upstream = start_daemon(*flags, "--subscriber-timeout", "600", name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    other = start_subscriber(upstream, "other")
    wants = "everything" if upstream_says == "everything" else [["other", 1]]
    wait_until(lambda: forward_stats(forwarder)["upstream_wants"] == wants, "the upstream's wants")
    return upstream, forwarder, other


@pytest.mark.parametrize("upstream_says", ["what it wants", "everything"])
def test_taps_the_upstream_had_no_subscriber_for_are_unrouted_for_the_emitter(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str, upstream_says: str
) -> None:
    """Delivered means an upstream subscriber handled it: taps nobody upstream wanted
    reach the emitter's counts as unrouted, not as delivered. An upstream that says what
    its takers want ("other") is sent none of them: the forwarder counts them unrouted
    itself. One that says "everything" (dormancy off) is sent them and counts them.

    These are the first taps of their site, run before the forwarder has read its entry
    (the forwarder is stopped while they run): no daemon has written the site's slot, which
    then says "send every tap" (EVERY_ALL), so the emitter sends all 40 and skips none.
    (Taps run after the forwarder made the site dormant are skipped: the next test.)"""
    upstream, forwarder, other = upstream_with_other(start_daemon, start_subscriber, upstream_says)
    with running(told_emitter(forwarder, "first")) as emitter:
        assert said(emitter) == {"ready": "first"}
        # The forwarder has met the emitter's ring and read its sites so far: not "loss",
        # which is registered only when the emitter is told to run it.
        wait_until(lambda: site_every(forwarder, "first") is not None, "the ring at B")
        forwarder.process.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: stopped(forwarder), "B stopped")
            tell(emitter)
            assert said(emitter) == {"ran": 40}
        finally:
            forwarder.process.send_signal(signal.SIGCONT)
        if upstream_says != "everything":  # reading the taps, B reads the site: it sleeps
            wait_until(lambda: site_every(forwarder, "loss") == EVERY_DORMANT, "loss dormant")
        tell(emitter)
        stats = finish(emitter)["stats"]
    assert other.records() == []
    assert stats["skipped"] == 0, stats
    counters = forwarder.counters()
    assert "forward_upstream_delivered" not in counters
    assert (stats["delivered"], stats["unrouted"], stats["daemon_dropped"]) == (0, 40, 0), stats
    if upstream_says == "everything":
        assert upstream.counters()["taps_unrouted"] == 40
        assert counters["forward_upstream_unrouted"] == 40
    else:
        assert "taps_received" not in upstream.counters()
        assert counters["taps_unrouted"] == 40
        assert counters.get("forward_sent", 0) == 0


def test_taps_of_a_site_the_forwarder_made_dormant_are_skipped_not_unrouted(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    """The other outcome: the forwarder has read the site's entry before its first tap,
    and with the upstream wanting only "other" it has made the site dormant. The emitter
    then copies none of its 40 taps: all skipped (not dropped, not unrouted), and
    nothing reaches either daemon."""
    upstream, forwarder, other = upstream_with_other(start_daemon, start_subscriber, "")
    with running(told_emitter(forwarder, "loss")) as emitter:
        assert said(emitter) == {"ready": "loss"}
        wait_until(lambda: site_every(forwarder, "loss") == EVERY_DORMANT, "loss dormant at B")
        tell(emitter)
        assert said(emitter) == {"ran": 40}
        tell(emitter)
        stats = finish(emitter)["stats"]
    assert other.records() == []
    assert (stats["skipped"], stats["unrouted"], stats["delivered"]) == (40, 0, 0), stats
    assert stats["daemon_dropped"] == 0 and stats["skipped_by_consumer"] == {"loss": 40}, stats
    counters = forwarder.counters()
    assert "taps_unrouted" not in counters and counters.get("forward_sent", 0) == 0, counters
    assert counters["taps_skipped"] == 40, counters
    assert "taps_received" not in upstream.counters()


def test_a_site_traced_after_the_daemon_met_its_ring_is_dormant_before_its_first_tap(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    """The daemon reads an emitter's sites file when it meets the ring, and then as the
    file grows (each periodic check), not only when a record names a site it has not
    read: a site traced later, that no subscriber takes, is dormant before its first tap,
    whose taps are then all skipped (the race the test above waits out)."""
    daemon = start_daemon()
    start_subscriber(daemon, "other")
    emitter = start_emitter(daemon.endpoint, "lower_when_told", "40", stdin=subprocess.PIPE)
    with running(emitter):
        assert said(emitter) == {"ready": "first"}
        wait_until(lambda: site_every(daemon, "first") == EVERY_DORMANT, "the ring met")
        tell(emitter)
        assert said(emitter) == {"lowered": "loss"}
        wait_until(lambda: site_every(daemon, "loss") == EVERY_DORMANT, "loss read, dormant")
        tell(emitter)
        assert said(emitter) == {"ran": 40}
        tell(emitter)
        stats = finish(emitter)["stats"]
    assert (stats["skipped"], stats["unrouted"], stats["delivered"]) == (40, 0, 0), stats
    assert daemon.counters()["taps_skipped"] == 40


# ---- 2 and 3. connections that drop, on both sides or on one -------------------------


@pytest.fixture
def tcp_pair(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> Iterator[tuple[Daemon, Daemon, FaultProxy, SubscriberProcess]]:
    """An upstream on tcp with a subscriber of "loss", and a forwarding daemon that
    reaches it through a FaultProxy."""
    upstream = start_daemon("--tcp", "tcp://127.0.0.1:0", "--insecure", name="a.sock")
    host, port = upstream.endpoints[1].removeprefix("tcp://").rsplit(":", 1)
    proxy = FaultProxy((host, int(port)))
    try:
        forwarder = start_daemon("--forward", proxy.endpoint, "--insecure", name="b.sock")
        far = start_subscriber(upstream, "loss")
        yield upstream, forwarder, proxy, far
    finally:
        proxy.close()


def of_emitter(records: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    return [r for r in records if r["emitter"].endswith(f":{pid}")]


def test_taps_lost_with_a_dropped_connection_are_sent_again_not_reported_as_errors(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess],
) -> None:
    _, forwarder, proxy, far = tcp_pair
    steps = 300
    with running(start_emitter(forwarder.endpoint, "paced", str(steps), "5")) as emitter:
        wait_until(lambda: len(far.records()) >= 50, "taps through the proxy")
        proxy.pause()
        sent = forwarder.counters()["forward_sent"]
        wait_until(lambda: forwarder.counters()["forward_sent"] >= sent + 20, "taps in transit")
        proxy.cut()  # what was in transit is gone; the forwarder reconnects
        proxy.resume()
        result = finish(emitter)
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    assert result["stats"]["delivered"] == steps and result["stats"]["errors"] == 0
    counters = forwarder.counters()
    assert counters["forward_resent"] >= 20 and "forward_lost" not in counters
    assert proxy.connections >= 2


@pytest.mark.waits
@pytest.mark.parametrize("side", ["client", "upstream"])
def test_a_connection_reset_on_one_side_only_while_idle_heals(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess], side: str
) -> None:
    """One side of the forwarder's connection is reset and the other never hears of it:
    the upstream (side "client") or the forwarder (side "upstream") still holds the dead
    connection. TCP's keepalive (side "client") or the forwarder's own link (side
    "upstream": a proxy holds the dead connection's other half, so TCP sees nothing
    wrong; no word from the upstream for RECONNECT_AFTER s) finds it dead, and a new
    connection takes over."""
    _, forwarder, proxy, far = tcp_pair
    first = start_emitter(forwarder.endpoint, "steps", "20")
    finish(first)
    proxy.cut_one_side(side)  # type: ignore[arg-type]
    second = start_emitter(forwarder.endpoint, "steps", "200")
    result = finish(second, timeout=40)
    tally = Tally.of(of_emitter(far.records(), second.pid), 200)
    assert (tally.delivered, tally.missing) == (200, 0), tally
    assert result["stats"]["delivered"] == 200


def test_a_connection_reset_on_the_forwarders_side_mid_stream_loses_nothing(
    tcp_pair: tuple[Daemon, Daemon, FaultProxy, SubscriberProcess],
) -> None:
    _, forwarder, proxy, far = tcp_pair
    steps = 300
    with running(start_emitter(forwarder.endpoint, "paced", str(steps), "5")) as emitter:
        wait_until(lambda: len(far.records()) >= 50, "taps through the proxy")
        proxy.cut_one_side("client")
        result = finish(emitter, timeout=60)
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    assert result["stats"]["delivered"] == steps and result["stats"]["errors"] == 0


# ---- daemons killed and restarted -------------------------------------------------------


@pytest.mark.waits
@pytest.mark.parametrize("sleep_ms", [0, 20], ids=["fast", "slow"])
def test_an_upstream_killed_and_restarted_loses_nothing(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, sleep_ms: int
) -> None:
    """kill -9 of the upstream mid-stream, a new one on the same endpoint: its subscriber
    reconnects by itself, the forwarder sends again what the dead one had not confirmed,
    and the new one holds those for its subscriber (start-up grace)."""
    steps = 400
    upstream = start_daemon(name="a.sock")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    far = start_subscriber(upstream, "loss", sleep_ms=sleep_ms)
    with running(start_emitter(forwarder.endpoint, "paced", str(steps), "5")) as emitter:
        wait_until(lambda: len(far.records()) >= 100, "taps at the first upstream")
        upstream.process.kill()
        upstream.process.wait(timeout=30)
        again = start_daemon("--startup-grace", "10", name="a.sock")
        wait_until(lambda: again.subscriber_count() == 1, "the subscriber back", timeout=30)
        result = finish(emitter)
    tally = Tally.of(far.records(), steps)
    assert (tally.delivered, tally.missing) == (steps, 0), tally
    stats = result["stats"]
    assert (stats["delivered"], stats["daemon_dropped"], stats["unrouted"]) == (steps, 0, 0)
    assert "deliveries_lost" not in again.counters()
    assert forwarder.counters()["forward_resent"] > 0


def test_a_forwarding_daemon_killed_and_restarted_loses_only_what_its_emitter_counts(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    """kill -9 of the forwarding daemon mid-stream, a new one on the same endpoint. On the
    native backend its emitter's ring keeps every tap until it is delivered: nothing is
    missing. A portable emitter's taps that the dead daemon held are lost, and counted:
    the emitter's `delivered` falls short by at least as many."""
    steps = 400
    upstream = start_daemon(name="a.sock")
    far = start_subscriber(upstream, "loss")
    forwarder = start_daemon("--forward", upstream.endpoint, name="b.sock")
    with running(start_emitter(forwarder.endpoint, "paced", str(steps), "5")) as emitter:
        wait_until(lambda: len(far.records()) >= 100, "taps at the upstream")
        forwarder.process.kill()
        forwarder.process.wait(timeout=30)
        again = start_daemon("--forward", upstream.endpoint, name="b.sock")
        result = finish(emitter)
    tally = Tally.of(far.records(), steps)
    stats = result["stats"]
    counted = stats["submitted"] - stats["delivered"] - stats["unrouted"] - stats["dropped"]
    assert stats["daemon_dropped"] == 0
    if backend == "native":
        assert (tally.delivered, tally.missing) == (steps, 0), tally
    else:
        assert tally.missing <= counted, (tally, stats)
    assert again.counters()["forward_confirmed"] > 0


# ---- 4. smaller faults ------------------------------------------------------------------


@pytest.mark.waits
def test_the_upstream_forgets_a_forwarding_daemon_that_died(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    """A forwarding daemon killed with -9 says no bye; its emitter entry upstream goes
    once it has been silent for 3 subscriber timeouts (a live one keeps it with
    heartbeats, however idle)."""
    upstream = start_daemon("--subscriber-timeout", "1", name="a.sock")
    start_subscriber(upstream, "loss")
    doomed = start_daemon("--forward", upstream.endpoint, name="b.sock")
    idle = start_daemon("--forward", upstream.endpoint, name="c.sock")
    finish(start_emitter(doomed.endpoint, "steps", "5"))

    def forwarders() -> dict[str, int]:
        return {e["name"]: e["taps"] for e in upstream.stats()["emitters"]
                if e["name"].startswith("forwarding daemon")}  # fmt: skip

    known = wait_until(lambda: len(forwarders()) == 2 and forwarders(), "both forwarders")
    [idle_name] = [name for name, taps in known.items() if taps == 0]
    doomed.process.kill()
    doomed.process.wait(timeout=30)
    wait_until(lambda: len(forwarders()) == 1, "the dead forwarder forgotten", timeout=30)
    assert list(forwarders()) == [idle_name]  # the idle one stays, heard from
    assert forward_stats(idle)["upstream"] is not None


def test_the_outage_warning_counts_the_taps_sent_and_not_confirmed(
    start_daemon: StartDaemon,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    in_process_router: MakeRouter,
) -> None:
    """In-process forwarder, an upstream that welcomes it and then falls silent: the
    warning counts what waits unsent and what was sent but not confirmed."""
    import zmq

    from tapd.config import Config
    from tapd.daemon.forward import Forwarder
    from tapd.protocol import decode, encode

    context = zmq.Context()
    upstream = context.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/up.sock"
    upstream.bind(endpoint)
    router = in_process_router(daemon_id="here").router
    forwarder = Forwarder(context, Config(forward=endpoint), router, "here")
    try:
        assert upstream.poll(5000)
        peer, *frames = upstream.recv_multipart()
        assert decode(frames).kind == "hello"
        upstream.send_multipart([peer, *encode("welcome", {"window_bytes": 1 << 20,
                                                           "daemon": "up"})])  # fmt: skip
        assert forwarder.socket.poll(5000)
        now = time.monotonic()
        forwarder.receive(now)
        router.emitter_hello("em", {"host": "h", "pid": 1, "process": 0})
        fields = {"consumer": "x", "seq": 0, "step": None, "device": None, "process": 0,
                  "host": "h", "pid": 1, "time": 0, "transforms": [], "meta": {},
                  "tree": ["*"]}  # fmt: skip
        for seq in range(5):
            router.tap("em", decode(encode("tap", {**fields, "seq": seq}, [np.zeros(2)])))
        router.subscribers.pump()
        forwarder.flush(now)  # all five sent, none confirmed: the upstream says nothing
        assert forwarder.stats()["unconfirmed"] == 5
        with caplog.at_level("WARNING", logger="tapd.daemon"):
            forwarder.flush(now + 11)
        assert "5 taps sent to it and not confirmed, 0 more wait here" in caplog.text
    finally:
        forwarder.close()
        upstream.close(linger=0)
        context.term()


@pytest.mark.waits
def test_a_barrier_timeout_names_the_upstream_when_it_is_the_one_missing(
    start_daemon: StartDaemon, runtime_dir: Path
) -> None:
    nobody = f"ipc://{runtime_dir}/nobody.sock"
    forwarder = start_daemon("--forward", nobody, name="b.sock")
    emitter = start_emitter(forwarder.endpoint, "steps", "3", "no_barrier",
                            env={"TAPD_EXIT_TIMEOUT": "1"})  # fmt: skip
    _, err = emitter.communicate(timeout=90)  # its exit drain's barrier times out
    assert "barrier_wait timed out" in err
    assert f"the upstream daemon at {nobody}" in err and "never answered" in err


def test_a_subscriber_saying_hello_again_gets_its_taps_again_instead_of_losing_them(
    start_daemon: StartDaemon, raw_peer: Callable[[str], Any]
) -> None:
    """A subscriber whose daemon restarted may answer several rehellos (they answer
    messages it sent before its hello): a repeated hello must not cost it the taps it
    had in flight. They come again, with the same seq."""
    from tapd.protocol import decode, encode

    daemon = start_daemon()

    def receive(sock: Any) -> Any:
        assert sock.poll(10_000), "nothing within 10 s"
        return decode(sock.recv_multipart())

    hello = {"role": "subscriber", "consumers": ["x"], "window": 8, "name": "raw"}
    subscriber = raw_peer(daemon.endpoint)
    subscriber.send_multipart(encode("hello", hello))
    assert receive(subscriber).kind == "welcome"
    emitter = raw_peer(daemon.endpoint)
    emitter.send_multipart(encode("hello", {"role": "emitter", "host": "h", "pid": 1}))
    assert receive(emitter).kind == "welcome"
    fields = {"consumer": "x", "seq": 0, "step": None, "device": None, "process": 0,
              "host": "h", "pid": 1, "time": 0, "transforms": [], "meta": {},
              "tree": ["*"]}  # fmt: skip
    emitter.send_multipart(encode("tap", fields, [np.zeros(2)]))
    emitter.send_multipart(encode("barrier", {"id": 0}))
    first = receive(subscriber)
    assert first.kind == "tap"
    subscriber.send_multipart(encode("hello", hello))  # again, the tap unacknowledged
    assert receive(subscriber).kind == "welcome"
    again = receive(subscriber)
    assert (again.kind, again.header["seq"]) == ("tap", 0)
    subscriber.send_multipart(encode("ack", {"upto": again.header["tid"], "errors": []}))
    while (done := receive(emitter)).kind != "barrier_done":
        pass
    assert (done.header["delivered"], done.header["dropped"]) == (1, 0)
    assert daemon.counters().get("deliveries_lost", 0) == 0
