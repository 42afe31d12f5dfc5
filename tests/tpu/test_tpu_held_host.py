"""On a TPU: computations whose taps lie in the loop shapes of real solvers return while
the host function their taps call is held (tests/apps/held_host_app.py; issue 62), on
the gathered path TAPD_GATHER=auto takes there, with its defaults and with every step
a paced chunk that waits for the host's answer. tests/test_held_host_function.py runs
the same program on the CPU. On a TPU machine: `python -m pytest -c /dev/null --rootdir .
-p no:cacheprovider tests/tpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
from test_tpu_taps import TIMEOUT, tpu_missing

from conftest import APPS

PATHS = {"defaults": {}, "a paced chunk a step": {"TAPD_GATHER_LATENCY": "0.000001"}}


@pytest.fixture(autouse=True)
def _skip_without_tpu() -> None:
    if (reason := tpu_missing()) is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("path", list(PATHS))
def test_tpu_loops_of_solvers_return_while_their_host_function_is_held(path: str) -> None:
    env = {**os.environ, "TAPD_AUTOSTART": "0", "TAPD_GATHER": "auto", **PATHS[path]}
    result = subprocess.run([sys.executable, str(APPS / "held_host_app.py")], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    output: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    print(json.dumps(output))  # (the log: what arrived, per shape)
    for shape, got in output["results"].items():
        assert got["entered"], shape
        assert got["returned_while_held"] == [True, True], (shape, got["returned_while_held"])
        assert got["arrived"] == got["due"], shape
