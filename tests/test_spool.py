"""The `spool` policy (issue 11): a subscriber whose queue is full gets its taps through an
on-disk log, in order, without slowing the emitters; the log is bounded, survives a
daemon restart, and a full log or a full disk falls back to a named policy, counted."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from tally import Tally, finish, start_emitter

from conftest import Daemon, InProcessRouter, MakeRouter, SubscriberProcess, wait_until
from tapd.daemon.spool import Spool, SpoolFull, find_spools
from tapd.protocol import Message, decode, encode

FIELDS = {"consumer": "x", "step": None, "device": None, "process": 0, "host": "h",
          "pid": 1, "time": 0, "transforms": [], "meta": {}, "tree": ["*"]}  # fmt: skip


def tap(seq: int, size: int = 4) -> Message:
    return decode(encode("tap", {**FIELDS, "seq": seq}, [np.full(size, seq, np.uint8)]))


# ---- the log on its own --------------------------------------------------------------


@pytest.mark.fast
def test_the_log_keeps_order_and_its_bound_and_lets_acknowledged_segments_go(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path, "sub", limit=4000)
    for seq in range(10):
        spool.append([tap(seq, 100)], "h:1", 100, owner=seq)
    assert (spool.taps, spool.nbytes) == (10, 1000)
    with pytest.raises(SpoolFull, match="bound is 4000"):
        for seq in range(10, 100):
            spool.append([tap(seq, 100)], "h:1", 100)
    taken = [spool.take() for _ in range(spool.taps)]
    assert [t.taps[0].header["seq"] for t in taken if t] == list(range(len(taken)))
    assert taken[0] is not None and taken[0].entry.owner == 0 and taken[0].emitter == "h:1"
    assert taken[0].taps[0].arrays()[0].tolist() == [0] * 100
    for t in taken:
        assert t is not None
        spool.acknowledge(t.entry)
    assert spool.settled and not list(spool.directory.glob("*.seg"))


@pytest.mark.fast
def test_a_daemon_restarted_finds_the_log_without_what_was_acknowledged(
    tmp_path: Path,
) -> None:
    spool = Spool(tmp_path, "sub", limit=1 << 20)
    for seq in range(6):
        spool.append([tap(seq)], "h:1", 4)
    for _ in range(2):
        first = spool.take()
        assert first is not None
        spool.acknowledge(first.entry)
    spool.take()  # taken, not acknowledged: it comes again
    spool.close()
    with open(next(spool.directory.glob("*.seg")), "ab") as segment:
        segment.write(b"\x10\x00\x00\x00half a record")  # a daemon killed mid-write
    assert find_spools(tmp_path) == {"sub": spool.directory}
    again = Spool(tmp_path, "sub", limit=1 << 20)
    seqs = []
    while (taken := again.take()) is not None:
        seqs.append(taken.taps[0].header["seq"])
    assert seqs == [2, 3, 4, 5]
    again.close()


# ---- in the router ---------------------------------------------------------------------


def spooling(
    make: MakeRouter,
    directory: Path,
    *,
    limit: int = 1 << 20,
    fallback: str = "block",
    queue_bytes: int = 10,
) -> InProcessRouter:
    """A Router under the spool policy (queues of `queue_bytes`), one emitter "em" and one
    subscriber "sub" of "x" with a window of one tap."""
    box = make(policy="spool", queue_bytes=queue_bytes, spool=(directory, limit, fallback))
    box.subscribe("sub", ["x"], window=1, name="slow")
    box.emitter("em")
    return box


@pytest.mark.fast
def test_a_full_queue_spills_to_the_spool_and_comes_back_in_order(
    in_process_router: MakeRouter, tmp_path: Path
) -> None:
    box = spooling(in_process_router, tmp_path)
    for seq in range(20):
        box.router.tap("em", tap(seq))
    box.router.barrier("em", 0)
    box.router.flush_credit()
    # Every tap was credited at once (the emitter is not slowed) ...
    assert sum(m.header["bytes"] for m in box.to("em", "credit")) == sum(
        len(tap(0).frames[0]) for _ in range(20))  # fmt: skip
    assert box.router.counters["taps_spooled"] > 10
    assert box.to("em", "barrier_done") == []  # ... but the barrier waits for delivery
    assert box.handle_all() == list(range(20))
    [done] = box.to("em", "barrier_done")
    assert (done.header["delivered"], done.header["dropped"]) == (20, 0)
    assert box.router.idle() and not list(tmp_path.glob("*/*.seg"))
    box.close()


@pytest.mark.fast
def test_a_full_spool_falls_back_to_drop_newest_and_counts(
    in_process_router: MakeRouter, tmp_path: Path
) -> None:
    box = spooling(in_process_router, tmp_path, limit=600, fallback="drop_newest")
    for seq in range(40):
        box.router.tap("em", tap(seq))
    box.router.barrier("em", 0)
    spooled, dropped = box.router.counters["taps_spooled"], box.router.counters["spool_full"]
    assert spooled and dropped and box.router.counters["spool_fallback_dropped"] == dropped
    seqs = box.handle_all()
    assert seqs == sorted(seqs) and len(seqs) + dropped == 40
    [done] = box.to("em", "barrier_done")
    assert (done.header["delivered"], done.header["dropped"]) == (len(seqs), dropped)
    box.close()


@pytest.mark.fast
def test_a_full_spool_falls_back_to_block_withholding_credit(
    in_process_router: MakeRouter, tmp_path: Path
) -> None:
    box = spooling(in_process_router, tmp_path, limit=600, fallback="block")
    for seq in range(40):
        box.router.tap("em", tap(seq))
    box.router.barrier("em", 0)
    box.router.flush_credit()
    credited = sum(m.header["bytes"] for m in box.to("em", "credit"))
    assert credited < 40 * 4  # the rest waits, parked: the emitter slows down
    seqs = []
    for _ in range(100):
        seqs += box.handle_all()
        box.router.unpark()
        if len(seqs) == 40:
            break
    assert seqs == list(range(40))
    [done] = box.to("em", "barrier_done")
    assert (done.header["delivered"], done.header["dropped"]) == (40, 0)
    box.close()


# ---- real daemons ----------------------------------------------------------------------

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def test_a_slow_subscriber_neither_slows_the_emitter_nor_loses_a_tap(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path, backend: str
) -> None:
    steps = 300
    spool = ("--policy", "spool", "--spool-dir", str(tmp_path / "spool"),
             "--queue-bytes", "400")  # fmt: skip
    daemon = start_daemon(*spool)
    slow = start_subscriber(daemon, "loss", sleep_ms=5, timed=True)
    result = finish(start_emitter(daemon.endpoint, "steps", str(steps)))
    # Its loop ended before the subscriber's 5 ms per tap did (which came first, not the
    # loop's length against a bound, which a loaded machine stretches); the barrier waited.
    assert result["loop_end"] < slow.records()[-1]["handled_at"], result
    assert Tally.of(slow.records(), steps) == Tally(steps, 0, 0)
    assert [r["step"] for r in slow.records()] == list(range(steps))
    assert result["stats"]["delivered"] == steps
    counters = daemon.counters()
    assert counters["taps_spooled"] > steps / 2 and counters["taps_unspooled"] == counters[
        "taps_spooled"]  # fmt: skip


@pytest.mark.waits
def test_the_spool_is_delivered_after_a_daemon_restart(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, tmp_path: Path, backend: str
) -> None:
    """Stopped (SIGTERM) with taps spooled, the daemon leaves them on disk; restarted on
    the same spool directory, it gives them to the same subscriber when it comes back.
    Native: nothing is missing. Portable: what was in the stopped daemon's memory is
    lost, and no more than the emitter counts."""
    steps = 400
    spool = ("--policy", "spool", "--spool-dir", str(tmp_path / "spool"),
             "--queue-bytes", "400", "--drain-timeout", "0.5")  # fmt: skip
    daemon = start_daemon(*spool)
    slow = start_subscriber(daemon, "loss", sleep_ms=20)
    emitter = start_emitter(daemon.endpoint, "steps", str(steps), "no_barrier",
                            env={"TAPD_EXIT_TIMEOUT": "0.5"})  # fmt: skip
    wait_until(lambda: daemon.counters().get("taps_spooled", 0) > 200, "taps spooled")
    emitter.communicate(timeout=60)
    assert daemon.stop() == 0
    assert "stay in its spool" in daemon.log()
    handled_before = len(slow.records())
    again = start_daemon(*spool, "--startup-grace", "5")  # the subscriber comes back first
    wait_until(lambda: settled(again) and not list((tmp_path / "spool").glob("*/*.seg")),
               "the spool delivered", timeout=60)  # fmt: skip
    tally = Tally.of(slow.records(), steps)
    assert again.counters()["taps_unspooled"] > 200
    assert len(slow.records()) - handled_before > 200  # after the restart, from the spool
    if backend == "native":
        assert (tally.delivered, tally.missing) == (steps, 0), tally
    else:  # lost at most what the stopped daemon held in memory: its queue and window
        assert tally.missing <= 100 + 64, tally


def settled(daemon: Daemon) -> bool:
    """Its subscribers have nothing queued, in flight or spooled."""
    subscribers = daemon.stats()["subscribers"]
    return bool(subscribers) and not any(s["queued"] or s["in_flight"] or s["spooled"]
                                         for s in subscribers)  # fmt: skip


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 1 MiB tmpfs: a disk that fills."""
    path = Path(tempfile.mkdtemp(prefix="tapd-disk-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                              str(path)], capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        shutil.rmtree(path, ignore_errors=True)
        pytest.skip(f"needs to mount a tmpfs (root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], capture_output=True)
        os.rmdir(path)


def test_a_full_disk_gives_a_clear_error_the_fallback_and_a_daemon_that_lives(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, small_disk: Path
) -> None:
    steps, kib = 100, 64  # 6.4 MB of taps for a 1 MiB disk
    daemon = start_daemon("--policy", "spool", "--spool-dir", str(small_disk),
                          "--spool-fallback", "drop_newest",
                          "--queue-bytes", str(kib << 10))  # fmt: skip
    slow = start_subscriber(daemon, "big", sleep_ms=20)
    result = finish(start_emitter(daemon.endpoint, "many_bytes", str(steps), str(kib)))
    wait_until(lambda: daemon.stats()["subscribers"][0]["spooled"] == 0
               and not daemon.stats()["subscribers"][0]["in_flight"], "the spool drained",
               timeout=60)  # fmt: skip
    counters = daemon.counters()
    assert "the disk is full" in daemon.log() and "falling back to drop_newest" in daemon.log()
    handled = len(slow.records())
    assert handled + counters["deliveries_dropped"] == steps
    assert counters["deliveries_dropped"] == counters["spool_fallback_dropped"] > 0
    assert counters["spool_errors"] > 0
    assert counters["taps_spooled"] > 0  # some fitted
    assert daemon.process.poll() is None  # alive, and serving
    assert result["stats"]["dropped"] == 0
