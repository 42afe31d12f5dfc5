"""A JAX process whose tap functions all live in it: `tapd.debug` sites and `id_tap`s of
closures, which go to the process's local ring, drained by its own receiver thread
(tests/test_local_path.py). `python local_path_app.py SCENARIO [ARGS]` prints one JSON
line of results last."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd
import tapd.debug


def order() -> dict[str, Any]:
    """Several local sites inside scan, cond and while bodies, of both kinds: the calls
    come in program order, step after step, and across computations."""
    calls: list[Any] = []

    def note(tag: str) -> Any:
        return lambda arg, transforms: calls.append([tag, float(arg)])

    first, second, third = note("id_tap a"), note("id_tap b"), note("while")

    def body(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        x = tapd.id_tap(first, x)
        tapd.debug.callback(lambda v: calls.append(["debug", float(v)]), x + 0.5)
        x = lax.cond(x > 1, lambda v: tapd.id_tap(second, v * 10), lambda v: v, x)
        return carry + x, None

    def looped(n: jax.Array) -> jax.Array:
        def step(i: jax.Array) -> jax.Array:
            tapd.debug.callback(lambda v: calls.append(["while debug", float(v)]), i)
            return tapd.id_tap(third, i + 1)

        return lax.while_loop(lambda i: i < n, step, jnp.float32(0))

    scan = jax.jit(lambda xs: lax.scan(body, 0.0, xs)[0])
    loop = jax.jit(looped)
    for _ in range(2):
        scan(jnp.arange(3.0))
        loop(jnp.float32(2))
    tapd.barrier_wait()
    return {"calls": calls, "stats": tapd.stats()}


def flood(count: str, sleep_ms: str) -> dict[str, Any]:
    """`count` taps of 4 KiB into a small ring through a slow callback: under `block`
    the step waits for ring space and nothing is lost; under `drop_newest` taps are
    dropped, counted, and seqs show the gaps."""
    seqs: list[int] = []
    pause = float(sleep_ms) / 1000

    def slow(arg: Any, transforms: Any) -> None:
        time.sleep(pause)
        seqs.append(int(arg[0]))

    step = jax.jit(lambda i: tapd.id_tap(slow, jnp.full(1024, i, jnp.float32)))
    for i in range(int(count)):
        step(jnp.float32(i))
    tapd.barrier_wait(timeout=120)
    return {"seqs": seqs, "stats": tapd.stats()}


def gathering(path: str) -> dict[str, Any]:
    """The receiver lets taps gather for 10 minutes (tapd.emitter.local.path._GATHER),
    not 10 ms, after each read; nothing waits that long: writers that leave half the
    ring waiting, or find no room, wake it; so do a barrier and exit. A 64 KiB ring
    (TAPD_BUFFER_BYTES) under `block`: taps of 1 KiB, then one of 40 KiB that cannot fit
    beside the 1 KiB ones (fewer than half the ring: none woke the receiver), then many
    (half the ring waits again and again), then a barrier; then taps that exit runs.
    Each callback appends its value to `path`."""
    from tapd.emitter.local import path as local_path

    local_path._GATHER = 600.0

    def record(arg: Any, transforms: Any) -> None:
        with open(path, "a") as out:
            out.write(f"{int(arg[0])}\n")

    small = jax.jit(lambda i: tapd.id_tap(record, jnp.full(256, i, jnp.int32)))  # 1 KiB
    big = jax.jit(lambda i: tapd.id_tap(record, jnp.full(10240, i, jnp.int32)))  # 40 KiB
    small(jnp.int32(0))
    while not os.path.exists(path):  # run: the receiver now lets taps gather
        time.sleep(0.001)
    time.sleep(0.05)
    for i in range(1, 28):
        small(jnp.int32(i))
    big(jnp.int32(28))
    for i in range(29, 500):
        small(jnp.int32(i))
    tapd.barrier_wait(timeout=60)
    with open(path) as ran:
        at_barrier = len(ran.read().split())
    for i in range(500, 510):  # for exit to run
        small(jnp.int32(i))
    return {"at_barrier": at_barrier, "stats": tapd.stats()["local"]}


def gathering_after_idle_waits() -> dict[str, Any]:
    """The receiver lets taps gather (for 10 minutes here) after each read; a
    `barrier_wait` or `jax.effects_barrier()` with every tap already run does not cut
    that short (each used to: the receiver then read the next taps one by one as they
    came). Taps of a tapd.debug.callback, each noted by the callback: what had run
    before the last barrier, and after it."""
    from tapd.emitter.local import path as local_path

    local_path._GATHER = 600.0
    ran: list[int] = []
    step = jax.jit(lambda i: tapd.debug.callback(lambda v: ran.append(int(v)), i))
    step(0)  # wakes the idle receiver: it runs this tap, then lets taps gather
    deadline = time.monotonic() + 60
    while not ran and time.monotonic() < deadline:
        time.sleep(0.001)
    tapd.barrier_wait(timeout=60)  # nothing to wait for
    jax.effects_barrier()  # nothing to wait for
    step(1)  # gathered: runs at the next barrier, not before
    time.sleep(0.5)
    before_barrier = list(ran)
    tapd.barrier_wait(timeout=60)
    return {"before_barrier": before_barrier, "after_barrier": list(ran)}


def barrier_in_flight(count: str) -> dict[str, Any]:
    """barrier_wait and jax.effects_barrier() (tapd.install_debug) return only once every
    callback dispatched before them has run, while they are still in flight."""
    tapd.install_debug()
    ran: list[int] = []

    def slow(v: Any) -> None:
        time.sleep(0.01)
        ran.append(int(v))

    step = jax.jit(lambda i: jax.debug.callback(slow, i))
    for i in range(int(count)):
        step(i)
    before = len(ran)
    jax.effects_barrier()
    after_jax = len(ran)
    for i in range(int(count)):
        step(i)
    tapd.barrier_wait()
    return {"before": before, "after_jax": after_jax, "after_tapd": len(ran), "ran": ran}


def effects_barrier_without_install(ordered: str) -> dict[str, Any]:
    """host_callback's tests' shape: id_print to an output_stream, and an id_tap of a slow
    closure, in one jit called three times (the later calls served from the compiled
    executable), each followed by a bare `jax.effects_barrier()` (no install_debug):
    after each, every line of that call has been written. `ordered`: id_tap's keyword
    ("default": none)."""
    keywords: dict[str, Any] = {} if ordered == "default" else {"ordered": _ordering(ordered)}
    lines: list[str] = []
    ran: list[int] = []

    class Stream:
        def write(self, text: str) -> None:
            lines.append(text)

    def slow(value: Any, transforms: Any) -> None:
        time.sleep(0.05)
        ran.append(int(value))

    def func(x: jax.Array) -> jax.Array:
        for i in range(1, 4):
            x = tapd.id_print(x * i, what=f"x times {i}", output_stream=Stream(), **keywords)
        return tapd.id_tap(slow, x[0, 0].astype(jnp.int32), result=x, **keywords)

    written_after_each = []
    for _ in range(3):
        jax.jit(func)(jnp.arange(6.0).reshape((2, 3)) + 1)
        jax.effects_barrier()
        written_after_each.append([len(lines), len(ran)])
    return {"written_after_each": written_after_each}


def effects_barrier_raising(install: str) -> dict[str, Any]:
    """An id_tap of a function that raises, then `jax.effects_barrier()`: after
    `tapd.install_host_callback()` ("1") it raises CallbackException, as host_callback's
    did; without ("0") it returns, and the next `barrier_wait` raises."""
    if install == "1":
        tapd.install_host_callback()

    def fails(value: Any, transforms: Any) -> None:
        raise ValueError("deliberate")

    jax.jit(lambda x: tapd.id_tap(fails, x))(jnp.ones(2))
    raised: dict[str, str | None] = {"effects_barrier": None, "barrier_wait": None}
    for name, barrier in (
        ("effects_barrier", jax.effects_barrier),
        ("barrier_wait", tapd.barrier_wait),
    ):
        try:
            barrier()
        except tapd.CallbackException as exc:
            raised[name] = str(exc).splitlines()[0]
    return {"raised": raised}


def _ordering(text: str) -> Any:
    return {"true": True, "false": False}.get(text, text)


def exit_drain(path: str, count: str, sleep_ms: str = "10") -> dict[str, Any]:
    """Exit with slow callbacks still in flight: each one runs before the process ends."""
    out = open(path, "w")  # noqa: SIM115 (closed by exit, after the drain)
    pause = float(sleep_ms) / 1000

    def slow(v: Any) -> None:
        time.sleep(pause)
        out.write(f"{int(v)}\n")
        out.flush()

    step = jax.jit(lambda i: tapd.debug.callback(slow, i))
    for i in range(int(count)):
        step(i)
    return {"dispatched": int(count)}


def exit_stuck(count: str) -> dict[str, Any]:
    """Exit while a callback waits for ever and `count` more wait behind it: the exit
    drain gives up after TAPD_EXIT_TIMEOUT s without progress, says how many did not
    run, and the process ends (no function runs on while the interpreter shuts down)."""
    forever = threading.Event()
    step = jax.jit(lambda i: tapd.debug.callback(lambda v: forever.wait(), i))
    for i in range(int(count) + 1):
        step(i)
    return {"dispatched": int(count) + 1}


def raising() -> dict[str, Any]:
    """A tapd.debug callback and an id_tap closure that raise: the next barrier raises
    CallbackException naming each, with the last one's traceback; the others ran; the
    barrier after is clean."""
    seen: list[float] = []

    def sometimes(v: Any) -> None:
        if float(v) == 1.0:
            raise ValueError("deliberate debug failure")
        seen.append(float(v))

    def always(arg: Any, transforms: Any) -> None:
        raise KeyError("deliberate id_tap failure")

    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        tapd.debug.callback(sometimes, x)
        return x

    for i in range(3):
        step(jnp.float32(i))
    first = _raised()
    jax.jit(lambda x: tapd.id_tap(always, x))(jnp.float32(5))
    second = _raised()
    third = _raised()
    return {"seen": seen, "first": first, "second": second, "third": third}


def _errors_at_barrier() -> list[str] | None:
    """What the next barrier raises of the tap functions' failures (None: nothing)."""
    try:
        tapd.barrier_wait()
    except tapd.CallbackException as exc:
        return list(exc.errors)
    return None


def _raised() -> dict[str, Any] | None:
    try:
        tapd.barrier_wait()
    except tapd.CallbackException as exc:
        return {"text": str(exc), "errors": exc.errors, "cause": repr(exc.__cause__)}
    return None


def stuck() -> dict[str, Any]:
    """A callback that waits on an event: a barrier with a timeout raises BarrierTimeout
    saying which site waits and what the receiver thread runs; released, all is well."""
    release = threading.Event()

    def wait_for_release(v: Any) -> None:
        release.wait(60)

    jax.jit(lambda x: tapd.debug.callback(wait_for_release, x))(1.0)
    message = None
    try:
        tapd.barrier_wait(timeout=0.5)
    except tapd.BarrierTimeout as exc:
        message = str(exc)
    release.set()
    tapd.barrier_wait()
    return {"message": message}


def eager_and_print() -> dict[str, Any]:
    """Calls outside jit (run before they return, as jax.debug's are) and prints."""
    got: list[float] = []
    tapd.debug.callback(lambda v: got.append(float(v)), jnp.float32(3))
    tapd.debug.print("eager {x}", x=jnp.arange(2))
    jax.jit(lambda x: tapd.debug.print("jitted {x}", x=x))(jnp.float32(7))
    tapd.barrier_wait()
    sys.stdout.flush()
    return {"got": got}


def mixed(count: str) -> dict[str, Any]:
    """A named site that a subscriber process takes and a closure that runs here, in one
    step: both deliver every tap."""
    local: list[float] = []

    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        x = tapd.tap(x, "named")
        return tapd.id_tap(lambda a, t: local.append(float(a)), x + 100)

    for i in range(int(count)):
        step(jnp.float32(i))
    tapd.barrier_wait()
    return {"local": local, "stats": tapd.stats()}


def interleaved(count: str) -> dict[str, Any]:
    """Four local sites in one step, called `count` times, so that each read of the
    ring holds runs of several sites: a leaf whose function raises now and then, a
    tuple, a dict, and a site whose function takes `device=` (which `Handlers` runs).
    Then `leaf` alone, `count` times more: reads of one site. Each function gets every
    value of its own site, in order; each failure is reported with its own site and
    seq."""
    got: dict[str, list[Any]] = {"leaf": [], "pair": [], "tree": [], "device": []}

    def leaf(arg: Any, transforms: Any) -> None:
        if int(arg) % 50 == 7:
            raise ValueError(f"deliberate failure at {int(arg)}")
        got["leaf"].append(int(arg))

    def pair(arg: Any, transforms: Any) -> None:
        got["pair"].append([type(arg).__name__, int(arg[0]), int(arg[1])])

    def tree(arg: Any, transforms: Any) -> None:
        got["tree"].append([sorted(arg), int(arg["a"]), int(arg["b"][0])])

    def on_device(arg: Any, transforms: Any, *, device: Any) -> None:
        got["device"].append([int(arg), device is not None])

    @jax.jit
    def step(i: jax.Array) -> jax.Array:
        i = tapd.id_tap(leaf, i)
        i = tapd.id_tap(pair, (i, i * 2))[0]
        i = tapd.id_tap(tree, {"a": i, "b": [i * 3]})["a"]
        return tapd.id_tap(on_device, i, tap_with_device=True) + 1

    i = jnp.int32(0)
    for _ in range(int(count)):
        i = step(i)
    alone = jax.jit(lambda i: tapd.id_tap(leaf, i) + 1)  # runs of one site: long ones
    i = jnp.int32(1000)
    for _ in range(int(count)):
        i = alone(i)
    errors = _errors_at_barrier()
    return {"got": got, "errors": errors, "stats": tapd.stats()["local"]}


def _described(value: Any) -> Any:
    """What a callback can see of one argument, as JSON."""
    if isinstance(value, jax.Array):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            return ["key", str(value.dtype), jax.random.key_data(value).tolist()]
        return [
            "Array", str(value.dtype), list(value.shape), value.tolist(), value.committed,
            sorted(d.platform for d in value.devices()), value.weak_type,
        ]  # fmt: skip
    return [type(value).__name__, repr(value)]


def debug_runs(which: str, count: str) -> dict[str, Any]:
    """`count` steps of a program whose `tapd.debug.callback` (or, `which` = "jax",
    `jax.debug.callback`) sites see a leaf, static and keyword arguments, a vmapped
    value, a typed PRNG key and a value under `grad`: many taps of each site a read of
    the ring. What each call gets, per site in call order, and the default device it
    runs under (tests compare tapd's with JAX's)."""
    callback = tapd.debug.callback if which == "tapd" else jax.debug.callback
    calls: dict[str, list[Any]] = {}

    def record(tag: str) -> Any:
        def called(*args: Any, **kwargs: Any) -> None:
            described = [_described(a) for a in args]
            keywords = {k: _described(v) for k, v in sorted(kwargs.items())}
            calls.setdefault(tag, []).append([described, keywords])

        return called

    def default_device(v: Any) -> None:
        made = jnp.zeros(())  # where an array made in the callback lands
        calls.setdefault("default device", []).append(sorted(made.devices())[0].platform)

    @jax.jit
    def step(i: jax.Array) -> jax.Array:
        x = i.astype(jnp.float32) * 0.5
        callback(record("leaf"), x)
        callback(record("static"), x, "label", None, scale=2, y=x * 2)
        jax.vmap(lambda r: callback(record("vmapped"), r, x))(jnp.stack([x, x + 1, x + 2]))
        callback(record("key"), jax.random.key(i))
        jax.grad(lambda z: (callback(record("grad"), z), z * 2.0)[1])(x)
        callback(default_device, x)
        return i + 1

    i = jnp.int32(0)
    for _ in range(int(count)):
        i = step(i)
    jax.block_until_ready(i)
    tapd.barrier_wait()
    return {"calls": calls}


def debug_failures(count: str) -> dict[str, Any]:
    """A tapd.debug.callback in a hot step that raises now and then: every other call
    runs, in order; each failure is reported at the barrier, naming the callback."""
    seen: list[int] = []

    def sometimes(v: Any) -> None:
        if int(v) % 50 == 7:
            raise ValueError(f"deliberate failure at {int(v)}")
        seen.append(int(v))

    step = jax.jit(lambda i: (tapd.debug.callback(sometimes, i), i + 1)[1])
    i = jnp.int32(0)
    for _ in range(int(count)):
        i = step(i)
    errors = _errors_at_barrier()
    return {"seen": seen, "errors": errors, "stats": tapd.stats()["local"]}


class _Lines:
    """An `output_stream` that keeps what it is given."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        self.lines.append(text)


def printing(count: str, rounds: str) -> dict[str, Any]:
    """id_print of several kinds of arrays to an output_stream, one step `count` times
    (runs of one tap each), then one of them alone, `rounds` rounds of `count` times
    (long runs; "until-worker": until the print worker, which starts as the first long
    run comes, has rendered one, at most 100): the lines, the counters and the rounds.
    TAPD_PRINT_WORKER says where the texts are rendered."""
    stream = _Lines()
    np.set_printoptions(precision=4)  # (this thread's: numpy keeps them per context)

    @jax.jit
    def step(i: jax.Array) -> jax.Array:
        x = i.astype(jnp.float32) / 7
        tapd.id_print(x * jnp.arange(16, dtype=jnp.float32), what="floats", output_stream=stream)
        tapd.id_print(i, output_stream=stream)
        tapd.id_print(x.astype(jnp.bfloat16) * jnp.ones((2, 3), jnp.bfloat16), what="bf16",
                      output_stream=stream)  # fmt: skip
        tapd.id_print(jnp.arange(2000.0) + i, output_stream=stream, threshold=10)
        tapd.id_print(jnp.array([True, False]) ^ (i % 2 == 0), output_stream=stream)
        odd = jnp.array([1e8, 0.0, jnp.nan, -jnp.inf], jnp.float32)
        tapd.id_print(odd + i * 1e-9, what="odd", output_stream=stream)
        return i + 1

    alone = jax.jit(
        lambda x: tapd.id_print(x / 4, result=x + 1, what="alone", output_stream=stream)
    )
    i = jnp.int32(0)
    for _ in range(int(count)):
        i = step(i)
    x = jnp.arange(4.0)
    done = 0
    while done < (100 if rounds == "until-worker" else int(rounds)):
        for _ in range(int(count)):
            x = alone(x)
        tapd.barrier_wait()
        done += 1
        if rounds == "until-worker" and tapd.stats()["local"]["printed_by_worker"]:
            break
    worker = _print_worker()
    return {"lines": stream.lines, "stats": tapd.stats()["local"], "worker": worker, "rounds": done}


def _print_worker() -> int | None:
    """The pid of this process's print worker, if it has one."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, ValueError):
            continue
        if ppid == os.getpid() and b"tapd.print_worker" in command:
            return int(entry)
    return None


def print_worker_killed(count: str) -> dict[str, Any]:
    """A loop of id_prints whose print worker is killed half way: every line is
    printed, in order (rendered here from then on)."""
    stream = _Lines()
    alone = jax.jit(lambda x: tapd.id_print(x, output_stream=stream) + 1)
    x = jnp.float32(0)
    for _ in range(int(count)):
        x = alone(x)
    tapd.barrier_wait()
    worker = _print_worker()
    if worker is not None:
        os.kill(worker, signal.SIGKILL)
    for _ in range(int(count)):
        x = alone(x)
    tapd.barrier_wait()
    return {"lines": stream.lines, "stats": tapd.stats()["local"], "killed": worker}


SCENARIOS = {
    "gathering": gathering,
    "gathering_after_idle_waits": gathering_after_idle_waits,
    "debug_runs": debug_runs,
    "debug_failures": debug_failures,
    "interleaved": interleaved,
    "printing": printing,
    "print_worker_killed": print_worker_killed,
    "order": order,
    "flood": flood,
    "barrier_in_flight": barrier_in_flight,
    "effects_barrier_without_install": effects_barrier_without_install,
    "effects_barrier_raising": effects_barrier_raising,
    "exit_drain": exit_drain,
    "exit_stuck": exit_stuck,
    "raising": raising,
    "stuck": stuck,
    "eager_and_print": eager_and_print,
    "mixed": mixed,
}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps({"pid": os.getpid(), **result}, default=str), flush=True)
