"""The tap function behind `tapd.id_print`, run by `tapd subscribe tapd.printing`."""

from __future__ import annotations

import sys
from typing import Any


def print_tap(arg: Any, transforms: Any, *, what: str | None = None, **kwargs: Any) -> None:
    parts = [f"{what}:" if what else ""]
    if transforms:
        parts.append(f"transforms={list(transforms)}")
    parts += [f"{k}={v}" for k, v in kwargs.items()]
    header = " ".join(p for p in parts if p)
    print(f"{header}\n{arg}" if header else str(arg), file=sys.stdout, flush=True)
