"""Dormant and sampled taps, the emitter's side (docs/PROTOCOL.md, "Dormant and sampled
taps"): real jitted JAX programs, both backends (the FFI handler; the portable callback
writing the ring), and the portable sender path (no ring). The site table's slots are
set by hand with Ring.set_site_every (what the daemon does), and the ring read back in
the emitter process itself, so no daemon is needed for those; the barrier and the
delivered seqs are checked with a real daemon and subscriber."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zygote import run_program

from conftest import Daemon, SubscriberProcess, native_unavailable, run_emitter

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

_EMITTER = r"""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from tapd.native import library

if os.environ.get("TEST_NO_RING"):  # stand in for a host where the library cannot load
    library._loaded, library._library, library._reason = True, None, "hidden by the test"

import tapd
from tapd.emitter import lifecycle
from tapd.protocol.ring_format import EVERY_DORMANT, SITE_SLOTS
from tapd.printing import print_tap

scenario = sys.argv[1]

FLUSHES = []  # the gathered path's flushes: [records written, dormant taps skipped]
# A dormant call's: its output's head alone moved, or its counts, known before it ran,
# written by the host (`write_skipped`): [0, skipped]
HEADS = []
if os.environ.get("TAPD_GATHER") == "on":
    from tapd.emitter.gathered import host as gathered_host

    _write = gathered_host.Flush.write_packed
    _write_header = gathered_host.Flush.write_header

    def _counted(self, packed):
        FLUSHES.append(list(self.records(packed)))
        _write(self, packed)

    def _counted_header(self, header):
        written = _write_header(self, header)
        if written:
            HEADS.append(list(self.records(header)))
        return written

    _write_skipped = gathered_host.Flush.write_skipped

    def _counted_skipped(self, counts):
        HEADS.append([0, int(sum(counts))])
        _write_skipped(self, counts)

    gathered_host.Flush.write_packed = _counted
    gathered_host.Flush.write_header = _counted_header
    gathered_host.Flush.write_skipped = _counted_skipped


def loop(name, n, every=1, size=int(os.environ.get("TEST_LEAF_FLOATS", "256"))):
    def body(i, c):
        return tapd.tap(c + 1.0, name, step=i, every=every)
    return jax.jit(lambda: lax.fori_loop(0, n, body, jnp.zeros(size, jnp.float32)))


def compiled(function, *args):
    return jax.jit(function).lower(*args).compile()  # registers its sites now


def output(**fields):
    fields.update(stats=tapd.stats(), backend=tapd.backend(), flushes=FLUSHES, heads=HEADS)
    print(json.dumps(fields), flush=True)


if scenario == "slots":
    native = lifecycle.get_sender().native
    ring = native.ring
    programs = {
        "dormant": loop("dormant", 10).lower().compile(),
        "k3": loop("k3", 10, every=3).lower().compile(),
        "k2n3": loop("k2n3", 12, every=2).lower().compile(),
        "woken": loop("woken", 4).lower().compile(),
        "always": compiled(lambda: lax.fori_loop(
            0, 5, lambda i, c: tapd.id_tap(print_tap, c + 1.0), jnp.zeros(3))),
        "vmap": compiled(lambda xs: lax.fori_loop(0, 6, lambda i, c: jax.vmap(
            lambda x: tapd.tap(x + 1.0, "vmap", every=2))(c), xs), jnp.zeros((3, 2))),
        "scan": compiled(lambda xs: lax.scan(
            lambda c, x: (tapd.tap(c + x, "scan", every=4), None), 0.0, xs)[0], jnp.ones(8)),
    }
    if jax.device_count() > 1:
        n = jax.device_count()
        programs["pmap"] = jax.pmap(lambda x: lax.fori_loop(
            0, 4, lambda i, c: tapd.tap(c + 1.0, "pmap", every=2), x)).lower(
                jnp.zeros((n, 2))).compile()
    for name, every in [("dormant", EVERY_DORMANT), ("k2n3", 3), ("always", EVERY_DORMANT),
                        ("woken", EVERY_DORMANT), ("vmap", EVERY_DORMANT)]:
        for site in native.sites_of(name if name != "always" else "tapd.printing:print_tap"):
            ring.set_site_every(site, every)
    # Fill the site table; the next site has no slot: always sent.
    for i in range(SITE_SLOTS):
        native.register_site("filler", {"tree": ["leaf"], "meta": {"i": i}, "transforms": []}, [])
    programs["unslotted"] = loop("unslotted", 3).lower().compile()
    [unslotted] = native.sites_of("unslotted")
    ring.set_site_every(unslotted, EVERY_DORMANT)  # (no slot: nothing to set)
    head = ring.counters().head
    flushed, heads = len(FLUSHES), len(HEADS)
    programs["dormant"]()
    jax.effects_barrier()
    dormant_reserved = ring.counters().head - head
    dormant_flushes, dormant_heads = FLUSHES[flushed:], HEADS[heads:]
    # (each run waited for before a slot changes: calls are asynchronous)
    for name, program in programs.items():
        if name == "dormant":
            continue
        if name == "vmap":
            jax.block_until_ready(program(jnp.zeros((3, 2))))
            for site in native.sites_of("vmap"):  # woken halfway: seq went on counting
                ring.set_site_every(site, 1)
            jax.block_until_ready(program(jnp.zeros((3, 2))))
        elif name == "scan":
            jax.block_until_ready(program(jnp.ones(8)))
        elif name == "pmap":
            jax.block_until_ready(program(jnp.zeros((jax.device_count(), 2))))
        else:
            jax.block_until_ready(program())
        if name == "woken":
            for site in native.sites_of("woken"):
                ring.set_site_every(site, 1)
            jax.block_until_ready(program())
    jax.effects_barrier()
    names = {}
    for name in [*programs, "tapd.printing:print_tap"]:
        for site in native.sites_of(name):
            names[site] = name
    records = {}
    for record in ring.read(0, 1_000_000):
        records.setdefault(names[record.site], []).append(
            [record.seq, record.step, record.device])
    output(records=records, unslotted_site=unslotted, dormant_reserved=dormant_reserved,
           counters_skipped=ring.counters().skipped, dormant_flushes=dormant_flushes,
           dormant_heads=dormant_heads)

elif scenario == "long_dormant":  # gathered: a loop that flushes while it runs
    native = lifecycle.get_sender().native
    program = loop("long", 3000).lower().compile()
    [site] = native.sites_of("long")
    native.ring.set_site_every(site, EVERY_DORMANT)
    jax.block_until_ready(program())
    jax.effects_barrier()  # (its last taps come out after the call: written by then)
    native.ring.set_site_every(site, 1)  # (woken: the next call's taps are written)
    jax.block_until_ready(program())
    jax.effects_barrier()
    seqs = [r.seq for r in native.ring.read(0, 1_000_000)]
    output(first=seqs[:1], count=len(seqs))

elif scenario == "woken_mid_loop":  # gathered: a site woken while a long loop runs
    native = lifecycle.get_sender().native
    steps, wake_at = 3000, 500

    def wake(i):
        if int(i) == wake_at:
            native.ring.set_site_every(site, 1)
        return np.int32(0)

    def body(i, c):
        from jax.experimental import io_callback
        c = c + io_callback(wake, jax.ShapeDtypeStruct((), np.int32), i).astype(c.dtype)
        return tapd.tap(c + 1.0, "mid", step=i)

    program = jax.jit(lambda: lax.fori_loop(0, steps, body, jnp.zeros(4))).lower().compile()
    [site] = native.sites_of("mid")
    native.ring.set_site_every(site, EVERY_DORMANT)
    jax.block_until_ready(program())
    jax.effects_barrier()
    steps_seen = [r.step for r in native.ring.read(0, 1_000_000)]
    output(steps_seen=steps_seen, wake_at=wake_at, steps=steps)

elif scenario == "slice_dormant":  # gathered: a pmap over 2 devices, dormant, then woken
    native = lifecycle.get_sender().native
    n = jax.device_count()
    program = jax.pmap(lambda x: lax.fori_loop(
        0, 6, lambda i, c: tapd.tap(c + 1.0, "sd", step=i), x)).lower(
            jnp.zeros((n, 4))).compile()
    [site] = native.sites_of("sd")
    native.ring.set_site_every(site, EVERY_DORMANT)
    jax.block_until_ready(program(jnp.zeros((n, 4))))
    jax.effects_barrier()
    dormant_flushes, dormant_heads = list(FLUSHES), list(HEADS)
    native.ring.set_site_every(site, 1)
    jax.block_until_ready(program(jnp.zeros((n, 4))))
    jax.effects_barrier()
    records = [[r.seq, r.step, r.device] for r in native.ring.read(0, 1_000_000)]
    output(records=records, dormant_flushes=dormant_flushes, dormant_heads=dormant_heads)

elif scenario == "dormant_unknown_count":  # a call whose taps are counted once it has run
    native = lifecycle.get_sender().native
    maybe = compiled(lambda x, p: lax.cond(p, lambda v: tapd.tap(v + 1.0, "maybe"),
                                           lambda v: v, x), jnp.zeros(4), True)
    [site] = native.sites_of("maybe")
    native.ring.set_site_every(site, EVERY_DORMANT)
    for tapping in (True, False, True, True, False):
        jax.block_until_ready(maybe(jnp.zeros(4), np.bool_(tapping)))
    jax.effects_barrier()
    dormant_flushes, dormant_heads = list(FLUSHES), list(HEADS)
    native.ring.set_site_every(site, 1)
    jax.block_until_ready(maybe(jnp.zeros(4), np.bool_(True)))
    jax.effects_barrier()
    seqs = [r.seq for r in native.ring.read(0, 1_000_000)]
    output(seqs=seqs, skipped=native.ring.counters().skipped,
           dormant_flushes=dormant_flushes, dormant_heads=dormant_heads)

elif scenario == "no_dormant":  # run with TAPD_DORMANT=0
    native = lifecycle.get_sender().native
    program = loop("plain", 4, every=2).lower().compile()
    for site in native.sites_of("plain"):
        native.ring.set_site_every(site, EVERY_DORMANT)
    program()
    jax.effects_barrier()
    seqs = [r.seq for r in native.ring.read(0)]
    entries = native.sites_path.read_bytes()
    output(seqs=seqs, always=b"\xa6always\xc3" in entries)

elif scenario == "barrier":
    every = int(sys.argv[2])
    watched = loop("watched", 12, every=every).lower().compile()
    unwatched = loop("unwatched", 12).lower().compile()
    native = lifecycle.get_sender().native
    if native is not None:
        for site in native.sites_of("unwatched"):
            native.ring.set_site_every(site, EVERY_DORMANT)
    watched()
    unwatched()
    tapd.barrier_wait(timeout=30)
    output()
"""


def run_script(
    runtime_dir: Path, scenario: str, *args: str, env: dict[str, str] | None = None
) -> dict[str, Any]:
    script = runtime_dir / "dormant_emitter.py"
    script.write_text(_EMITTER)
    result = run_program(
        [sys.executable, str(script), scenario, *args],
        env={
            **os.environ,
            "TAPD_ENDPOINT": f"ipc://{runtime_dir}/tapd.sock",
            "TAPD_EXIT_TIMEOUT": "0",
            "TAPD_LOCAL_FALLBACK": "0",
            **(env or {}),
        },
        timeout=240,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result\n{result.stdout}\n{result.stderr}"
    output: dict[str, Any] = json.loads(lines[-1])
    return output


def seqs(records: list[list[int]], device: int | None = None) -> list[int]:
    return [seq for seq, _, dev in records if device is None or dev == device]


@pytest.fixture
def ring_backend(backend: str) -> str:
    """native (the FFI handler) or portable (the callback writing the same ring)."""
    if reason := native_unavailable():
        pytest.skip(reason)
    return backend


@pytest.mark.parametrize("floats", [256, 65536], ids=["1KiB", "256KiB"])
def test_the_writers_decide_by_the_site_table_and_every(
    runtime_dir: Path, ring_backend: str, floats: int
) -> None:
    """The loops' taps of 1 KiB, and of 256 KiB, which a portable tap asks about first
    (tapd/emitter/lowering.py, `_emit_guarded`): the same taps taken, skipped, counted."""
    flags = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "TEST_LEAF_FLOATS": str(floats),
    }
    result = run_script(runtime_dir, "slots", env=flags)
    assert result["backend"] == ring_backend
    assert result["flushes"] == []
    check_slots(result)


@pytest.mark.parametrize("floats", [256, 65536], ids=["1KiB", "256KiB"])
def test_gathered_taps_are_kept_or_skipped_on_the_device_by_the_site_table(
    runtime_dir: Path, floats: int
) -> None:
    """The same programs gathered on the device (TAPD_GATHER=on, as on a TPU): each call
    reads its sites' slots as it is dispatched; a dormant site's taps are not kept on the
    device (the flush writes none of them: it counts them, their seqs used up), the
    others are written and sampled by the ring exactly as one callback a tap does."""
    if reason := native_unavailable():
        pytest.skip(reason)
    flags = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "TEST_LEAF_FLOATS": str(floats),
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
    }
    result = run_script(runtime_dir, "slots", env=flags)
    assert result["backend"] == "portable"
    # The dormant program's call: nothing of its output moved (its ten taps, known
    # before it ran, counted as skipped by the host, as a head of counts).
    assert result["dormant_flushes"] == []
    assert result["dormant_heads"] == [[0, 10]]
    # "woken": dormant for its first call (4 skipped), then 4 written.
    assert [0, 4] in result["heads"] and [4, 0] in result["flushes"]
    check_slots(result)


@pytest.mark.parametrize("gather", ["off", "on"])
def test_a_dormant_call_whose_tap_count_is_known_only_once_it_ran_counts_its_taps(
    runtime_dir: Path, gather: str
) -> None:
    """A one-armed tapping `cond`, dormant for five calls (three of them tap), then
    woken: the woken tap's seq is 3 (each dormant tap used one up), as one host callback
    a tap counts them. Gathered, no flush ran and only each output's head moved (its
    count of dormant taps, read from the device: taps_as_outputs._write)."""
    if reason := native_unavailable():
        pytest.skip(reason)
    env = {"TAPD_BACKEND": "portable", "TAPD_GATHER": gather}
    result = run_script(runtime_dir, "dormant_unknown_count", env=env)
    assert result["seqs"] == [3]
    assert result["skipped"] == 3
    if gather == "on":
        assert result["dormant_flushes"] == []
        assert result["dormant_heads"] == [[0, 1], [0, 0], [0, 1], [0, 1], [0, 0]]


def test_a_gathered_loop_that_flushes_while_it_runs_skips_dormant_taps_at_the_flush(
    runtime_dir: Path,
) -> None:
    """A loop longer than the log runs live (tapd.emitter.gathered.live): each chunk's
    end asks the host for fresh wake flags, so a dormant site's taps are not kept on
    the device (they move nothing: counted as skipped), and once woken its taps come.
    (Logs of 1024: its 3000 taps, counted before it runs, would otherwise take one log,
    TAPD_GATHER_LOG_BYTES.)"""
    if reason := native_unavailable():
        pytest.skip(reason)
    env = {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "TAPD_GATHER_LOG_BYTES": "1",
        "TEST_LEAF_FLOATS": "4",
    }
    result = run_script(runtime_dir, "long_dormant", env=env)
    assert result["stats"]["skipped_by_consumer"] == {"long": 3000}
    assert result["first"] == [3000] and result["count"] == 3000
    # Only the woken call's taps came out (flushes of at most 1024, and the end); the
    # dormant call's were counted, not moved.
    assert sum(records for records, _ in result["flushes"]) == 3000
    assert max(records for records, _ in result["flushes"]) <= 1024
    assert sum(skipped for _, skipped in result["flushes"] + result["heads"]) == 3000


def test_a_site_woken_while_a_gathered_loop_runs_takes_its_taps_from_the_next_chunk(
    runtime_dir: Path,
) -> None:
    """Woken at step 500 of a 3000-step loop (by a callback inside it), a dormant site
    takes every tap from the next chunk's start on: a run of steps with no gap up to
    the loop's end, starting within one log (1024 steps) of the wake."""
    if reason := native_unavailable():
        pytest.skip(reason)
    env = {"TAPD_BACKEND": "portable", "TAPD_GATHER": "on"}
    result = run_script(runtime_dir, "woken_mid_loop", env=env)
    seen, wake_at, steps = result["steps_seen"], result["wake_at"], result["steps"]
    assert seen, "no tap came after the site was woken"
    assert seen == list(range(seen[0], steps))
    assert wake_at < seen[0] <= wake_at + 1025
    assert result["stats"]["skipped_by_consumer"] == {"mid": seen[0]}


def test_a_dormant_slice_moves_nothing_and_each_device_counts_its_taps(
    runtime_dir: Path,
) -> None:
    """A `pmap` over 2 devices, gathered, its site dormant: no device keeps a tap, no
    byte of its output moves (each device's count, known before it runs, is counted as
    skipped by the host), and no host callback runs; woken, each device's six taps come
    out as its shard of the output, with the seqs the dormant call used up counted."""
    if reason := native_unavailable():
        pytest.skip(reason)
    from tapd.emitter.jax_compat import cpu_partition_id_in_branches

    if not cpu_partition_id_in_branches():
        pytest.skip(
            "this JAX gathers no slice on its CPU (jax_compat.cpu_partition_id_in_branches)"
        )
    env = {
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": "on",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    result = run_script(runtime_dir, "slice_dormant", env=env)
    assert result["dormant_flushes"] == []
    assert result["dormant_heads"] == [[0, 6], [0, 6]]
    assert result["flushes"] == [[6, 0], [6, 0]]
    assert result["stats"]["host_callbacks"] == 0
    assert result["stats"]["skipped_by_consumer"] == {"sd": 12}
    for device in (0, 1):
        mine = [[seq, step] for seq, step, dev in result["records"] if dev == device]
        assert mine == [[6 + step, step] for step in range(6)]


def check_slots(result: dict[str, Any]) -> None:
    """What the `slots` scenario's programs delivered and skipped, by the site table."""
    records, stats = result["records"], result["stats"]
    skipped = stats["skipped_by_consumer"]
    # Dormant: nothing reserved, nothing copied, each execution counted as skipped.
    assert "dormant" not in records
    assert result["dormant_reserved"] == 0
    assert skipped["dormant"] == 10
    # every=3: the executions whose seq is a multiple of 3; seq and step show which.
    assert [[seq, step] for seq, step, _ in records["k3"]] == [[0, 0], [3, 3], [6, 6], [9, 9]]
    assert skipped["k3"] == 6
    # The site's K=2 and the slot's N=3 combine: seq % 6 == 0.
    assert seqs(records["k2n3"]) == [0, 6]
    assert skipped["k2n3"] == 10
    # Woken after 4 dormant executions: the seq counted them.
    assert seqs(records["woken"]) == [4, 5, 6, 7]
    assert skipped["woken"] == 4
    # An id_tap site is always sent, whatever the slot says.
    assert seqs(records["tapd.printing:print_tap"]) == [0, 1, 2, 3, 4]
    assert "tapd.printing:print_tap" not in skipped
    # A site past the table has no slot: always sent.
    assert result["unslotted_site"] >= 3840
    assert seqs(records["unslotted"]) == [0, 1, 2]
    # vmap: one tap per batch, every=2; dormant for the first run of 6, then woken.
    assert seqs(records["vmap"]) == [6, 8, 10]
    assert skipped["vmap"] == 9
    # scan, every=4.
    assert seqs(records["scan"]) == [0, 4]
    assert skipped["scan"] == 6
    # pmap: each device's seq, every=2.
    assert seqs(records["pmap"], 0) == [0, 2] and seqs(records["pmap"], 1) == [0, 2]
    assert skipped["pmap"] == 4
    # The totals agree: the ring's, tapd.stats()'s, and the sum by consumer.
    assert stats["skipped"] == result["counters_skipped"] == sum(skipped.values()) == 49
    assert stats["dropped"] == 0


def test_tapd_dormant_0_marks_every_site_always_and_its_writers_ignore_the_slot(
    runtime_dir: Path, ring_backend: str
) -> None:
    result = run_script(runtime_dir, "no_dormant", env={"TAPD_DORMANT": "0"})
    assert result["always"]  # the site entry says so, for the daemon
    assert result["seqs"] == [0, 2]  # its own every=2 still applies; the slot does not
    assert result["stats"]["skipped_by_consumer"] == {"plain": 2}


def test_barrier_wait_returns_with_skipped_taps_and_delivers_the_sampled_ones(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "watched")
    result = run_script(runtime_dir, "barrier", "4")
    assert result["backend"] == backend
    stats = result["stats"]
    records = subscriber.records()  # the barrier passed: they were handled
    assert [r["seq"] for r in records] == [0, 4, 8]
    assert [r["step"] for r in records] == [0, 4, 8]
    assert stats["skipped_by_consumer"]["watched"] == 9
    assert stats["delivered"] == 3
    # The unwatched site, made dormant by hand: skipped, neither sent nor unrouted.
    assert stats["skipped_by_consumer"]["unwatched"] == 12
    assert (stats["unrouted"], stats["dropped"], stats["sent"]) == (0, 0, 3)


def test_without_a_ring_the_sender_samples_by_every_but_knows_no_dormancy(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, runtime_dir: Path
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "watched")
    result = run_script(
        runtime_dir, "barrier", "3", env={"TEST_NO_RING": "1", "TAPD_BACKEND": "portable"}
    )
    stats = result["stats"]
    assert [r["seq"] for r in subscriber.records()] == [0, 3, 6, 9]
    assert stats["skipped_by_consumer"] == {"watched": 8}
    assert stats["skipped"] == 8
    # No site table: every tap of the unwatched site is sent (and unrouted by the daemon).
    assert (stats["sent"], stats["delivered"], stats["unrouted"]) == (16, 4, 12)


@pytest.mark.fast
def test_tap_every_must_be_a_positive_int() -> None:
    jax = pytest.importorskip("jax")
    import tapd
    from tapd.errors import TapDefinitionError

    for bad in (0, -2, 2**63, 1.5, True, "3"):
        with pytest.raises(
            TapDefinitionError, match=r"tap 'acts': every=.* must be an int (>= 1|from 1)"
        ):
            jax.jit(lambda x, bad=bad: tapd.tap(x, "acts", every=bad)).lower(1.0)


def test_a_site_without_every_and_an_unwritten_slot_sends_every_tap(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    """A site without every= (K=1) and a slot nobody wrote copies every tap."""
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss")
    result = run_emitter(daemon.endpoint, "steps", "5")
    assert [r["seq"] for r in subscriber.records()] == [0, 1, 2, 3, 4]
    assert result["stats"]["skipped"] == 0 and result["stats"]["skipped_by_consumer"] == {}
