"""A JAX process whose tap functions run in it, as host_callback's did (tests/
test_local_functions.py). `python local_app.py SCENARIO [ARGS]` taps into the daemon at
$TAPD_ENDPOINT and prints one JSON line of results last."""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import tapd as hcb

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import local_funcs


class Recorder:
    """A top-level class of `__main__`: its bound method is `__main__:Recorder.tap` by
    name, which no other process can import, so it runs here."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def tap(self, arg: Any, transforms: Any) -> None:
        self.calls.append(np.asarray(arg).tolist())

    def __call__(self, arg: Any, transforms: Any) -> None:  # a callable object
        self.calls.append(["called", np.asarray(arg).tolist()])


class Pair(NamedTuple):
    a: Any
    b: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    step: Any
    loss: Any


def closures() -> dict[str, Any]:
    """A tqdm bar, bound methods, a callable object, a closure over a list, id_print to a
    stream, a partial binding an object, pytree types, and the device, in one scan."""
    from tqdm import tqdm

    steps = 6
    bar_output = io.StringIO()
    pbar = tqdm(total=steps, file=bar_output, mininterval=0, miniters=1)
    recorder = Recorder()
    counter = local_funcs.Counter()  # a bound method of an importable class
    log: list[Any] = []
    stream = io.StringIO()
    types: list[str] = []
    devices: list[str] = []

    def body(carry: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
        hcb.id_tap(lambda a, t: pbar.update(1), x)
        x = hcb.id_tap(lambda a, t: log.append(("first", float(a))), x)
        hcb.id_tap(recorder.tap, x * 10)
        hcb.id_tap(recorder, x * 100)
        hcb.id_tap(counter.tap, x + 0.5)
        hcb.id_print(x, what="x", output_stream=stream)
        hcb.id_tap(functools.partial(_with_sink, sink=log), x + 1)
        hcb.id_tap(lambda a, t: types.append(f"{type(a).__name__}:{type(a.b).__name__}"),
                   Pair(x, State(step=x, loss=x * 2)))  # fmt: skip
        hcb.id_tap(lambda a, t, device: devices.append(str(device)), x, tap_with_device=True)
        return carry + x, None

    total, _ = jax.jit(lambda xs: lax.scan(body, 0.0, xs))(jnp.arange(float(steps)))
    hcb.barrier_wait()
    pbar.close()
    return {
        "total": float(total),
        "pbar_n": pbar.n,
        "pbar_output_has_100": "100%" in bar_output.getvalue(),
        "log": log,
        "recorder": recorder.calls,
        "counter": counter.values,
        "printed": stream.getvalue(),
        "types": types,
        "devices": devices,
        "stats": hcb.stats(),
    }


def _with_sink(arg: Any, transforms: Any, *, sink: list[Any]) -> None:
    sink.append(("partial", float(arg)))


def raising() -> dict[str, Any]:
    """A closure that raises on one tap: barrier_wait raises CallbackException (chained to
    the exception itself); the other taps still ran; the next barrier is clean."""
    seen: list[float] = []

    def tap(arg: Any, transforms: Any) -> None:
        if float(arg) == 2.0:
            raise ValueError("deliberate failure at 2")
        seen.append(float(arg))

    jax.jit(lambda xs: lax.scan(lambda c, x: (c, hcb.id_tap(tap, x)), 0.0, xs))(jnp.arange(4.0))
    raised = cause = None
    try:
        hcb.barrier_wait()
    except hcb.CallbackException as exc:
        raised, cause = str(exc), repr(exc.__cause__)
    hcb.barrier_wait()  # nothing new raised
    alias = hcb.TapFunctionException is hcb.CallbackException
    return {"raised": raised, "cause": cause, "seen": seen, "alias": alias}


def wandb_log(directory: str) -> dict[str, Any]:
    """A closure calling wandb.log (offline) from a jitted scan; wandb refuses steps that
    go backwards, so every step logged also says they came in order."""
    import wandb

    run = wandb.init(project="tapd-test", dir=directory, mode="offline")
    logged: list[tuple[int, float]] = []

    def log(arg: Any, transforms: Any) -> None:
        step, loss = int(arg[0]), float(arg[1])
        wandb.log({"loss": loss}, step=step)
        logged.append((step, loss))

    def body(w: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
        loss = (w - 3.0) ** 2
        hcb.id_tap(log, (i, loss))
        return w - 0.1 * 2 * (w - 3.0), None

    jax.jit(lambda w: lax.scan(body, w, jnp.arange(20)))(0.0)
    hcb.barrier_wait()
    result = {"logged": logged, "run_step": run.step, "summary_step": run.summary["_step"],
              "summary_loss": float(run.summary["loss"])}  # fmt: skip
    run.finish()
    return result


def slow(steps: str, sleep_ms: str) -> dict[str, Any]:
    """A closure that sleeps: the loop does not wait for it; barrier_wait does."""
    done: list[float] = []

    def tap(arg: Any, transforms: Any) -> None:
        time.sleep(float(sleep_ms) / 1000)
        done.append(float(arg))

    step = jax.jit(lambda x: hcb.id_tap(tap, x) + 1)
    step(0.0).block_until_ready()  # compile
    hcb.barrier_wait()
    done.clear()
    start = time.monotonic()
    x = jnp.float32(0.0)
    for _ in range(int(steps)):
        x = step(x)
    x.block_until_ready()
    loop_s = time.monotonic() - start
    hcb.barrier_wait()
    return {"loop_s": loop_s, "total_s": time.monotonic() - start, "done": done}


def fallback() -> dict[str, Any]:
    """Importable tap functions (and partials of them): run here unless a subscriber
    takes them. id_print without output_stream likewise prints here."""
    xs = jnp.arange(3.0)
    jax.jit(lambda xs: lax.scan(lambda c, x: (c, hcb.id_tap(local_funcs.record, x)), 0.0, xs))(xs)
    jax.jit(lambda x: hcb.id_tap(functools.partial(local_funcs.record, what="loss", n=2), x))(
        jnp.float32(7.0)
    )
    jax.jit(jax.vmap(lambda x: hcb.id_print(x * 2, what="a * 2")))(jnp.arange(2.0))
    jax.jit(lambda x: hcb.id_print((x, x * 2), what="pair", tap_with_device=True))(5.0)
    hcb.barrier_wait()
    return {"calls": local_funcs.CALLS, "pid": os.getpid(), "stats": hcb.stats()}


def exit_drain(path: str) -> dict[str, Any]:
    """No barrier_wait: the exit drain waits for this process's own tap functions too."""
    sink = open(path, "a", buffering=1)  # noqa: SIM115 (the exit drain writes after main)

    def tap(arg: Any, transforms: Any) -> None:
        time.sleep(0.01)
        sink.write(f"{int(arg)}\n")

    jax.jit(lambda xs: lax.scan(lambda c, x: (c, hcb.id_tap(tap, x)), 0, xs))(jnp.arange(30))
    return {"exiting": True}


SCENARIOS = {"closures": closures, "raising": raising, "wandb": wandb_log, "slow": slow,
             "fallback": fallback, "exit_drain": exit_drain}  # fmt: skip

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps(result, default=str), flush=True)
