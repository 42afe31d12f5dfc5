"""Code that imports `jax.experimental.host_callback` itself (tests/apps/progress_lib.py,
as progress-bar code in sampling libraries did) runs on tapd: through
`tapd.install_host_callback()`, or with no code changed, `python -m tapd.hcb script.py`.
Real JAX processes tapping into a real daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from conftest import APPS, PROCESS_TIMEOUT, Daemon

StartDaemon = Callable[..., Daemon]
SCRIPT = APPS / "hcb_script.py"


def run(daemon: Daemon, *argv: str, cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        env={**os.environ, "TAPD_ENDPOINT": daemon.endpoint},
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
        cwd=cwd,
    )


def last_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result\n{result.stdout}\n{result.stderr}"
    output: dict[str, Any] = json.loads(lines[-1])
    return output


def test_python_m_tapd_hcb_runs_a_script_as_python_would_with_host_callback_served_by_tapd(
    start_daemon: StartDaemon,
) -> None:
    result = run(start_daemon(), "-m", "tapd.hcb", str(SCRIPT), "3", "--flag", "x y")
    assert result.returncode == 3, result.stderr  # the script's exit status
    seen = last_json(result)
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(SCRIPT), "3", "--flag", "x y"]
    assert seen["path0"] == str(APPS)  # progress_lib was found next to the script
    assert (seen["total"], seen["seen"]) == (10, [0, 1, 2, 3, 4])
    assert seen["module"] == "tapd.hcb" and seen["same"] is True


def test_a_failing_script_exits_as_under_python_with_its_traceback(
    start_daemon: StartDaemon,
) -> None:
    result = run(start_daemon(), "-m", "tapd.hcb", str(SCRIPT), "raise")
    assert result.returncode == 1
    assert "ValueError: the script failed" in result.stderr
    assert result.stderr.count("Traceback") == 1


def test_python_m_tapd_hcb_runs_a_module_with_dash_m(start_daemon: StartDaemon) -> None:
    result = run(start_daemon(), "-m", "tapd.hcb", "-m", "hcb_script", "0", cwd=str(APPS))
    assert result.returncode == 0, result.stderr
    seen = last_json(result)
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["0"]
    assert seen["seen"] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("jax_first", [False, True])
def test_install_host_callback_makes_the_librarys_own_import_give_tapd(
    start_daemon: StartDaemon, jax_first: bool
) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(APPS)!r})\n"
        + ("import jax.experimental\n" if jax_first else "")
        + "import tapd, tapd.hcb\n"
        "tapd.install_host_callback(); tapd.install_host_callback()  # idempotent\n"
        "import progress_lib, jax.experimental\n"
        "assert jax.experimental.host_callback is tapd.hcb is progress_lib.host_callback\n"
        "print(progress_lib.run_chain(4), progress_lib.seen)\n"
    )
    result = run(start_daemon(), "-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == "6 [0, 1, 2, 3]"


def test_without_it_the_import_fails_as_on_any_jax_since_0_8() -> None:
    code = f"import sys; sys.path.insert(0, {str(APPS)!r}); import tapd, progress_lib"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert result.returncode == 1
    assert re.search(r"(ModuleNotFound|Import)Error: .*host_callback", result.stderr)


@pytest.mark.fast
def test_tapd_hcb_has_host_callbacks_api_and_says_what_it_does_not_offer() -> None:
    import tapd
    import tapd.hcb

    assert tapd.hcb.id_tap is tapd.id_tap and tapd.hcb.barrier_wait is tapd.barrier_wait
    assert tapd.hcb.CallbackException is tapd.CallbackException
    with pytest.raises(AttributeError, match="io_callback"):
        tapd.hcb.call  # noqa: B018
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        tapd.hcb.nothing  # noqa: B018
