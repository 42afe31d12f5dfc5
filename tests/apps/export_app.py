"""Tapped computations that travel (tests/test_export.py): a `jax.export` artifact made in
one process and called in another, the refusals, and JAX's persistent compilation cache
across processes. `python export_app.py SCENARIO [ARGS]` prints one JSON line of
results last."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import export, lax

import tapd


def model(x: jax.Array) -> jax.Array:
    """Taps a dict of an int32 scalar and a float32 row, with a step, in each of a scan's
    three iterations, and an int32 vector after it."""

    def body(carry: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
        tapd.tap({"i": i, "row": carry}, "export.loop", step=i)
        return carry * 2.0, None

    y, _ = lax.scan(body, x, jnp.arange(3))
    tapd.tap(y.astype(jnp.int32), "export.out")
    return y.sum()


ARGUMENT = jax.ShapeDtypeStruct((4,), jnp.float32)


def export_model(path: str) -> dict[str, Any]:
    exported = export.export(jax.jit(model))(ARGUMENT)
    Path(path).write_bytes(exported.serialize())
    return {"exported": True}


def call(how: str, path: str, calls: str) -> dict[str, Any]:
    """Call the model `calls` times: "traced" (jitted here) or "loaded" (the artifact at
    `path`, deserialized by `tapd.deserialize`), on the same values."""
    loaded = how == "loaded"
    function = tapd.deserialize(Path(path).read_bytes()).call if loaded else jax.jit(model)
    results = [float(function(jnp.arange(4.0) + n)) for n in range(int(calls))]
    tapd.barrier_wait()
    return {"results": results, "stats": tapd.stats()}


def load_bare(path: str) -> dict[str, Any]:
    """`jax.export.deserialize` in a process that imported tapd but never called it."""
    assert "tapd.emitter.primitive" not in sys.modules  # (nothing of the emitter yet)
    try:
        exported = export.deserialize(bytearray(Path(path).read_bytes()))
        exported.call(jnp.arange(4.0))
        tapd.barrier_wait()
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def refusals() -> dict[str, Any]:
    """What cannot travel, each exported on its own: the error each raises."""
    import tapd.debug

    def keep(value: Any, transforms: Any) -> None:
        return None

    functions = {
        "id_tap_closure": lambda x: tapd.id_tap(keep, x),
        "debug_callback": lambda x: (tapd.debug.callback(print, x), x)[1],
        "named": lambda x: tapd.tap(x, "export.named"),
    }
    errors: dict[str, str | None] = {}
    for name, function in functions.items():
        try:
            export.export(jax.jit(function))(ARGUMENT).serialize()
            errors[name] = None
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    return {"errors": errors}


def cached(directory: str, order: str) -> dict[str, Any]:
    """Two tapped functions, traced and called in `order` ("ab" or "ba") with JAX's
    persistent compilation cache in `directory`: the cache's hits and misses (JAX's
    monitoring events), and the taps' values."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    functions = {
        "a": jax.jit(lambda x: tapd.tap(x + 1.0, "cache.a", step=1) * 2.0),
        "b": jax.jit(lambda x: tapd.tap(x.astype(jnp.int32) - 1, "cache.b", step=2) * 3),
    }
    for name in order:
        functions[name](jnp.arange(3.0))
    tapd.barrier_wait()
    hits = sum(event == "/jax/compilation_cache/cache_hits" for event in events)
    misses = sum(event == "/jax/compilation_cache/cache_misses" for event in events)
    return {"hits": hits, "misses": misses, "stats": tapd.stats()}


def cached_local(directory: str, order: str) -> dict[str, Any]:
    """As `cached`, with tap functions of this process (no daemon): a `tapd.debug`
    callback in each of two functions traced in `order`, and in a third, two lambdas of
    one name and an `id_tap` closure. Which function got which value, in call order."""
    import tapd.debug

    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events: list[str] = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    calls: list[list[Any]] = []

    def got_a(x: jax.Array) -> None:
        calls.append(["a", x.tolist()])

    def got_b(x: jax.Array) -> None:
        calls.append(["b", x.tolist()])

    twins = [lambda x, i=i: calls.append([f"twin{i}", x.tolist()]) for i in range(2)]

    def both_twins(x: jax.Array) -> jax.Array:
        for i, twin in enumerate(twins):
            tapd.debug.callback(twin, x + i)
        tapd.id_tap(lambda value, transforms: calls.append(["id_tap", value.tolist()]), x * 10)
        return x - 1

    functions = {
        "a": jax.jit(lambda x: (tapd.debug.callback(got_a, x + 1.0), x * 2.0)[1]),
        "b": jax.jit(lambda x: (tapd.debug.callback(got_b, x - 1.0), x * 3.0)[1]),
        "t": jax.jit(both_twins),
    }
    for name in [*order, "t"]:
        functions[name](jnp.arange(3.0))
        tapd.barrier_wait()
    hits = sum(event == "/jax/compilation_cache/cache_hits" for event in events)
    misses = sum(event == "/jax/compilation_cache/cache_misses" for event in events)
    return {"hits": hits, "misses": misses, "calls": calls, "stats": tapd.stats()}


SCENARIOS = {
    "export": export_model,
    "call": call,
    "load_bare": load_bare,
    "refusals": refusals,
    "cached": cached,
    "cached_local": cached_local,
}

if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("EXPORT_APP_LOG", "WARNING"))
    result = SCENARIOS[sys.argv[1]](*sys.argv[2:])
    print(json.dumps({"pid": os.getpid(), **result}, default=str), flush=True)
