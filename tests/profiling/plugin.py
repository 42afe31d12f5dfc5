"""pytest plugin of scripts/suite-profile: each test's wall time and CPU (the worker's own
and its reaped children's), one JSON line a test, in $SUITE_PROFILE_DIR/<worker>.tests."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

import pytest

_out: Any = None


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _out
    if _out is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        path = os.path.join(os.environ["SUITE_PROFILE_DIR"], f"{worker}.tests")
        _out = open(path, "a")  # noqa: SIM115 (open for the worker's life, a line a test)
    start = time.time()
    own, children = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    yield
    record = {
        "test": item.nodeid,
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": start,
        "end": time.time(),
        "cpu": _cpu(resource.RUSAGE_SELF) - own + _cpu(resource.RUSAGE_CHILDREN) - children,
    }
    _out.write(json.dumps(record) + "\n")
    _out.flush()
