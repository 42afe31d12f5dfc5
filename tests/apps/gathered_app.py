"""A JAX process for tests/test_gathered.py: the same programs under TAPD_GATHER=off
(one host callback a tap, the reference) and under TAPD_GATHER=on (the gathered path,
tapd/emitter/gathered/), on the portable backend (TAPD_BACKEND=portable).

`python gathered_app.py local CASE...` runs each case (tap functions of this process:
id_tap closures, tapd.debug, id_print) and prints one JSON line last: per case the
calls its tap functions got, in the order they ran, what it returned, and the flushes
the gathered path made (how many records each). `named PREFIX` taps named consumers
(`PREFIX:...`) for a subscriber in another process; `flood PREFIX COUNT KIB` taps
COUNT steps of KIB KiB each; `drop COUNT` fills a small local ring. With
GATHERED_EXIT_FILE set, GATHERED_EXIT_TAPS slow taps are then left to the exit drain.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax._src import pjit
from jax.experimental import io_callback

import tapd
import tapd.debug
from tapd.emitter.gathered import host as gathered_host

# ---- what the gathered path's flushes did (white-box: the path is really taken) -------

FLUSHES: list[int] = []  # records per flush, in order
_flush_write = gathered_host.Flush.write_packed


def _counted_flush(self: Any, packed: Any) -> None:
    """Every flush: a host callback's, and the end of a computation that comes out as
    an output (tapd.emitter.taps_as_outputs)."""
    FLUSHES.append(self.records(packed)[0])
    _flush_write(self, packed)


gathered_host.Flush.write_packed = _counted_flush  # type: ignore[method-assign]

# ---- tap functions of this process -------------------------------------------------------

CALLS: list[Any] = []  # [tag, value] per call, in the order the receiver ran them
_NOTES: dict[str, Callable[..., None]] = {}


def described(x: Any) -> Any:
    """A leaf as JSON, exactly: [dtype, shape, values]."""
    a = np.asarray(x)
    if a.dtype == ml_dtypes.bfloat16:
        values = a.astype(np.float32).tolist()
    elif np.iscomplexobj(a):
        values = np.stack([a.real, a.imag], -1).tolist()
    else:
        values = a.tolist()
    return [str(a.dtype), list(a.shape), values]


def plain(x: Any) -> Any:
    """A tapped value as JSON: a tree's leaves, each described, but for scalars of the
    common dtypes (int32, float32, bool), which are their value."""
    if isinstance(x, (tuple, list)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {str(k): plain(v) for k, v in x.items()}
    a = np.asarray(x)
    if a.ndim == 0 and a.dtype in (np.int32, np.float32, np.bool_):
        return a.item()
    return described(a)


def note(tag: str) -> Callable[..., None]:
    """The tap function of `tag` (one per tag, so that each is one site)."""
    if tag not in _NOTES:

        def called(arg: Any, transforms: Any) -> None:
            entry = [tag, plain(arg)]
            if transforms:
                entry.append([[name, _jsonable(params)] for name, params in transforms])
            CALLS.append(entry)

        called.__name__ = called.__qualname__ = f"note_{tag}"
        _NOTES[tag] = called
    return _NOTES[tag]


def _jsonable(params: Any) -> Any:
    return json.loads(json.dumps(params, default=list))


def T(tag: str, x: Any, **kwargs: Any) -> Any:
    return tapd.id_tap(note(tag), x, **kwargs)


# ---- the cases ------------------------------------------------------------------------

CASES: dict[str, Callable[[], Any]] = {}


def case(function: Callable[[], Any]) -> Callable[[], Any]:
    CASES[function.__name__] = function
    return function


def twice(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` jitted; under TAPD_GATHER=off also run as written under
    jax.disable_jit (host_callback's eager order, the reference): the calls of each, and
    the results."""
    jitted = jax.jit(function)(*args)
    tapd.barrier_wait()
    if os.environ.get("TAPD_GATHER") != "off":
        return {"result": plain(jitted)}
    compiled = list(CALLS)
    CALLS.clear()
    with jax.disable_jit():
        eager = function(*args)
    tapd.barrier_wait()
    reference = list(CALLS)
    CALLS.clear()
    CALLS.extend(compiled)
    return {"result": plain(jitted), "eager": reference, "eager_result": plain(eager)}


@case
def cond_with_jit() -> Any:
    """host_callback's tap_cond (with_jit): `1, 2, cond_f, end`."""

    def func(x: Any) -> Any:
        x1 = T("1", x)
        x2 = T("2", x1 + 1)
        x4 = lax.cond(
            x % 2 == 0, lambda x: T("cond_t", x), lambda x: T("cond_f", -1, result=x), x2 + 1
        )
        return T("end", x4 + 1)

    return twice(func, 1)


@case
def across_computations() -> Any:
    """Computations dispatched back to back, no barrier between: some end with their
    taps as an output (few taps), one flushes inside its loop (a while loop: unbounded),
    one keeps a host callback a tap (a strict tap). On one device, their taps must run
    in the order the calls were made (two devices run side by side: no order between
    them)."""
    few = jax.jit(lambda x: T("few_b", T("few_a", x) + 1))
    looping = jax.jit(lambda x: lax.while_loop(lambda v: v < x + 5, lambda v: T("loop", v + 1), x))
    strict = jax.jit(lambda x: T("strict", x, ordered="strict") + 1)
    x = jnp.int32(0)
    for k in range(4):
        few(x + 100 * k)
        looping(x + 100 * k)
        strict(x + 100 * k)
        few(x + 100 * k + 50)
    return {}


@case
def while_cond() -> Any:
    """host_callback's tap_while_cond: taps in a while body, around a cond."""

    def func(x: Any) -> Any:
        x2 = T("2", T("1", x) + 1)

        def body(x: Any) -> Any:
            x3 = T("w_b_1", x)
            x4 = lax.cond(
                x % 2 == 0, lambda x: T("w_b_t", x), lambda x: T("w_b_f", -1, result=x), x3 + 1
            )
            return T("w_b_2", x4)

        return T("end", lax.while_loop(lambda x: x <= 3, body, x2))

    return twice(func, 1)


@case
def nested() -> Any:
    """cond in scan in while, a fori_loop in a branch, a jit in a jit, taps before,
    between and after the loops; a dynamic trip count."""

    @jax.jit
    def inner(v: Any) -> Any:
        return T("inner_jit", v * 2) + 1

    def func(n: Any) -> Any:
        n = T("before", n)

        def scan_body(acc: Any, k: Any) -> Any:
            acc = T("s", acc + k)
            acc = lax.cond(
                k % 2 == 0,
                lambda a: lax.fori_loop(0, 3, lambda j, b: T("f", b + j), T("even", a)),
                lambda a: inner(a),
                acc,
            )
            return acc, T("y", k * 10)

        def while_body(carry: Any) -> Any:
            i, acc = carry
            i = T("w", i + 1)
            acc, ys = lax.scan(scan_body, acc, jnp.arange(4) + i)
            return i, acc + ys.sum()

        i, acc = lax.while_loop(lambda c: c[0] < n, while_body, (0, n))
        between = T("between", acc - i)
        total = lax.fori_loop(0, 5, lambda j, t: T("after_loop", t + j), between)
        return T("end", total)

    return twice(func, 3)


@case
def scan_counts() -> Any:
    """1000 steps, a tap of a pair every step and one every third (in a cond): exact
    values, exact counts; a reverse scan; an unrolled one of an odd length."""

    def body(c: Any, k: Any) -> Any:
        T("pair", (k, k * 2))
        c = lax.cond(k % 3 == 0, lambda v: T("third", v + k), lambda v: v, c)
        return c + 1, k

    forward = jax.jit(lambda xs: lax.scan(body, 0, xs))(jnp.arange(1000))
    rev = jax.jit(lambda xs: lax.scan(lambda c, k: (T("rev", c + k), k), 0, xs, reverse=True))(
        jnp.arange(23)
    )
    unrolled = jax.jit(
        lambda xs: lax.scan(lambda c, k: (T("unrolled", c * 2 + k), k), 0, xs, unroll=3)
    )(jnp.arange(10))
    return {"result": plain([forward[0], rev[0], unrolled[0]])}


@case
def zero_length_and_dynamic_loops() -> Any:
    """A scan of no steps, a while of none, a fori_loop with dynamic bounds."""

    def func(n: Any) -> Any:
        x = T("a", n)
        x = lax.while_loop(lambda c: c < 0, lambda c: T("never_w", c + 1), x)
        x = lax.fori_loop(0, n, lambda j, c: T("dyn", c + j), x)
        return T("z", x)

    def empty_scan(n: Any) -> Any:  # (not run under disable_jit: JAX refuses it there)
        return T("b", lax.scan(lambda c, k: (T("never", c + k), k), T("a", n), jnp.arange(0))[0])

    def empty_scan_of_a_loop(n: Any) -> Any:
        # (issue 49: its taps were counted 0 x inf, NaN, and the computation not gathered)
        def body(c: Any, k: Any) -> Any:
            return lax.while_loop(lambda c: c < 3, lambda c: T("never_in_while", c + 1), c), k

        return lax.scan(body, T("a", n), jnp.arange(0))[0]

    got = twice(func, 11)
    got["empty_scan"] = plain(jax.jit(empty_scan)(3))
    got["empty_scan_of_a_loop"] = plain(jax.jit(empty_scan_of_a_loop)(0))
    return got


@case
def beside_jax_ordered_effects() -> Any:
    """Taps in a computation that also threads JAX's runtime token (an ordered
    io_callback, in a scan and outside): each kind in its order, the results right."""

    def io(tag: str) -> Callable[[Any], None]:
        return lambda v: CALLS.append([tag, int(v)])

    def func(x: Any) -> Any:
        x = T("first", x)
        io_callback(io("io_first"), None, x, ordered=True)

        def body(c: Any, k: Any) -> Any:
            c = T("loop", c + k)
            io_callback(io("io_loop"), None, c, ordered=True)
            return c, None

        return T("last", lax.scan(body, x, jnp.arange(5))[0])

    return {"result": [plain(jax.jit(func)(x)) for x in (1, 2)]}


@case
def taps_in_a_loop_condition() -> Any:
    """A tap in a while loop's condition: not gathered (per-tap path), same order."""

    def func(x: Any) -> Any:
        x = T("1", x)
        x = lax.while_loop(lambda v: T("w_p", v < 3), lambda v: T("w_b", v + 1), x)
        return T("3", x)

    return twice(func, 1)


@case
def one_site_two_shapes() -> Any:
    """One site tapped with a scalar and with a vector: not gathered, same calls."""
    same = note("shapes")

    def func(x: Any) -> Any:
        x = tapd.id_tap(same, x)
        v = tapd.id_tap(same, jnp.stack([x, x + 1]))
        return lax.scan(lambda c, k: (tapd.id_tap(same, c + k), k), v.sum(), jnp.arange(3))[0]

    return twice(func, 1)


@case
def vmapped() -> Any:
    """vmap: one call per batched tap, with the batch dims; in a scan; in a while whose
    predicate is batched; nested vmaps."""

    def power3(x: Any) -> Any:
        y = x * x
        T("x,x^2", (x, y))
        return y * x

    def loop(x: Any) -> Any:
        x = lax.while_loop(lambda v: v < 3, lambda v: T("vwhile", v + 1), T("before", x))
        return lax.scan(lambda c, k: (T("vscan", c + k), k), x, jnp.arange(3))[0]

    a = jax.jit(jax.vmap(power3))(jnp.array([2.0, 3.0]))
    b = jax.jit(jax.vmap(loop))(jnp.arange(5))
    c = jax.jit(jax.vmap(jax.vmap(lambda v: T("vv", v + 1))))(jnp.arange(6).reshape(2, 3))
    return {"result": plain([a, b, c])}


@jax.custom_jvp
def print_tangents(arg: Any) -> Any:
    return arg


@print_tangents.defjvp
def print_tangents_jvp(primals: Any, tangents: Any) -> Any:
    T("tangents", tangents[0])
    return primals[0], tangents[0]


@jax.custom_vjp
def print_cotangents(arg: Any) -> Any:
    return arg


print_cotangents.defvjp(
    lambda arg: (print_cotangents(arg), None),
    lambda residual, ct: (T("cotangents", ct),),
)


@case
def grads() -> Any:
    """grad: primal taps once; the transpose tap of a custom_jvp tangent; a custom_vjp
    cotangent; taps in a scan's forward and (reversed) backward passes; remat."""

    def power3(x: Any) -> Any:
        y = x * x
        T("x,x^2", (x, y))
        return y * x

    def with_tangents(x: Any) -> Any:
        y = x * x
        T("x,x^2", (x, y))
        print_tangents((x, y))
        return y * x

    def with_cotangents(x: Any) -> Any:
        y = x * x
        T("x,x^2", (x, y))
        x1, y1 = print_cotangents((x, y))
        return y1 * x1

    def scanned(x: Any) -> Any:
        def body(c: Any, k: Any) -> Any:
            c = T("fwd", jnp.sin(c) + k)
            c = print_tangents(print_cotangents(c))
            return c, None

        return lax.scan(body, x, jnp.arange(6.0))[0]

    def remat(x: Any) -> Any:
        return power3(jax.checkpoint(power3)(x))

    out = [
        jax.jit(jax.grad(power3))(3.0),
        jax.jit(jax.grad(with_tangents))(3.0),
        jax.jit(jax.grad(with_cotangents))(3.0),
        jax.jit(jax.grad(scanned))(0.5),
        jax.jit(jax.grad(remat))(3.0),
        jax.jit(jax.vmap(jax.grad(with_cotangents)))(jnp.array([2.0, 3.0])),
    ]
    return {"result": plain(out)}


@case
def dtypes_and_shapes() -> Any:
    """Zero-size arrays, bool, int8, uint16, bfloat16, float16, complex, scalars, a
    high-rank array, a numpy constant closed over, in a scan."""
    table = np.arange(60, dtype=np.float32).reshape(3, 4, 5)  # a constant of the jaxpr

    def body(c: Any, k: Any) -> Any:
        T("empty", jnp.zeros((0, 3), jnp.float32) + k)
        T("empty_int", jnp.zeros((2, 0), jnp.int8))
        T("bool", jnp.array([True, False]) ^ (k % 2 == 0))
        T("int8", (jnp.arange(4, dtype=jnp.int8) * 60 + k.astype(jnp.int8)))
        T("uint16", jnp.uint16(65535) - k.astype(jnp.uint16))
        T("bf16", jnp.array([1.5, -2.25], jnp.bfloat16) * (k + 1).astype(jnp.bfloat16))
        T("f16", jnp.float16(0.1) * k)
        T("c64", jnp.array([1 + 2j, -3j], jnp.complex64) * k)
        T("scalar", k)
        T("rank3", jnp.asarray(table) + k)
        return c + 1, k

    lax.scan(body, 0, jnp.arange(3))
    jax.jit(lambda: lax.scan(body, 0, jnp.arange(3)))()
    return {}


@case
def tiled_vectors() -> Any:
    """Vectors of whole TPU tiles, which the gathered path stores as [n / 128, 128]
    (gathered.rewrite.stored_shape), beside near misses and a rank-2 tap it stores as
    they are: in a scan, a while loop and a cond, each tap its own values a step."""

    def tapped(k: Any) -> None:
        power = lax.shift_left(jnp.int32(1), k).astype(jnp.float32)  # (2**k, exactly)
        T("f32_1024", jnp.arange(1024, dtype=jnp.float32) * 0.5 + k)
        T("f32_1152", jnp.arange(1152, dtype=jnp.float32) - k)
        T("bf16_4096", ((jnp.arange(4096) % 128) * power).astype(jnp.bfloat16))
        T("int8_8192", (jnp.arange(8192) % 251 + k).astype(jnp.int8))
        T("bool_4096", jnp.arange(4096) % 3 == k % 3)
        T("u16_2048", (jnp.arange(2048) * 31 + k).astype(jnp.uint16))
        T("c64_1024", (jnp.arange(1024) + 1j * k).astype(jnp.complex64))
        T("f32_8x128", jnp.ones((8, 128), jnp.float32) * k)

    def scan_body(c: Any, k: Any) -> Any:
        tapped(k)
        return c + 1, k

    def while_body(k: Any) -> Any:
        tapped(k)
        return k + 1

    jax.jit(lambda: lax.scan(scan_body, 0, jnp.arange(3)))()
    jax.jit(lambda: lax.while_loop(lambda k: k < 2, while_body, 0))()
    jax.jit(lambda p: lax.cond(p > 0, tapped, lambda _: None, p))(jnp.int32(5))
    return {}


@case
def many_leaves_and_sites() -> Any:
    """A tap of a tree of 100 leaves of mixed shapes and dtypes, and 20 sites in one
    loop body: every leaf, every site, in order."""

    def tree(k: Any) -> Any:
        return {
            f"leaf{i:03d}": (jnp.arange(i % 4 + 1, dtype=jnp.float32) + k)
            if i % 3
            else (k * i).astype(jnp.int16)
            for i in range(100)
        }

    def body(c: Any, k: Any) -> Any:
        T("tree", tree(k))
        for s in range(20):
            c = T(f"site{s:02d}", c + s)
        return c, k

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(4)))()
    return {}


@case
def long_loops() -> Any:
    """100 000 steps of a scan and of a while loop, a small tap each: every value, once,
    in order (summarized: a tap function that counts)."""
    seen: dict[str, list[int]] = {"scan": [], "while": []}
    scan_fn = lambda v, t: seen["scan"].append(int(v))  # noqa: E731
    while_fn = lambda v, t: seen["while"].append(int(v))  # noqa: E731
    n = 100_000

    def scan_body(c: Any, k: Any) -> Any:
        return tapd.id_tap(scan_fn, k, result=c + 1), None

    def while_body(i: Any) -> Any:
        return tapd.id_tap(while_fn, i) + 1

    a = jax.jit(lambda: lax.scan(scan_body, 0, jnp.arange(n))[0])()
    b = jax.jit(lambda m: lax.while_loop(lambda i: i < m, while_body, 0))(n)
    tapd.barrier_wait()

    def summary(values: list[int]) -> Any:
        return [len(values), values == list(range(n))]

    return {"result": plain([a, b]), "scan": summary(seen["scan"]), "while": summary(seen["while"])}


@case
def exceptions() -> Any:
    """A tap function that raises at one step: the next barrier raises
    CallbackException naming it; every other tap ran; the next computation too."""

    def fails(arg: Any, transforms: Any) -> None:
        if int(arg) == 5:
            raise ValueError(f"deliberate failure at {int(arg)}")
        CALLS.append(["fails", int(arg)])

    def body(c: Any, k: Any) -> Any:
        T("before", k)
        tapd.id_tap(fails, k)
        return c, T("after", k)

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(8)))()
    raised = None
    try:
        tapd.barrier_wait()
    except tapd.CallbackException as exc:
        raised = str(exc)
    jax.jit(lambda x: T("next", x))(1)
    tapd.barrier_wait()
    return {"raised": raised is not None and "ValueError: deliberate failure at 5" in raised}


@case
def barriers() -> Any:
    """A slow tap function: once tapd.barrier_wait() (or jax.effects_barrier()) returns,
    every tap dispatched before it has run."""
    ran: list[int] = []

    def slow(arg: Any, transforms: Any) -> None:
        time.sleep(0.002)
        ran.append(int(arg))

    step = jax.jit(lambda xs: lax.scan(lambda c, k: (tapd.id_tap(slow, k, result=c), k), 0, xs))
    counts = []
    for barrier in (tapd.barrier_wait, jax.effects_barrier):
        step(jnp.arange(30))
        step(jnp.arange(30, 50))
        barrier()
        counts.append(list(ran))
        ran.clear()
    return {"counts": counts}


@case
def debug_and_print() -> Any:
    """tapd.debug.callback and tapd.debug.print, then jax.debug.print and
    jax.debug.callback under install_debug, and id_print to a stream, in loops."""
    tapd.install_debug()
    written: list[str] = []

    class Stream:
        def write(self, text: str) -> None:
            written.append(text)

    def body(c: Any, k: Any) -> Any:
        tapd.debug.callback(lambda v: CALLS.append(["tapd.debug", int(v)]), k)
        tapd.debug.print("DBG tapd k={k} c={c}", k=k, c=c)
        jax.debug.print("DBG jax k={}", k)
        jax.debug.callback(lambda v: CALLS.append(["jax.debug", int(v)]), k * 2)
        c = tapd.id_print(c + k, what="c", output_stream=Stream())
        return c, None

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(5)))()
    jax.effects_barrier()
    tapd.barrier_wait()
    return {"written": written}


@case
def placement() -> Any:
    """A jit on the second device is gathered and its taps say so; a tap inside shard_map
    over both devices (gathered on each) taps every shard."""
    devices = jax.devices()
    on_second = jax.device_put(jnp.arange(3), devices[1])

    def at_device(arg: Any, transforms: Any, *, device: Any) -> None:
        CALLS.append(["device", plain(arg), str(device)])

    jax.jit(lambda x: tapd.id_tap(at_device, x * 2, tap_with_device=True))(on_second)
    tapd.barrier_wait()
    device_calls = list(CALLS)
    CALLS.clear()
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
    spec = jax.sharding.PartitionSpec("d")

    def per_shard(x: Any) -> Any:
        return lax.scan(lambda c, k: (T("shard", c + k), k), x, jnp.arange(2))[0]

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec))
    out = sharded(jnp.arange(4))
    tapd.barrier_wait()
    shard_calls = sorted(CALLS, key=lambda c: json.dumps(c))
    CALLS.clear()
    return {"device": device_calls, "shards": shard_calls, "result": plain(out)}


_PYTHON_DISPATCHES = [0]
_python_dispatch = pjit._pjit_call_impl_python


def _counted_dispatch(*args: Any, **kwargs: Any) -> Any:
    _PYTHON_DISPATCHES[0] += 1
    return _python_dispatch(*args, **kwargs)


pjit._pjit_call_impl_python = _counted_dispatch


def _callbacks(lowered: Any) -> int:
    return int(lowered.as_text().count("python_cpu_callback"))


@case
def lowered() -> Any:
    """How many host callbacks each computation's HLO holds; what jax.export says."""

    def few(x: Any) -> Any:
        for i in range(5):
            x = T(f"few{i}", x + 1)
        return lax.scan(lambda c, k: (T("fs", c + k), T("fs2", k)), x, jnp.arange(3))[0]

    def long(x: Any) -> Any:
        return lax.scan(lambda c, k: (T("l1", c + k), T("l2", k)), x, jnp.arange(1000))[0]

    def long_work(x: Any) -> Any:  # (a matmul of 1024² a step: estimated long, so paced)
        w = jnp.ones((1024, 1024), jnp.float32)
        body = lambda c, k: (jnp.tanh(c @ w), T("lw", k))  # noqa: E731
        return lax.scan(body, w, jnp.arange(1000))[0]

    def two_shapes(x: Any) -> Any:
        same = note("shapes2")
        return tapd.id_tap(same, jnp.stack([tapd.id_tap(same, x), x]))[0]

    def strict(x: Any) -> Any:
        return T("strict_b", T("strict_a", x, ordered="strict") + 1)

    def in_condition(x: Any) -> Any:
        return lax.while_loop(lambda v: T("cond_p", v < 3), lambda v: T("cond_b", v + 1), x)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    sharded = jax.shard_map(lambda x: T("sm", x + 1), mesh=mesh, in_specs=spec, out_specs=spec)

    def big(steps: int) -> Callable[[Any], Any]:  # (1 MiB a tap: lowered, never run)
        return lambda x: lax.fori_loop(0, steps, lambda i, v: T("big", v + 1.0), x)

    row = jnp.zeros(2**18, jnp.float32)
    counts = {
        "big9": _callbacks(jax.jit(big(9)).lower(row)),
        "big17": _callbacks(jax.jit(big(17)).lower(row)),
        "big129": _callbacks(jax.jit(big(129)).lower(row)),
        "few": _callbacks(jax.jit(few).lower(1)),
        "long": _callbacks(jax.jit(long).lower(1)),
        "long_work": _callbacks(jax.jit(long_work).lower(1)),
        "two_shapes": _callbacks(jax.jit(two_shapes).lower(1)),
        "strict": _callbacks(jax.jit(strict).lower(1)),
        "in_condition": _callbacks(jax.jit(in_condition).lower(1)),
        "shard_map": _callbacks(jax.jit(sharded).lower(jnp.arange(4))),
    }
    results = [plain(jax.jit(f)(1)) for f in (few, long, two_shapes, strict, in_condition)] + [
        plain(jax.jit(sharded)(jnp.arange(4)))
    ]
    # A gathered step keeps JAX's C++ dispatch path as an unordered tap does: how many of
    # 20 calls (after two) went through JAX's Python dispatch.
    step = jax.jit(few)
    x = step(step(1))
    python_calls = _PYTHON_DISPATCHES[0]
    for _ in range(20):
        x = step(x)
    counts["python_dispatches"] = _PYTHON_DISPATCHES[0] - python_calls
    tapd.barrier_wait()
    called = sorted({c[0] for c in CALLS})
    counted = {tag: sum(c[0] == tag for c in CALLS) for tag in called}
    CALLS.clear()
    return {"callbacks": counts, "result": results, "counted": counted, "exported": exported(few)}


def exported(function: Callable[..., Any]) -> str:
    """What jax.export makes of `function` (never gathered): here, its refusal."""
    try:
        jax.export.export(jax.jit(function))(1)
    except Exception as exc:  # what the refusal says, whatever it is
        return f"{type(exc).__name__}: {exc}"
    return "exported"


def run_local(names: list[str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in names:
        CALLS.clear()
        FLUSHES.clear()
        started = time.perf_counter()
        try:
            got = CASES[name]() or {}
            tapd.barrier_wait()
            got["calls"] = list(CALLS)
        except Exception as exc:
            got = {"error": "".join(traceback.format_exception(exc))[-4000:]}
        got["flushes"] = list(FLUSHES)
        got["seconds"] = round(time.perf_counter() - started, 3)
        results[name] = got
    return results


# ---- named consumers, for a subscriber in another process ---------------------------


def named(prefix: str) -> dict[str, Any]:
    """Named taps with steps, in loops and branches, of several dtypes, sampled, batched,
    on the second device: what a subscriber gets must not depend on TAPD_GATHER."""

    def tap(x: Any, name: str, **kwargs: Any) -> Any:
        return tapd.tap(x, f"{prefix}:{name}", **kwargs)

    def body(i: Any, c: Any) -> Any:
        c = tap(c + i, "loop", step=i)
        c = lax.cond(i % 4 == 0, lambda v: tap(v * 2, "cond", step=i, note="n"), lambda v: v, c)
        tap(i, "sampled", every=3)
        return c

    def while_body(carry: Any) -> Any:
        k, acc = carry
        tap({"k": k, "acc": acc, "v": jnp.full((2, 2), k, jnp.bfloat16)}, "tree", step=k)
        return k + 1, acc * 2

    def program(x: Any) -> Any:
        x = tap(x, "first", step=0)
        x = lax.fori_loop(0, 50, body, x)
        k, acc = lax.while_loop(lambda c: c[0] < 7, while_body, (0, x))
        tap(jnp.zeros((0, 2), jnp.int8), "empty", step=k)
        tap({"flags": jnp.array([True, False]), "small": jnp.arange(3, dtype=jnp.int8) * k},
            "mixed", step=k)  # fmt: skip
        return tap(acc, "last", step=k)

    out = jax.jit(program)(1)
    jax.jit(jax.vmap(lambda v: tap(v * 3, "batched")))(jnp.arange(4.0))
    on_second = jax.device_put(jnp.arange(2.0), jax.devices()[1])
    jax.jit(lambda v: tap(v + 1, "second_device", step=5))(on_second)
    tapd.barrier_wait()
    refused = exported(lambda v: tap(v, "exported") + 1)
    return {
        "result": float(out),
        "flushes": list(FLUSHES),
        "stats": tapd.stats(),
        "exported": refused,
    }


def flood(prefix: str, count: str, kib: str) -> dict[str, Any]:
    """`count` steps of a scan tapping `kib` KiB each, for a slow subscriber."""
    size = int(kib) * 256

    def body(c: Any, k: Any) -> Any:
        tapd.tap(jnp.full(size, k, jnp.float32), f"{prefix}:big", step=k)
        return c, None

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(int(count))))()
    tapd.barrier_wait(timeout=60)
    return {"flushes": list(FLUSHES), "stats": tapd.stats()}


def _slow_taps(count: int, function: Callable[..., None]) -> None:
    """`count` 4 KiB taps of one scan to `function`, which takes a millisecond each."""

    def slow(arg: Any, transforms: Any) -> None:
        time.sleep(0.001)
        function(int(arg[0]))

    def body(c: Any, k: Any) -> Any:
        return tapd.id_tap(slow, jnp.full(1024, k, jnp.float32), result=c), k

    jax.jit(lambda: lax.scan(body, 0, jnp.arange(count)))()


def drop(count: str) -> dict[str, Any]:
    """`count` taps into a small ring (TAPD_BUFFER_BYTES) under TAPD_EMITTER_POLICY."""
    ran: list[int] = []
    _slow_taps(int(count), ran.append)
    tapd.barrier_wait(timeout=60)
    return {"ran": ran, "stats": tapd.stats(), "flushes": list(FLUSHES)}


def left_to_exit(count: int, path: str) -> None:
    """`count` slow taps that only the exit drain runs: each appends its value to `path`."""

    def write(value: int) -> None:
        with open(path, "a") as out:
            out.write(f"{value}\n")

    _slow_taps(count, write)


def main() -> None:
    scenario, *args = sys.argv[1:]
    if scenario == "local":
        output: dict[str, Any] = {"cases": run_local(args or list(CASES))}
    elif scenario == "named":
        output = named(*args)
    elif scenario == "flood":
        output = flood(*args)
    elif scenario == "drop":
        output = drop(*args)
    else:
        raise SystemExit(f"no scenario {scenario!r}")
    output["gather"] = os.environ.get("TAPD_GATHER", "")
    print(json.dumps(output), flush=True)
    if exit_file := os.environ.get("GATHERED_EXIT_FILE"):
        left_to_exit(int(os.environ.get("GATHERED_EXIT_TAPS", "100")), exit_file)


if __name__ == "__main__":
    main()
