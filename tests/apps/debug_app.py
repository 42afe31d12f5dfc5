"""Run the cases of tests/apps/debug_cases.py with `jax.debug` or with `tapd.debug`, and
record what their callbacks got and what they printed (tests/test_debug.py compares the
two). `python debug_app.py jax|tapd GROUP` prints one JSON object last: for each case,
{"calls": [...], "out": printed text, "logged": [...], "error": None or [type, message]}.

Each case runs with `sys.stdout` replaced, up to a barrier (`jax.effects_barrier()` for
JAX, `tapd.barrier_wait()` for tapd), so that what its callbacks print is its own. With
tapd, the daemon is the one at $TAPD_ENDPOINT."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import debug_cases

IMPL = sys.argv[1]
if IMPL == "jax":
    api: Any = jax.debug
    barrier: Callable[[], None] = jax.effects_barrier
elif IMPL == "tapd":
    import tapd
    import tapd.debug

    api = tapd.debug
    barrier = tapd.barrier_wait
else:
    raise SystemExit(f"usage: debug_app.py jax|tapd GROUP, not {IMPL!r}")


def describe_leaf(leaf: Any) -> list[Any]:
    """What a callback got for one leaf: its type and all a test can compare."""
    if isinstance(leaf, jax.Array):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return ["key", str(jax.random.key_impl(leaf)), describe_leaf(jax.random.key_data(leaf))]
        return [
            "jax.Array",
            str(leaf.dtype),
            list(leaf.shape),
            np.asarray(leaf).tolist(),
            bool(leaf.weak_type),
            sorted(device.platform for device in leaf.devices()),
            repr(leaf),
        ]
    if isinstance(leaf, np.ndarray | np.generic):
        return [type(leaf).__name__, str(leaf.dtype), np.asarray(leaf).tolist()]
    return [type(leaf).__name__, repr(leaf)]


class Recorder:
    """The callback of every case: records each call's arguments (tree and leaves)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        self.calls.append({"tree": str(treedef), "leaves": [describe_leaf(x) for x in leaves]})


class Logged(logging.Handler):
    """Records what `jax.debug.log` logs."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[list[Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:  # JAX's own line, from inside JAX or tapd
            self.records.append([record.levelname, record.getMessage()])
            return
        self.records.append(
            [
                record.levelname,
                record.getMessage(),
                os.path.basename(record.pathname),
                record.lineno,
            ]
        )


def run(case: Callable[..., None]) -> dict[str, Any]:
    recorder = Recorder()
    logged = Logged()
    logger = logging.getLogger("jax._src.debugging")
    logger.addHandler(logged)
    logger.setLevel(logging.INFO)
    real_stdout, sys.stdout = sys.stdout, io.StringIO()
    error = None
    try:
        try:
            case(api, recorder)
        except Exception as exc:  # a trace-time refusal: compared, type and words
            error = [type(exc).__name__, str(exc).split("\n---")[0]]
        barrier()
        out = sys.stdout.getvalue()
    finally:
        sys.stdout = real_stdout
        logger.removeHandler(logged)
    return {"calls": recorder.calls, "out": out, "logged": logged.records, "error": error}


def main() -> None:
    group = sys.argv[2]
    results = {name: run(case) for name, case in debug_cases.GROUPS[group].items()}
    print(json.dumps(results, default=str))


if __name__ == "__main__":
    main()
