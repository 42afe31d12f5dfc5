"""tests/zygote.py: a program forked from the zygote runs as `python SCRIPT` would, as
a process of its own (the suite's JAX programs run so; its doc says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from zygote import run_program

PROGRAM = """
import atexit, json, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "pid": os.getpid(), "ppid": os.getppid(),
    "mark": os.environ.get("ZYGOTE_TEST_MARK"), "stdin": sys.stdin.read(),
    "path0": sys.path[0], "main": __name__, "file": __file__,
    "jax_imported": "jax" in sys.modules,
    "x64": bool(sys.modules["jax"].config.jax_enable_x64) if "jax" in sys.modules else None,
}), flush=True)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def program(tmp_path: Path) -> Path:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return script


def _run(script: Path, code: str, **env: str) -> tuple[dict[str, object], str, str, int]:
    done = run_program([sys.executable, str(script), code], env={**os.environ, **env}, timeout=60)
    first, *rest = done.stdout.splitlines()
    return json.loads(first), "\n".join(rest), done.stderr, done.returncode


def test_a_forked_program_has_its_argv_environment_stdio_and_exit(program: Path) -> None:
    got, rest, err, returncode = _run(program, "3", ZYGOTE_TEST_MARK="here")
    assert got["argv"] == [str(program), "3"] and got["mark"] == "here"
    assert got["cwd"] == os.getcwd() and got["stdin"] == ""  # (stdin: /dev/null)
    assert got["path0"] == str(program.parent) and got["main"] == "__main__"
    assert got["file"] == str(program)
    assert got["pid"] != os.getpid() and got["ppid"] != os.getpid()  # forked, not ours
    assert got["jax_imported"] is True  # (what the zygote is for)
    assert rest == "atexit ran" and err == "to stderr\n" and returncode == 3


def test_a_program_whose_import_environment_differs_forks_from_a_zygote_that_imported_so(
    program: Path,
) -> None:
    """JAX reads JAX_ENABLE_X64 at import: a zygote of its own imported JAX with it set,
    and the worker's zygote (without it) is still there for the programs without it."""
    got, rest, _, returncode = _run(program, "0", JAX_ENABLE_X64="1")
    assert got["ppid"] != os.getpid() and got["jax_imported"] is True
    assert got["x64"] is True
    assert rest == "atexit ran" and returncode == 0
    plain, *_ = _run(program, "0")
    assert plain["jax_imported"] is True and plain["x64"] is False


def test_a_program_past_its_timeout_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_program([sys.executable, str(script)], env=dict(os.environ), timeout=3)
    assert raised.value.output == "started\n"
