"""Counting what became of taps in fault tests: emitter processes started and finished,
and a subscriber's records tallied step by step as delivered, duplicated or missing."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from conftest import APPS


@dataclasses.dataclass(frozen=True)
class Tally:
    """What a subscriber got of taps with steps 0..steps-1 (one tap per step)."""

    delivered: int  # steps that arrived at least once
    duplicated: int  # copies beyond the first
    missing: int  # steps that never arrived

    @classmethod
    def of(cls, records: Iterable[dict[str, Any]], steps: int) -> Tally:
        seen = collections.Counter(r["step"] for r in records)
        assert set(seen) <= set(range(steps)), sorted(set(seen) - set(range(steps)))
        for r in records:  # a copy is the same tap: same seq
            assert r["seq"] == r["step"], r
        return cls(len(seen), sum(seen.values()) - len(seen), steps - len(seen))


def start_emitter(
    endpoint: str,
    scenario: str,
    *args: str,
    env: dict[str, str] | None = None,
    stdin: int | None = None,
) -> subprocess.Popen[str]:
    """tests/apps/emitter_app.py; `stdin=subprocess.PIPE` for a scenario that waits to
    be told (steps_when_told)."""
    return subprocess.Popen(
        [sys.executable, str(APPS / "emitter_app.py"), scenario, *args],
        env={**os.environ, "TAPD_ENDPOINT": endpoint, **(env or {})},
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextlib.contextmanager
def running(emitter: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """`emitter`, killed and reaped if the block leaves it running: a test that fails
    halfway leaves no process behind."""
    try:
        yield emitter
    finally:
        if emitter.poll() is None:
            emitter.kill()
            emitter.communicate()


def finish(emitter: subprocess.Popen[str], timeout: float = 90) -> dict[str, Any]:
    """Wait for the emitter; return its last JSON line (its stats)."""
    with running(emitter):
        out, err = emitter.communicate(timeout=timeout)
    assert emitter.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["stderr"] = err
    return result
