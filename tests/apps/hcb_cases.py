"""host_callback's tap test matrix, run against `import tapd as hcb` in a real JAX process.

`python hcb_cases.py CASE...` runs each case in turn and appends one JSON line per case
to $HCB_RESULTS: {"case", "status" ("ok", "error" or "skip"), "values", "output",
"error", "traceback"}. tests/test_host_callback_compat.py holds the expectations.

The cases are those of jax's `tests/host_callback_test.py` (class HostCallbackTapTest,
last full version, jax commit 2228115cf4), with the tap functions written two ways,
chosen by $HCB_MODE:

- `closure`: as host_callback's tests wrote them. `id_print(..., output_stream=STREAM)`
  and closures that write to STREAM run in this process; `output` is what STREAM got.
- `module`: the same functions at the top level of tests/apps/hcb_funcs.py, run in
  subscriber processes (`tapd subscribe hcb_funcs`, `tapd subscribe tapd.printing`)
  whose stdout goes to $HCB_FUNCS_LOG and $HCB_PRINT_LOG; `output` is what they
  printed for this case.

Every case ends with `barrier_wait` (host_callback's tests did so in tearDown) before its
output is taken. Run with 2 host devices (XLA_FLAGS), as host_callback's tests were.

With HCB_IMPL=jax (and HCB_MODE=closure) the cases run against the real
`jax.experimental.host_callback` of jax <= 0.4.30 instead: tests/apps/hcb_validate.py
checks the expectations that way.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if os.environ.get("HCB_IMPL") == "jax":
    # Validation of the expectations: run the closure cases against the real
    # host_callback (jax <= 0.4.30, legacy mode), no daemon needed.
    from jax.experimental import host_callback as hcb
else:
    import tapd as hcb

sys.path.insert(0, str(Path(__file__).parent))
import hcb_funcs as funcs
from hcb_funcs import describe

MODE = os.environ.get("HCB_MODE", "closure")
BARRIER_TIMEOUT = float(os.environ.get("HCB_BARRIER_TIMEOUT", "20"))
CASE_TIMEOUT = float(os.environ.get("HCB_CASE_TIMEOUT", "90"))


class Skip(Exception):
    """The case cannot run here (e.g. JAX itself refuses the program)."""


class TestingOutputStream:
    """host_callback's `_TestingOutputStream`: `output_stream` for `id_print`."""

    def __init__(self) -> None:
        self._output: list[str] = []

    def write(self, what: str) -> None:
        self._output.append(what)

    def __str__(self) -> str:
        return "TestingOutputStream"

    def take(self) -> str:
        text, self._output = "".join(self._output), []
        return text


STREAM = TestingOutputStream()


class SubscriberLogs:
    """What the module-mode subscribers printed since the last `take`."""

    def __init__(self) -> None:
        self.paths = [Path(os.environ[v]) for v in ("HCB_PRINT_LOG", "HCB_FUNCS_LOG")]
        self.offsets = [p.stat().st_size if p.exists() else 0 for p in self.paths]

    def take(self) -> str:
        parts = []
        for i, path in enumerate(self.paths):
            with open(path, "rb") as f:
                f.seek(self.offsets[i])
                data = f.read()
            self.offsets[i] += len(data)
            parts.append(data.decode())
        return "".join(parts)


LOGS = SubscriberLogs() if MODE == "module" else None


def barrier_wait() -> None:
    if hcb.__name__ == "tapd":
        hcb.barrier_wait(timeout=BARRIER_TIMEOUT)
    else:
        hcb.barrier_wait()


def take() -> str:
    """barrier_wait, then the output tap functions produced since the last take."""
    barrier_wait()
    return LOGS.take() if LOGS is not None else STREAM.take()


def pick(closure: Callable[..., Any], module_function: Callable[..., Any]) -> Any:
    """The tap function of this mode: the closure as host_callback's test wrote it, or its
    module-level twin in hcb_funcs."""
    return closure if MODE == "closure" else module_function


def pr(arg: Any, **kwargs: Any) -> Any:
    """`hcb_id_print(..., output_stream=testing_stream)` of host_callback's tests."""
    if MODE == "closure":
        kwargs["output_stream"] = STREAM
    return hcb.id_print(arg, **kwargs)


def maybe_print(do_print: bool, arg: Any, what: str, tap_with_device: bool = False,
                device_index: int = 0) -> Any:  # fmt: skip
    if do_print:
        return pr(arg, what=what, tap_with_device=tap_with_device, device_index=device_index)
    return arg


def fun1(a: Any) -> Any:
    y = pr(a * 2.0, what="a * 2")
    y = pr(y * 3.0, what="y * 3", result=y)
    return y**2


def local_devices() -> list[Any]:
    return jax.local_devices()[:2]


def tolist(x: Any) -> Any:
    return np.asarray(x).tolist()


CASES: dict[str, Callable[[], dict[str, Any] | None]] = {}


def case(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        CASES[name or fn.__name__] = fn
        return fn

    return register


def variants(base: str, **options: list[Any]) -> Callable[[Callable[..., Any]], Any]:
    """Register `fn` once per combination of keyword values, as `base[k=v,...]`."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        combos: list[dict[str, Any]] = [{}]
        for key, values in options.items():
            combos = [{**c, key: v} for c in combos for v in values]
        for combo in combos:
            label = ",".join(f"{k}={v}" for k, v in combo.items())
            CASES[f"{base}[{label}]"] = functools.partial(fn, **combo)
        return fn

    return register


# ---- eager and jit -------------------------------------------------------------------


@case()
def tap_eval() -> dict[str, Any]:
    return {"result": float(fun1(5.0))}


@case()
def tap_with_tuple_results() -> dict[str, Any]:
    def func2(x: Any) -> Any:
        x1, y1 = pr((x * 2.0, x * 3.0))
        return x1 + y1

    return {"result": float(func2(3.0))}


@case()
def tap_with_dict_results() -> dict[str, Any]:
    def func2(x: Any) -> Any:
        res = pr(dict(a=x * 2.0, b=x * 3.0))
        return res["a"] + res["b"]

    return {"result": float(func2(3.0))}


@case()
def tap_with_result() -> dict[str, Any]:
    def func2(x: Any) -> Any:
        return pr((x * 2.0, x * 3.0), result=x * 4.0)

    return {"result": float(func2(3.0))}


@case()
def tap_with_result_no_arg() -> dict[str, Any]:
    def tap_func(arg: Any, transforms: Any) -> None:
        STREAM.write(f"called tap_func with {arg}")

    f = pick(tap_func, funcs.called_tap_func)
    return {"result": float(hcb.id_tap(f, None, result=3.0))}


@case()
def tap_result_unused() -> dict[str, Any]:
    def tap_func(arg: Any, transforms: Any) -> None:
        STREAM.write(f"called tap_func with {arg}")

    def func2(x: Any) -> Any:
        hcb.id_tap(pick(tap_func, funcs.called_tap_func), None)
        return x

    return {"result": float(func2(3.0))}


@case()
def tap_with_device() -> dict[str, Any]:
    def func2(x: Any) -> Any:
        return pr((x * 2.0, x * 3.0), result=x * 4.0, tap_with_device=True)

    return {"result": float(func2(3.0))}


@case()
def tap_empty() -> None:
    pr(())
    pr((1.0, np.ones((2, 0))), what="second")


@case()
def tap_jit_simple() -> dict[str, Any]:
    jit_fun1 = jax.jit(lambda x: 3.0 * pr(2.0 * x, what="here"))
    return {"result": float(jit_fun1(5.0))}


@case()
def tap_jit_no_invars() -> dict[str, Any]:
    return {"result": tolist(jax.jit(lambda: pr(42))())}


@case()
def tap_jit_multiple_invars() -> dict[str, Any]:
    return {"result": tolist(jax.jit(lambda x1, x2: pr(x1 + x2))(40, 2))}


@case()
def tap_jit_constant() -> dict[str, Any]:
    return {"result": tolist(jax.jit(lambda x: pr(42, result=x))(5))}


def _sequence(x: Any) -> Any:
    x1 = pr(x, where="1")
    return pr(x1 + 1, where="2")


@case()
def tap_jit_sequence1() -> dict[str, Any]:
    return {"result": tolist(jax.jit(_sequence)(1))}


@case()
def tap_jit2() -> dict[str, Any]:
    return {"results": [tolist(jax.jit(_sequence)(1)), tolist(jax.jit(_sequence)(10))]}


@case()
def tap_jit_result_unused() -> dict[str, Any]:
    def func(x: Any) -> Any:
        pr(x, where="1")
        pr(x + 1, where="2")
        return x + 1

    return {"results": [tolist(jax.jit(func)(1)), tolist(jax.jit(func)(10))]}


@case()
def tap_jit_nested() -> dict[str, Any]:
    def func(x: Any) -> Any:
        x1 = pr(x, where="1")

        def func_nested(x: Any) -> Any:
            return pr(x + 1, where="nested")

        x3 = jax.jit(func_nested)(x1)
        return pr(x3 + 1, where="3")

    return {"result": tolist(jax.jit(func)(1))}


@case()
def tap_jit_devices() -> dict[str, Any]:
    """Running on multiple devices (jit(device=d) is gone: the argument is placed on d)."""

    def func(x: Any, device_id: int) -> Any:
        x1 = pr(x, dev=str(device_id))
        return pr(x1 + 1, dev=str(device_id))

    results = []
    for d in local_devices():
        x = jax.device_put(111, d)
        results.append(tolist(jax.jit(func, static_argnums=1)(x, d.id)))
    return {"results": results, "devices": len(local_devices())}


@variants("tap_pytree", with_jit=[True, False])
def tap_pytree(with_jit: bool) -> dict[str, Any]:
    def func(x: Any, what: str) -> Any:
        if what == "pair_1_x":
            return (1, x)
        if what == "pair_x_2x":
            return (x, 2 * x)
        return dict(a=2 * x, b=3 * x)

    def tap_func(a: Any, _: Any, *, what: str = "") -> None:
        STREAM.write(f"{what}: {describe(a)}\n")

    transform = jax.jit if with_jit else (lambda f: f)
    results = {}
    for what in ("pair_1_x", "pair_x_2x", "dict"):
        tap = pick(partial(tap_func, what=what), partial(funcs.tap_pytree, what=what))
        transformed = transform(
            lambda x, what=what, tap=tap: hcb.id_tap(tap, func(x, what), result=func(x * 2, what))
        )(5)
        results[what] = describe(transformed)
    return {"results": results}


@case()
def tap_multiple() -> None:
    """id_tap several times in sequence (host_callback skipped the concurrent form on CPU)."""

    def pause_tap(idx: Any, _: Any) -> None:
        time.sleep(0.1)
        STREAM.write(f"pause_tap {int(idx)}\n")

    tap = pick(pause_tap, funcs.pause_tap)
    for idx in range(5):
        jax.jit(lambda idx: hcb.id_tap(tap, idx))(idx)


@case()
def tap_jit_large() -> None:
    arg = jnp.arange(10000, dtype=jnp.int32).reshape((10, 10, 5, -1))
    jax.jit(pr)(arg)


@case()
def tap_jit_several_together() -> None:
    arg = jnp.arange(50, dtype=jnp.int32).reshape((10, 5))
    jax.jit(lambda x, y: pr((x, y, x * 2)))(arg, jnp.ones(100, dtype=jnp.int32))


@case()
def tap_jit_interleaving() -> dict[str, Any]:
    """Several jit's without data dependencies; they may interfere."""
    nr_arrays = 5

    def tap_func(arg: Any, _: Any) -> None:
        STREAM.write(f"tap {type(arg).__name__} {len(arg)}\n")

    tap = pick(tap_func, funcs.count_arrays)

    def func(x: Any, count: int) -> Any:
        for i in range(count):
            x = hcb.id_tap(tap, [x + i for i in range(nr_arrays)])[-1]
        return x

    x = jnp.array(1, dtype=np.int32)
    res = 0
    for _ in range(10):
        res += jax.jit(lambda x: func(x, 10))(x)
    return {"result": tolist(res)}


@case()
def tap_callback_delay_barrier() -> dict[str, Any]:
    """Two runs of one jit, each followed by barrier_wait: each run's output is complete
    at its barrier (host_callback's `callback_extra` delay is internal, left out)."""

    def func(x: Any) -> Any:
        for i in range(1, 4):
            x = pr(x * i, what=f"x times {i}")
        return x

    jax.jit(func)(np.arange(6, dtype=np.float32).reshape((2, 3)))
    first = take()
    jax.jit(func)(np.arange(6, dtype=np.float32).reshape((2, 3)))
    return {"first": first}


@case()
def tap_id_tap_removed_kwargs() -> dict[str, Any]:
    def func(x: Any, transforms: Any, y: Any) -> None:
        pass

    try:
        hcb.id_tap(pick(func, funcs.noop), 1, y=2)
    except TypeError as exc:
        return {"raised": "TypeError", "message": str(exc)}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


@case()
def api_names() -> dict[str, Any]:
    """The names host_callback code uses: CallbackException, its alias
    TapFunctionException, and id_tap/id_print's keywords."""
    import inspect

    exc = getattr(hcb, "CallbackException", None)
    return {
        "CallbackException": exc is not None and issubclass(exc, Exception),
        "alias": exc is not None and getattr(hcb, "TapFunctionException", None) is exc,
        "id_tap_params": sorted(inspect.signature(hcb.id_tap).parameters),
        "id_print_params": sorted(inspect.signature(hcb.id_print).parameters),
    }


# ---- control flow: order -------------------------------------------------------------


@variants("tap_cond", with_jit=[True, False])
def tap_cond(with_jit: bool) -> dict[str, Any]:
    def func(x: Any) -> Any:
        x1 = pr(x, where="1")
        x2 = pr(x1 + 1, where="2")
        x4 = lax.cond(x % 2 == 0,
                      lambda x: pr(x, where="cond_t"),
                      lambda x: pr(-1, where="cond_f", result=x),
                      x2 + 1)  # fmt: skip
        return pr(x4 + 1, where="end")

    transform = jax.jit if with_jit else (lambda f: f)
    return {"result": tolist(transform(func)(1))}


@variants("tap_while_cond", with_jit=[True, False])
def tap_while_cond(with_jit: bool) -> dict[str, Any]:
    def func(x: Any) -> Any:
        x1 = pr(x, where="1")
        x2 = pr(x1 + 1, where="2")

        def body(x: Any) -> Any:
            x3 = pr(x, where="w_b_1")
            x4 = lax.cond(x % 2 == 0,
                          lambda x: pr(x, where="w_b_t"),
                          lambda x: pr(-1, where="w_b_f", result=x),
                          x3 + 1)  # fmt: skip
            return pr(x4, where="w_b_2")

        x10 = lax.while_loop(lambda x: x <= 3, body, x2)
        return pr(x10, where="end")

    transform = jax.jit if with_jit else (lambda f: f)
    return {"result": tolist(transform(func)(1))}


@case()
def tap_jit_while_pred_tap() -> dict[str, Any]:
    """While with printing in the conditional. (host_callback's test printed "1" to
    stdout, outside its stream; here it goes to the stream like the others.)"""

    def func(x: Any) -> Any:
        x1 = pr(x, where="1")
        x10 = lax.while_loop(lambda x: pr(x < 3, where="w_p"),
                             lambda x: pr(x + 1, where="w_b"),
                             x1)  # fmt: skip
        return pr(x10, where="3")

    return {"result": tolist(jax.jit(func)(1))}


@variants("tap_scan_cond", with_jit=[True, False])
def tap_scan_cond(with_jit: bool) -> dict[str, Any]:
    def func(x: Any) -> Any:
        x1 = pr(x, where="1")
        x2 = pr(x1 + 1, where="2")

        def body(c: Any, x: Any) -> Any:
            x3 = pr(x, where="s_1")
            x4 = lax.cond(x % 2 == 0,
                          lambda x: pr(x, where="s_t"),
                          lambda x: pr(-1, where="s_f", result=x),
                          x3 + 1)  # fmt: skip
            return (c, pr(x4, where="s_2"))

        _, x10 = lax.scan(body, x2, jnp.arange(3))
        return pr(x10, where="10")

    if with_jit:
        func = jax.jit(func)
    return {"result": tolist(func(1))}


@case()
def tap_scan_order() -> dict[str, Any]:
    """Issue 9, item 1: two taps in a jitted scan body."""

    def body(c: Any, x: Any) -> Any:
        x3 = pr(x, where="s_1")
        return c, pr(x3 + 1, where="s_2")

    return {"result": tolist(jax.jit(lambda xs: lax.scan(body, 0, xs))(jnp.arange(2))[1])}


@case()
def tap_while() -> None:
    """Executing while, even without JIT uses compiled code."""
    y = jnp.ones(5)  # captured const

    def func(x: Any) -> Any:
        return lax.while_loop(lambda c: c[1] < 5, lambda c: (y, pr(c[1]) + 1), (x, 1))

    func(y)


@case()
def tap_named_call() -> dict[str, Any]:
    def tap_scalar(init: Any, do_print: bool = False) -> Any:
        @partial(jax.named_call, name="step")
        def step(acc: Any, step_nr: Any) -> Any:
            acc = acc + step_nr
            maybe_print(do_print, step_nr, what="step_nr")
            return acc, None

        return lax.scan(step, init, np.arange(2))

    plain, tapped = tap_scalar(3, do_print=False), tap_scalar(3, do_print=True)
    return {"equal": tolist(plain[0]) == tolist(tapped[0]), "result": tolist(tapped[0])}


@case()
def tap_remat_0() -> dict[str, Any]:
    def f(i: Any, k: Any) -> Any:
        x = pr(k + i)
        return k * x

    def loss(k: Any) -> Any:
        return lax.fori_loop(0, 2, jax.remat(f), k)

    return {"result": tolist(loss(3))}


def _interleaved_body(tap_a: Any, tap_b: Any) -> Callable[..., Any]:
    def body(c: Any, i: Any) -> Any:
        a = hcb.id_tap(tap_a, (i, 0))
        b = hcb.id_tap(tap_b, (a[0], 1))
        c2 = hcb.id_tap(tap_a, (b[0], 2))
        return c + c2[0], None

    return body


@case()
def tap_thousands_interleaved() -> dict[str, Any]:
    """3000 taps of one tap function from three sites in a jitted scan, twice, with no
    barrier in between: every one arrives, in program order."""

    def record(arg: Any, transforms: Any) -> None:
        STREAM.write(f"record {describe(arg)}\n")

    tap = pick(record, funcs.record)
    run = jax.jit(lambda xs: lax.scan(_interleaved_body(tap, tap), 0, xs)[0])
    totals = [tolist(run(jnp.arange(1000))), tolist(run(jnp.arange(1000, 2000)))]
    return {"totals": totals}


@case()
def tap_thousands_two_functions() -> dict[str, Any]:
    """Two tap functions interleaved, 3000 taps per run, two runs, no barrier between."""

    def record(arg: Any, transforms: Any) -> None:
        STREAM.write(f"record {describe(arg)}\n")

    def other(arg: Any, transforms: Any) -> None:
        STREAM.write(f"other {describe(arg)}\n")

    body = _interleaved_body(pick(record, funcs.record), pick(other, funcs.record_other))
    run = jax.jit(lambda xs: lax.scan(body, 0, xs)[0])
    totals = [tolist(run(jnp.arange(1000))), tolist(run(jnp.arange(1000, 2000)))]
    return {"totals": totals}


# ---- differentiation -----------------------------------------------------------------


@case()
def tap_jvp() -> dict[str, Any]:
    res_primals, res_tangents = jax.jvp(fun1, (jnp.float32(5.0),), (jnp.float32(0.1),))
    return {"primals": float(res_primals), "tangents": float(res_tangents)}


@case()
def tap_grad_primal_unused() -> dict[str, Any]:
    def func(x: Any) -> Any:
        return 2.0 * pr(x * 3.0, what="x * 3")

    grad_func = jax.grad(func)
    arg = jnp.float32(5.0)
    jax.make_jaxpr(grad_func)(arg)
    after_jaxpr = take()  # making the jaxpr does not print anything
    return {"after_jaxpr": after_jaxpr, "grad": float(grad_func(arg))}


@case()
def tap_grad_simple() -> dict[str, Any]:
    def func(x: Any) -> Any:
        y = pr(x * 2.0, what="x * 2")
        return x * pr(y * 3.0, what="y * 3")

    return {"grad": float(jax.grad(func)(jnp.float32(5.0)))}


@case()
def tap_grad_grad() -> dict[str, Any]:
    def func(x: Any) -> Any:
        y = pr(x * 2.0, what="x * 2")
        return x * (y * 3.0)

    grad_func = jax.grad(jax.grad(func))
    jax.make_jaxpr(grad_func)(5.0)
    after_jaxpr = take()
    return {"after_jaxpr": after_jaxpr, "grad": float(grad_func(jnp.float32(5.0)))}


@case()
def tap_grad_pytree() -> dict[str, Any]:
    def func(x: Any) -> Any:
        x4, x5 = pr((x * 2.0, x * 3.0), what="pair", result=(x * 4.0, x * 5.0))
        return x4 + 2.0 * x5

    return {"grad": float(jax.grad(func)(jnp.float32(5.0)))}


@case()
def tap_jvp_float0() -> dict[str, Any]:
    def f(x: Any, yint: Any) -> Any:
        x, yint = hcb.id_tap(pick(lambda arg, _: arg, funcs.noop), (x, yint))
        return x * yint

    res = jax.jvp(f, (2.0, 3), (0.2, np.zeros((), jax.dtypes.float0)))
    return {"result": [float(r) for r in res]}


@case()
def tap_grad_float0() -> dict[str, Any]:
    def func(x: Any, yint: Any) -> Any:
        x, yint = pr((x, yint), what="pair")
        return x * yint.astype(x.dtype)

    return {"grad": float(jax.grad(func)(jnp.float32(5.0), jnp.int32(2)))}


_FLOAT0_X = (np.array([0.7, 0.8], dtype=np.float32), np.array([11, 12, 13], dtype=np.int32))


@case()
def tap_grad_float0_result() -> dict[str, Any]:
    """jax issue #7340: x is a Tuple[f32[2], s32[3]]."""

    def f_jax(x: Any) -> Any:
        x = pr(x, result=x)  # result= is important
        return (3.0 * x[0], x[1])

    x = _FLOAT0_X
    _, pullback = jax.vjp(f_jax, x)
    (g,) = pullback((np.ones(x[0].shape, dtype=x[0].dtype),
                     np.zeros(x[1].shape, dtype=jax.dtypes.float0)))  # fmt: skip
    return {"g0": tolist(g[0]), "g1_float0": bool(g[1].dtype == jax.dtypes.float0)}


@case()
def tap_higher_order_grad_float0_result() -> dict[str, Any]:
    def f_jax(x: Any) -> Any:
        x = pr(x, result=x)  # result= is important
        return (jnp.sin(x[0]), x[1])

    def wrap_vjp(f: Any, args: Any, res_f_of_args: Any) -> Any:
        def make_ct(res: Any) -> Any:
            res_dtype = np.result_type(res)
            if res_dtype == jax.dtypes.float0:
                return res
            ct_dtype = jax.dtypes.float0 if res_dtype.kind in "biu" else res_dtype
            return np.ones(np.shape(res), dtype=ct_dtype)

        cts = jax.tree.map(make_ct, res_f_of_args)

        def f_vjp(args: Any, cts: Any) -> Any:
            _, pullback = jax.vjp(f, *args)
            return pullback(cts)

        return (f_vjp, (args, cts))

    x = _FLOAT0_X
    res = f_jax(x)
    order0 = take()
    f_jax_vjp1, args_vjp1 = wrap_vjp(f_jax, (x,), res)
    res_vjp1 = f_jax_vjp1(*args_vjp1)
    order1 = take()
    f_jax_vjp2, args_vjp2 = wrap_vjp(f_jax_vjp1, args_vjp1, res_vjp1)
    res_vjp2 = f_jax_vjp2(*args_vjp2)
    f_jax_vjp3, args_vjp3 = wrap_vjp(f_jax_vjp2, args_vjp2, res_vjp2)
    f_jax_vjp3(*args_vjp3)
    return {"order0": order0, "order1": order1}


def power3(x: Any) -> Any:
    y = x * x
    # Print both 'x' and 'x^2'. Must pack as a tuple.
    pr((x, y), what="x,x^2")
    return y * x


@jax.custom_jvp
def print_tangents(arg: Any) -> Any:
    return None


@print_tangents.defjvp
def print_tangents_jvp(primals: Any, tangents: Any) -> Any:
    (arg_dot,) = tangents
    pr(arg_dot, what="tangents")
    return primals, tangents


def power3_with_tangents(x: Any) -> Any:
    y = x * x
    pr((x, y), what="x,x^2")
    print_tangents((x, y))
    return y * x


@jax.custom_vjp
def print_cotangents(arg: Any) -> Any:
    # Must return the argument for which we want the cotangent.
    return arg


def print_cotangents_fwd(arg: Any) -> Any:
    return print_cotangents(arg), None


def print_cotangents_bwd(residual: Any, ct_b: Any) -> Any:
    pr(ct_b, what="cotangents")
    return (ct_b,)


print_cotangents.defvjp(print_cotangents_fwd, print_cotangents_bwd)


def power3_with_cotangents(x: Any) -> Any:
    y = x * x
    pr((x, y), what="x,x^2")
    (x1, y1) = print_cotangents((x, y))  # Must use the output of print_cotangents
    return y1 * x1


@case()
def tap_transforms_doc_impl() -> dict[str, Any]:
    return {"result": float(power3(3.0))}


@case()
def tap_transforms_doc_jvp() -> dict[str, Any]:
    return {"result": [float(v) for v in jax.jvp(power3, (3.0,), (0.1,))]}


@case()
def tap_transforms_doc_jvp_tangents() -> dict[str, Any]:
    return {"result": [float(v) for v in jax.jvp(power3_with_tangents, (3.0,), (0.1,))]}


@case()
def tap_transforms_doc_grad() -> dict[str, Any]:
    return {"result": float(jax.grad(power3)(3.0))}


@case()
def tap_transforms_doc_grad_cotangents() -> dict[str, Any]:
    return {"result": float(jax.grad(power3_with_cotangents)(3.0))}


@case()
def tap_transforms_doc_vmap() -> dict[str, Any]:
    return {"result": tolist(jax.vmap(power3)(np.array([2.0, 3.0])))}


@case()
def tap_transforms_doc_vmap_grad() -> dict[str, Any]:
    return {"result": tolist(jax.vmap(jax.grad(power3))(np.array([2.0, 3.0])))}


@case()
def tap_transforms_doc_vmap_grad_cotangents() -> dict[str, Any]:
    return {"result": tolist(jax.vmap(jax.grad(power3_with_cotangents))(np.array([2.0, 3.0])))}


@case()
def tap_transforms_doc_grad_remat() -> dict[str, Any]:
    return {"result": float(jax.grad(lambda x: power3(jax.checkpoint(power3)(x)))(3.0))}


@case()
def tap_scan_custom_jvp() -> dict[str, Any]:
    """custom JVP, inside scan (custom_jvp_call_jaxpr)."""

    @jax.custom_jvp
    def f(x: Any) -> Any:
        return x * pr(x, what="x")

    @f.defjvp
    def f_jvp(primals: Any, tangents: Any) -> Any:
        (x,) = primals
        (x_dot,) = tangents
        primal_out = f(x)
        tangent_out = 3.0 * x * pr(x_dot, what="x_dot")
        return primal_out, tangent_out

    def g(x: Any) -> Any:
        # Sum f(x_i)
        return lax.scan(lambda carry, inp: (carry + f(inp), 0.0),
                        np.full(x.shape[1:], 0.0),  # Like x w/o leading dim
                        x)[0]  # fmt: skip

    arg = np.full((2,), 0.7)
    value = float(g(arg))
    eval_output = take()
    return {"value": value, "eval_output": eval_output, "grad": tolist(jax.grad(g)(arg))}


@case()
def tap_custom_jvp_grad() -> dict[str, Any]:
    """Issue 9, item 2: a tap on the tangent in a custom_jvp rule, under grad, no scan."""

    @jax.custom_jvp
    def f(x: Any) -> Any:
        return x * x

    @f.defjvp
    def f_jvp(primals: Any, tangents: Any) -> Any:
        (x,) = primals
        (x_dot,) = tangents
        return f(x), 3.0 * x * pr(x_dot, what="x_dot")

    return {"grad": float(jax.grad(f)(0.7))}


@case()
def tap_scan_custom_vjp() -> dict[str, Any]:
    """custom VJP, inside scan (custom_vjp_call_jaxpr)."""

    @jax.custom_vjp
    def f(x: Any) -> Any:
        return x * pr(x, what="x")

    def f_fwd(x: Any) -> Any:
        return f(x), 3.0 * x

    def f_bwd(residual: Any, ct_b: Any) -> Any:
        return (residual * pr(ct_b, what="ct_b"),)

    f.defvjp(f_fwd, f_bwd)

    def g(x: Any) -> Any:
        return lax.scan(lambda carry, inp: (carry + f(inp), 0.0),
                        np.full(x.shape[1:], 0.0), x)[0]  # fmt: skip

    arg = np.full((2,), 0.7)
    value = float(g(arg))
    eval_output = take()
    return {"value": value, "eval_output": eval_output, "grad": tolist(jax.grad(g)(arg))}


@case()
def tap_odeint() -> dict[str, Any]:
    """jax bug #4015: xla_call(scan(xla_call)), all under grad; should not fail."""
    from jax.experimental.ode import odeint

    def f(x: Any, t: Any, k: Any) -> Any:
        x = pr(x)
        return -k * x

    def loss(k: Any = 1.0) -> Any:
        t = jnp.linspace(0, 0.001, num=2)
        xs = odeint(f, 1.0, t, k)
        return xs[-1]

    return {"grad": float(jax.grad(loss)(1.0))}  # should not fail


@variants("tap_remat", use_result=[True, False], grad_func=["grad", "value_and_grad"],
          use_remat=["new", "none"])  # fmt: skip
def tap_remat(use_result: bool, grad_func: str, use_remat: str) -> dict[str, Any]:
    def f(x: Any) -> Any:
        id_print_result = pr(x)
        if use_result:
            x = id_print_result
        return 3.0 * x

    grad_f = jax.grad if grad_func == "grad" else jax.value_and_grad
    trans_f = jax.checkpoint(f) if use_remat == "new" else f
    jax.make_jaxpr(grad_f(trans_f))(2.0)
    after_jaxpr = take()
    res = grad_f(trans_f)(2.0)
    return {"after_jaxpr": after_jaxpr, "result": [float(r) for r in jax.tree.leaves(res)]}


# ---- vmap ----------------------------------------------------------------------------


@case()
def tap_vmap() -> dict[str, Any]:
    vargs = jnp.array([jnp.float32(4.0), jnp.float32(5.0)])
    return {"result": tolist(jax.vmap(fun1)(vargs))}


@case()
def tap_vmap_not_batched() -> dict[str, Any]:
    x = 3.0

    def func(y: Any) -> Any:
        # x is not mapped, y is mapped
        _, y = pr((x, y))
        return x + y

    return {"result": tolist(jax.vmap(func)(jnp.array([4.0, 5.0], dtype=jnp.float32)))}


@case()
def tap_vmap_vmap() -> dict[str, Any]:
    # A 2D tensor with x[i, j] = i + j using 2 vmap
    def sum(x: Any, y: Any) -> Any:
        return pr(x + y)

    def sum_rows(xv: Any, y: Any) -> Any:
        return jax.vmap(sum, in_axes=(0, None))(xv, y)

    def sum_all(xv: Any, yv: Any) -> Any:
        return jax.vmap(sum_rows, in_axes=(None, 0))(xv, yv)

    xv = jnp.arange(5, dtype=np.int32)
    yv = jnp.arange(3, dtype=np.int32)
    return {"result": tolist(sum_all(xv, yv))}


@case()
def tap_vmap_while() -> dict[str, Any]:
    def func(x: Any) -> Any:
        # like max(x, 2)
        x1 = pr(x, where="before:x")
        x2 = lax.while_loop(lambda x: x < 2, lambda x: pr(x + 1, where="body:x+1"), x1)
        return pr(x2, where="after:x")

    inputs = np.arange(5, dtype=np.int32)
    return {"result": tolist(jax.jit(jax.vmap(func))(inputs))}


@case()
def tap_vmap_while_tap_cond() -> dict[str, Any]:
    """Vmap of while, with a tap in the conditional."""

    def func(x: Any) -> Any:
        x1 = pr(x, where="1")
        x2 = lax.while_loop(lambda x: pr(x < 2, where="w_c"),
                            lambda x: pr(x + 1, where="w_b"),
                            x1)  # fmt: skip
        return pr(x2, where="3")

    inputs = np.arange(5, dtype=np.int32)
    return {"result": tolist(jax.jit(jax.vmap(func))(inputs))}


@case()
def tap_vmap_transforms_tuples() -> dict[str, Any]:
    """The `transforms` an id_tap function gets under vmap: ("batch", {"batch_dims": tuple}),
    one entry per vmap, None for an unbatched leaf (host_callback's _unpack_transforms)."""

    def record(arg: Any, transforms: Any) -> None:
        STREAM.write(f"{describe(arg)} transforms={[(n, p) for n, p in transforms]!r}\n")

    tap = pick(record, funcs.record_transforms)
    jax.vmap(jax.vmap(lambda x: hcb.id_tap(tap, x)))(jnp.ones((2, 3), jnp.int32))
    nested = take()
    jax.vmap(lambda y: hcb.id_tap(tap, (3, y)))(jnp.arange(2))
    return {"nested": nested}


# ---- devices: pmap, sharding, tap_with_device ----------------------------------------


@case()
def tap_pmap() -> dict[str, Any]:
    def power3(x: Any) -> Any:
        y = x * x
        _, y = pr((x, y), what="x,x^2", tap_with_device=True)
        return y * x

    xv = np.array([3, 4], dtype=np.int32)
    return {"result": tolist(jax.pmap(power3, devices=local_devices())(xv))}


@case()
def tap_pmap_vmap() -> dict[str, Any]:
    matrix = np.fromfunction(lambda i, j: 10.0 * i + j, (len(local_devices()), 3), dtype=np.int32)

    def fun1(x: Any, do_print: bool = False) -> Any:
        return maybe_print(do_print, x * 2, "x * 2", tap_with_device=True)

    expected = jax.pmap(jax.vmap(partial(fun1, do_print=False)), devices=local_devices())(matrix)
    res = jax.pmap(jax.vmap(partial(fun1, do_print=True)), devices=local_devices())(matrix)
    return {"equal": tolist(expected) == tolist(res)}


@case()
def tap_pmap_pmap_vmap() -> dict[str, Any]:
    shape = (2, len(local_devices()) // 2, 3)
    matrix = np.fromfunction(lambda i, j, k: 100.0 * i + 10.0 * j + k, shape, dtype=np.float32)

    def fun1(x: Any, do_print: bool = False) -> Any:
        y = maybe_print(do_print, x * 2.0, "x * 2", tap_with_device=True)
        return y**2

    try:
        expected = jax.pmap(jax.pmap(jax.vmap(partial(fun1, do_print=False))),
                            devices=local_devices())(matrix)  # fmt: skip
    except ValueError as exc:
        raise Skip(f"jax {jax.__version__} itself refuses nested pmap: {exc}") from exc
    res = jax.pmap(jax.pmap(jax.vmap(partial(fun1, do_print=True))),
                   devices=local_devices())(matrix)  # fmt: skip
    return {"equal": tolist(expected) == tolist(res)}


@case()
def tap_pmap_pmap_extra() -> dict[str, Any]:
    """pmap of a pmap surrounded by extra code."""
    matrix = np.fromfunction(lambda i, j, k: 100.0 * i + 10.0 * j + k, (2, 1, 3),
                             dtype=np.float32)  # fmt: skip

    def fun(xv: Any, do_print: bool = False) -> Any:
        xv = maybe_print(do_print, xv + 1.0, "before", tap_with_device=True)
        res = jax.pmap(lambda x: maybe_print(do_print, x * 2.0, "inside", tap_with_device=True))(xv)
        return maybe_print(do_print, res + 1.0, "after", tap_with_device=True)

    try:
        expected = jax.pmap(partial(fun, do_print=False))(matrix)
    except ValueError as exc:
        raise Skip(f"jax {jax.__version__} itself refuses nested pmap: {exc}") from exc
    res = jax.pmap(partial(fun, do_print=True))(matrix)
    return {"equal": tolist(expected) == tolist(res)}


@case()
def tap_jvp_pmap_vmap() -> dict[str, Any]:
    shape = (len(local_devices()), 2, 3)
    matrix = np.fromfunction(lambda i, j, k: 100.0 * i + 10.0 * j + k, shape, dtype=np.float32)

    def fun(xv: Any, do_print: bool = False) -> Any:
        return jax.jvp(
            jax.pmap(jax.vmap(lambda x: maybe_print(do_print, x * 2.0, "x * 2",
                                                    tap_with_device=True))),
            (xv,), (0.1 * jnp.ones_like(xv),))  # fmt: skip

    expected = fun(matrix, do_print=False)
    res = fun(matrix, do_print=True)
    return {"equal": tolist(expected) == tolist(res)}


@case()
def tap_vmap_pmap() -> dict[str, Any]:
    shape = (2, len(local_devices()), 3)
    matrix = np.fromfunction(lambda i, j, k: 100.0 * i + 10.0 * j + k, shape, dtype=np.float32)

    def fun(xv: Any, do_print: bool = False) -> Any:
        return jax.vmap(jax.pmap(lambda x: maybe_print(do_print, x * 2.0, "x * 2",
                                                       tap_with_device=True)))(xv)  # fmt: skip

    expected = fun(matrix, do_print=False)
    res = fun(matrix, do_print=True)
    return {"equal": tolist(expected) == tolist(res)}


@case()
def tap_jit_pmap_extra() -> dict[str, Any]:
    """jit of a pmap surrounded by extra code."""
    matrix = np.fromfunction(lambda i, j: 10.0 * i + j, (len(local_devices()), 3),
                             dtype=np.float32)  # fmt: skip

    def fun(xv: Any, do_print: bool = False) -> Any:
        xv = maybe_print(do_print, xv + 1.0, "before", tap_with_device=True)
        res = jax.pmap(lambda x: maybe_print(do_print, x * 2.0, "inside", tap_with_device=True))(xv)
        return maybe_print(do_print, res + 1.0, "after", tap_with_device=True)

    res = jax.jit(partial(fun, do_print=True))(matrix)
    return {"equal": tolist(fun(matrix, do_print=False)) == tolist(res)}


@variants("tap_pjit", device_index=[0, 1])
def tap_pjit(device_index: int) -> dict[str, Any]:
    """jit over inputs sharded on a 2-device mesh; the tap sees the whole value once, on
    device `device_index`."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = np.array(local_devices())
    x = jnp.arange(100, dtype=jnp.int32).reshape((10, 10))[: len(devices), :3]
    y = jnp.ones((3, 4), np.int32)

    @partial(jax.named_call, name="fun1")
    def fun1(x: Any) -> Any:
        z = jnp.dot(x, y)
        return pr(z, what="z", tap_with_device=True, device_index=device_index)

    sharding = NamedSharding(Mesh(devices, ["d"]), P("d"))
    res = jax.jit(fun1, in_shardings=(sharding,), out_shardings=sharding)(x)
    return {"equal": tolist(res) == tolist(jnp.dot(x, y))}


@case()
def tap_id_tap_random_key() -> dict[str, Any]:
    """jax issue #13949: keys under jax_enable_custom_prng are tapped as their key data."""

    def tap(tap_x: Any, _: Any) -> None:
        STREAM.write(describe(tap_x, dtypes=True) + "\n")

    with jax.enable_custom_prng():

        @jax.jit
        def f(x: Any) -> Any:
            return hcb.id_tap(pick(tap, funcs.record_typed), x, result=x)

        out = f(jax.random.PRNGKey(123))
        return {"result": tolist(jax.random.key_data(out))}


@case()
def tap_typed_key() -> dict[str, Any]:
    """A typed key (jax.random.key) alone and in a pytree: its key data is tapped."""

    def tap(tap_x: Any, _: Any) -> None:
        STREAM.write(describe(tap_x, dtypes=True) + "\n")

    record = pick(tap, funcs.record_typed)
    key = jax.random.key(123)
    out = jax.jit(lambda k: hcb.id_tap(record, k))(key)
    jax.jit(lambda k: hcb.id_tap(record, {"key": k, "x": jnp.float32(1.0)}))(key)
    keys = jax.random.split(key, 2)
    jax.jit(lambda k: hcb.id_tap(record, k))(keys)
    return {"result": tolist(jax.random.key_data(out)), "split": tolist(jax.random.key_data(keys))}


# x64 is off, so no 64-bit types (as in host_callback's runs without JAX_ENABLE_X64).
DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "uint8",
    "uint16",
    "uint32",
    "bfloat16",
    "float16",
    "float32",
]
SHAPES = [(), (2,), (2, 3), (2, 3, 4)]


def dtype_args(dtype: str, shape: tuple[int, ...], nr_args: int) -> list[Any]:
    if dtype == "bool":
        arg = (jnp.arange(int(np.prod(shape))) % 2 == 0).reshape(shape)
    else:
        arg = jnp.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return [arg] * nr_args


@variants("tap_jit_dtypes", dtype=DTYPES)
def tap_jit_dtypes(dtype: str) -> dict[str, Any]:
    """One jit per dtype, tapping every (nr_args, shape) of host_callback's matrix."""
    combos = [(nr_args, shape) for nr_args in (1, 2) for shape in SHAPES]
    args = [dtype_args(dtype, shape, nr_args) for nr_args, shape in combos]

    def fun(args: Any) -> Any:
        return [pr(xs, a_new_test="************", testcase_name=f"{shape=}_{dtype=}_{nr_args=}")
                for (nr_args, shape), xs in zip(combos, args, strict=True)]  # fmt: skip

    res = jax.jit(fun)(args)
    same = all(
        a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
        for r, e in zip(res, args, strict=True)
        for a, b in zip(r, e, strict=True)
    )
    return {"identity": same}


# ---- exceptions ----------------------------------------------------------------------


def _barrier_raises() -> dict[str, Any]:
    try:
        barrier_wait()
    except Exception as exc:
        callback_exception = getattr(hcb, "CallbackException", None)
        return {"raised": type(exc).__name__, "message": str(exc),
                "is_callback_exception": callback_exception is not None
                and isinstance(exc, callback_exception),
                "cause": None if exc.__cause__ is None else repr(exc.__cause__)}  # fmt: skip
    return {"raised": None}


@case()
def tap_eval_exception() -> dict[str, Any]:
    def tap_err(*args: Any, **kwargs: Any) -> None:
        raise ValueError("Some user message")

    def func(x: Any) -> Any:
        x1 = pr(x + 1, what="x1")
        x2 = hcb.id_tap(pick(tap_err, funcs.tap_err), x1 + 1)
        return pr(x2 + 1, what="x3")

    res = tolist(func(0))
    raised = _barrier_raises()
    output = LOGS.take() if LOGS is not None else STREAM.take()
    return {"result": res, **raised, "output_before": output, "second": _barrier_raises()}


@case()
def tap_jit_tap_exception() -> dict[str, Any]:
    def tap_err(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def func(x: Any) -> Any:
        x1 = pr(x + 1, what="x1")
        x2 = hcb.id_tap(pick(tap_err, funcs.tap_err_not_implemented), x1 + 1)
        return pr(x2 + 1, what="x3")

    res = tolist(jax.jit(func)(0))  # No error yet
    raised = _barrier_raises()
    output = LOGS.take() if LOGS is not None else STREAM.take()
    return {"result": res, **raised, "output_before": output, "second": _barrier_raises()}


# ---- the runner ----------------------------------------------------------------------


def summarize(exc: BaseException) -> str:
    """`ExcType: first line of the message (at file:line in function)`, the frame being the
    innermost one in tapd's sources, else the innermost in this file."""
    lines = "".join(traceback.format_exception_only(exc)).strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    where = ""
    for marker in ("/tapd/", "/hcb_cases.py"):
        inside = [f for f in frames if marker in f.filename]
        if inside:
            frame = inside[-1]
            path = frame.filename[frame.filename.rfind(marker) + 1 :]
            where = f" (at {path}:{frame.lineno} in {frame.name})"
            break
    head = [line.strip() for line in lines if line.strip()][:2]
    if len(head) == 2 and not head[0].endswith(":"):
        head = head[:1]  # a second line only where the first announces it
    return (" ".join(head) or type(exc).__name__)[:400] + where


def run_case(name: str) -> dict[str, Any]:
    result: dict[str, Any] = {"case": name, "status": "ok", "values": {}, "output": "",
                              "devices": [str(d) for d in local_devices()]}  # fmt: skip
    started = time.monotonic()
    faulthandler.dump_traceback_later(CASE_TIMEOUT, exit=True)
    try:
        result["values"] = CASES[name]() or {}
        result["output"] = take()
    except Skip as exc:
        result.update(status="skip", error=str(exc))
    except BaseException as exc:
        result.update(status="error", error=summarize(exc), traceback=traceback.format_exc())
        try:
            result["output"] = take()
        except BaseException as again:
            result["output"] = f"<barrier_wait after the error raised {again!r}>"
    finally:
        faulthandler.cancel_dump_traceback_later()
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def main() -> None:
    names = sys.argv[1:]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases: {unknown}")
    with open(os.environ["HCB_RESULTS"], "a", buffering=1) as out:
        for name in names:
            print(f"--- {name}", file=sys.stderr, flush=True)
            out.write(json.dumps(run_case(name)) + "\n")


if __name__ == "__main__":
    main()
