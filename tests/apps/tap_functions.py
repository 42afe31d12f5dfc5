"""Importable tap functions for `tapd subscribe tap_functions` in the tests."""

from __future__ import annotations

from typing import Any


def record(arg: Any, transforms: Any, **kwargs: Any) -> None:
    print(f"RECORD arg={arg.tolist()} transforms={list(transforms)} kwargs={kwargs}", flush=True)
