"""Programs for tests/test_outputs_fast_path.py: each scenario runs jitted programs
again and again (their second calls on JAX's C++ path), reads back what arrived, and
prints one JSON line.

    python fast_path_app.py values|threads|slots|twin   # TAPD_GATHER=on or off
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
from tapd.emitter import lifecycle, outputs_fast_path
from tapd.protocol.ring_format import EVERY_DORMANT

scenario = sys.argv[1]
CALLS = 6


def set_every(ring, sites, every):
    """As the daemon writes a site table's slots (tapd/daemon/wants.py): a wake of a
    site the emitter relies on (a dormant step's twin, tapd/emitter/dormant_twin.py)
    holds once the emitter acknowledges it. Whether any such wake waited."""
    import time

    waited = False
    for site in sites:
        if ring.set_site_every(site, every) and every != EVERY_DORMANT:
            waited = True
            deadline = time.monotonic() + 10
            while ring.site_relied_on(site):
                assert time.monotonic() < deadline, "a wake not acknowledged"
                time.sleep(0.001)
    return waited


def output(**fields):
    fields.update(fast=outputs_fast_path.calls_served(), stats=tapd.stats())
    print(json.dumps(fields), flush=True)


if scenario == "values":
    seen = []

    def keep(name):
        return lambda value, transforms: seen.append([name, np.asarray(value).tolist()])

    scale = np.arange(5, dtype=np.float32)  # (a constant of the computation: const_args)

    def loop(x):
        return lax.fori_loop(0, 3, lambda i, c: tapd.id_tap(keep("loop"), c * 2.0 + i), x)

    def pytree(x, y):
        def step(c, v):
            c = tapd.id_tap(keep("scan"), c + v)
            return c, c * scale

        total, rows = lax.scan(step, x, y)
        return {"total": total, "rows": rows, "none": None}

    def branch(x, p):
        return lax.cond(p, lambda v: tapd.id_tap(keep("cond"), v + 1.0), lambda v: v - 1.0, x)

    def digest(value):  # (a big tap's values, in few numbers: sum, first and last)
        value = np.asarray(value, np.float64)
        return [list(value.shape), float(value.sum()), value[:2].tolist(), value[-2:].tolist()]

    def big(x):  # (20 taps of 64 KiB: its log leaves in rows, gathered.host.as_rows)
        return lax.fori_loop(
            0, 20, lambda i, c: tapd.id_tap(lambda v, t: seen.append(["big", digest(v)]), c + i), x
        )

    def untapped_big(x):
        for i in range(20):
            x = x + i
        return x

    def untapped_loop(x):
        for i in range(3):
            x = x * 2.0 + i
        return x

    def untapped_pytree(x, y):
        rows = []
        for v in y:
            x = x + v
            rows.append(x * scale)
        return {"total": x, "rows": np.stack(rows), "none": None}

    programs = {
        "loop": (jax.jit(loop), untapped_loop),
        "pytree": (jax.jit(pytree), untapped_pytree),
        "branch": (jax.jit(branch), lambda x, p: x + 1.0 if p else x - 1.0),
        "donated": (jax.jit(loop, donate_argnums=0), untapped_loop),
        "big": (jax.jit(big), untapped_big),
    }
    results = {}
    fast = {name: 0 for name in programs}
    expected_taps = []
    for k in range(CALLS):
        x = np.full(5, k, np.float32)
        y = np.arange(15, dtype=np.float32).reshape(3, 5) + k
        p = bool(k % 2)
        row = np.arange(2**14, dtype=np.float32) + 1000 * k
        calls = {"loop": (x,), "pytree": (x, y), "branch": (x, p), "donated": (x,), "big": (row,)}
        for name, (program, reference) in programs.items():
            args = calls[name]
            device_args = [jnp.asarray(a) for a in args]
            before = outputs_fast_path.calls_served()
            got = jax.tree.map(np.asarray, program(*device_args))
            fast[name] += outputs_fast_path.calls_served() - before
            want = reference(*args)
            same = jax.tree.map(lambda a, b: bool(np.allclose(a, b)), got, want)
            results.setdefault(name, []).append(all(jax.tree.leaves(same)))
            if name in ("loop", "donated"):
                c = x
                for i in range(3):
                    c = c * 2.0 + i
                    expected_taps.append(["loop", c.tolist()])
            elif name == "big":
                c = row
                for i in range(20):
                    c = c + np.float32(i)
                    expected_taps.append(["big", digest(c)])
            elif name == "pytree":
                c = x
                for v in y:
                    c = c + v
                    expected_taps.append(["scan", c.tolist()])
            elif p:
                expected_taps.append(["cond", (x + 1.0).tolist()])
    tapd.barrier_wait(timeout=60)
    output(results=results, seen=seen, expected=expected_taps, fast_by_program=fast)

elif scenario == "threads":
    import threading

    seen = []  # (list.append: atomic)

    def keep(value, transforms):
        seen.append(np.asarray(value).tolist())

    step = jax.jit(lambda x: lax.fori_loop(0, 2, lambda i, c: tapd.id_tap(keep, c + 1.0), x))
    jax.block_until_ready(step(jnp.zeros(3)))  # (its first call: JAX's Python path)

    def calls(start):
        for k in range(40):
            jax.block_until_ready(step(jnp.full(3, start + 1000.0 * k)))
            if start == 0 and k == 20:
                jax.clear_caches()  # (the C++ paths dropped: made again on the next call)

    threads = [threading.Thread(target=calls, args=(start,)) for start in (0, 100, 200)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tapd.barrier_wait(timeout=60)
    expected = [[0.0 + 1.0] * 3, [0.0 + 2.0] * 3]
    for start in (0, 100, 200):
        for k in range(40):
            base = start + 1000.0 * k
            expected += [[base + 1.0] * 3, [base + 2.0] * 3]
    output(seen=sorted(seen), expected=sorted(expected))

elif scenario == "slots":
    MOVED = [0]  # the packed bytes read from the device and written
    if os.environ.get("TAPD_GATHER") == "on":
        from tapd.emitter.gathered import host as gathered_host

        _write = gathered_host.Flush.write_packed

        def _counted(self, packed):
            MOVED[0] += packed.nbytes
            _write(self, packed)

        gathered_host.Flush.write_packed = _counted
    native = lifecycle.get_sender().native
    ring = native.ring
    one = jax.jit(lambda x: lax.fori_loop(0, 3, lambda i, c: tapd.tap(c + 1.0, "one", step=i), x))
    two = jax.jit(
        lambda x: lax.fori_loop(
            0, 2, lambda i, c: tapd.tap(tapd.tap(c, "first", step=i) * 2.0, "second", step=i), x
        )
    )
    x = jnp.zeros(4)
    jax.block_until_ready((one(x), two(x)))  # (their sites registered)
    jax.effects_barrier()
    sites = {name: native.sites_of(name) for name in ("one", "first", "second")}
    ALL = 1
    phases = [
        ("woken", {"one": ALL, "first": ALL, "second": ALL}),
        ("dormant", {"one": EVERY_DORMANT, "first": EVERY_DORMANT, "second": EVERY_DORMANT}),
        ("mixed", {"one": ALL, "first": EVERY_DORMANT, "second": ALL}),
        ("sampled", {"one": 3, "first": 2, "second": ALL}),
        ("woken again", {"one": ALL, "first": ALL, "second": ALL}),
        ("dormant again", {"one": EVERY_DORMANT, "first": EVERY_DORMANT, "second": ALL}),
    ]
    fast, moved = {}, {}
    for phase, slots in phases:
        for name, every in slots.items():
            set_every(ring, sites[name], every)
        before, bytes_before = outputs_fast_path.calls_served(), MOVED[0]
        for _ in range(CALLS):
            jax.block_until_ready(one(x))  # (each waited for: the ring writes as it runs)
            jax.block_until_ready(two(x))
        jax.effects_barrier()
        fast[phase] = outputs_fast_path.calls_served() - before
        moved[phase] = MOVED[0] - bytes_before
    names = {site: name for name, ids in sites.items() for site in ids}
    records = {}
    for record in ring.read(0, 1_000_000):
        records.setdefault(names[record.site], []).append([record.seq, record.step])
    output(records=records, fast_by_phase=fast, moved=moved, skipped=ring.counters().skipped)

elif scenario == "twin":
    # A dormant step gets its twin (tapd/emitter/dormant_twin.py); this app plays the
    # daemon on its own ring's table, as tapd/daemon/wants.py does: a wake written into
    # a slot the emitter relies on holds once the emitter acknowledges it.
    import time

    from tapd.emitter import dormant_twin

    native = lifecycle.get_sender().native
    ring = native.ring

    def body(name):
        return lambda i, c: tapd.tap(c * 2.0 + i, name, step=i)

    programs = {
        "plain": jax.jit(lambda x: lax.fori_loop(0, 3, body("plain"), x)),
        "donated": jax.jit(lambda x: lax.fori_loop(0, 3, body("donated"), x), donate_argnums=0),
    }

    def untapped(x):
        for i in range(3):
            x = x * 2.0 + i
        return x

    calls = {name: 0 for name in programs}
    same = []

    twin_calls = {name: 0 for name in programs}

    def call(name, k):
        x = np.full(4, k, np.float32)
        before = dormant_twin.calls_served()
        got = np.asarray(programs[name](jnp.asarray(x)))
        twin_calls[name] += dormant_twin.calls_served() - before
        same.append(bool(np.array_equal(got, untapped(x))))
        calls[name] += 1

    for name in programs:
        call(name, 0)  # (its sites registered; taken: nobody has said)
    jax.effects_barrier()
    sites = {name: native.sites_of(name) for name in programs}

    phases = {}
    for phase in ("dormant", "woken", "dormant again", "woken again"):
        every = EVERY_DORMANT if phase.startswith("dormant") else 1
        waited = {name: set_every(ring, sites[name], every) for name in programs}
        before = dict(twin_calls)
        counted = dict(calls)
        if every == EVERY_DORMANT:  # (called until each step's twin serves it, 5 times)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and any(
                twin_calls[name] - before[name] < 5 for name in programs
            ):
                for name in programs:
                    call(name, calls[name])
        else:
            for _ in range(CALLS):
                for name in programs:
                    call(name, calls[name])
        jax.effects_barrier()
        phases[phase] = {
            "calls": {name: calls[name] - counted[name] for name in programs},
            "twin_calls": {name: twin_calls[name] - before[name] for name in programs},
            "waited": waited,
        }
    names = {site: name for name, ids in sites.items() for site in ids}
    records = {}
    for record in ring.read(0, 1_000_000):
        records.setdefault(names[record.site], []).append([record.seq, record.step])
    output(
        records=records,
        phases=phases,
        same=same,
        skipped=ring.counters().skipped,
        relied_on=[ring.site_relied_on(s) for ids in sites.values() for s in ids],
    )
