"""Module-level tap functions for tests/test_host_callback_compat.py.

host_callback's own tests (jax `tests/host_callback_test.py`) wrote their tap functions
as closures that append to a stream in the test process. These are the same functions
moved to the top level of an importable module, so that `id_tap(hcb_funcs.f, x)` runs
them in a subscriber process (`tapd subscribe hcb_funcs`, whose stdout the test reads).
Each prints what the closure version writes to its stream, one line per call.

No JAX here: a subscriber does not import it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def describe(arg: Any, *, dtypes: bool = False) -> str:
    """A deterministic rendering of a tapped pytree: containers as Python writes them,
    arrays as nested lists (with `dtypes`: `dtype(shape):values`)."""
    if isinstance(arg, tuple):
        inner = ", ".join(describe(a, dtypes=dtypes) for a in arg)
        return f"({inner},)" if len(arg) == 1 else f"({inner})"
    if isinstance(arg, list):
        return "[" + ", ".join(describe(a, dtypes=dtypes) for a in arg) + "]"
    if isinstance(arg, dict):
        items = sorted(arg.items())
        return "{" + ", ".join(f"{k!r}: {describe(v, dtypes=dtypes)}" for k, v in items) + "}"
    if arg is None:
        return "None"
    array = np.asarray(arg)
    values = array.tolist() if array.dtype.kind in "biuf" else array.astype(float).tolist()
    if dtypes:
        return f"{array.dtype.name}{tuple(array.shape)}:{values}"
    return repr(values)


def _emit(line: str) -> None:
    print(line, flush=True)


def called_tap_func(arg: Any, transforms: Any) -> None:
    _emit(f"called tap_func with {arg}")


def tap_pytree(arg: Any, transforms: Any, *, what: str = "") -> None:
    _emit(f"{what}: {describe(arg)}")


def pause_tap(idx: Any, transforms: Any) -> None:
    time.sleep(0.1)
    _emit(f"pause_tap {int(idx)}")


def count_arrays(arg: Any, transforms: Any) -> None:
    _emit(f"tap {type(arg).__name__} {len(arg)}")


def noop(arg: Any, transforms: Any) -> None:
    pass


def tap_err(*args: Any, **kwargs: Any) -> None:
    raise ValueError("Some user message")


def tap_err_not_implemented(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError


def record(arg: Any, transforms: Any) -> None:
    _emit(f"record {describe(arg)}")


def record_other(arg: Any, transforms: Any) -> None:
    _emit(f"other {describe(arg)}")


def record_transforms(arg: Any, transforms: Any) -> None:
    _emit(f"{describe(arg)} transforms={[(name, params) for name, params in transforms]!r}")


def record_typed(arg: Any, transforms: Any) -> None:
    _emit(describe(arg, dtypes=True))
