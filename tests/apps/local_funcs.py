"""Importable tap functions for tests/test_local_functions.py: run in a subscriber process
(`tapd subscribe local_funcs`) when one takes them, else in the emitting process.

Each call prints one JSON line (the subscriber's stdout is the test's record) and is kept
in `CALLS` (what the emitting process reads back). No JAX here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

CALLS: list[dict[str, Any]] = []


def record(arg: Any, transforms: Any, **kwargs: Any) -> None:
    shown = {k: v if isinstance(v, str | int | float) else repr(v) for k, v in kwargs.items()}
    call = {
        "pid": os.getpid(),
        "arg": np.asarray(arg).tolist(),
        "transforms": [[name, params] for name, params in transforms],
        "kwargs": shown,
    }
    CALLS.append(call)
    print(json.dumps(call, default=list), flush=True)


class Counter:
    """Its bound method `tap` runs in the process that holds the object."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def tap(self, arg: Any, transforms: Any) -> None:
        self.values.append(float(arg))
