"""tapd's JAX range: one statement of it (tapd.emitter.jax_compat) that pyproject.toml,
setup.py and scripts/setup agree with; outside it, `import tapd` says so in one line and
taps fail at trace time with the same words, never a TypeError from JAX internals."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import PROCESS_TIMEOUT
from tapd.emitter import jax_compat

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("version", "inside"),
    [("0.8.0", True), ("0.10.2", True), ("0.12.0.1", True), ("0.12.9.dev20270101", True),
     ("0.7.2", False), ("0.4.30", False), ("0.13.0", False), ("1.0", False)],
)  # fmt: skip
def test_the_range(version: str, inside: bool) -> None:
    reason = jax_compat.unsupported_reason(version)
    assert (reason is None) == inside
    if reason is not None:
        assert f"tapd supports {jax_compat.SUPPORTED}, and this is jax {version}" in reason
        assert "\n" not in reason


def test_pyproject_setup_and_scripts_setup_claim_the_same_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    low, high = jax_compat.SUPPORTED.removeprefix("jax").split(",")
    for extra in ("jax", "dev"):
        wanted = {f"jax{low},{high}", f"jaxlib{low},{high}"}
        assert wanted <= set(project["project"]["optional-dependencies"][extra]), extra
    assert f"jaxlib{low}" in (ROOT / "setup.py").read_text()
    assert f"jax{low},{high} jaxlib{low},{high}" in (ROOT / "scripts" / "setup").read_text()
    oldest = ".".join(map(str, jax_compat.FLOOR))
    assert f"jax=={oldest} jaxlib=={oldest}" in (ROOT / ".ci" / "run").read_text()


OUTSIDE = """
import jax, jax.numpy as jnp
jax.__version__ = "0.7.2"  # what tapd reads, as a jax of that version would say
import tapd
try:
    jax.jit(lambda x: tapd.tap(x, "t"))(jnp.ones(2))
except tapd.TapDefinitionError as exc:
    print("TAP:", exc)
try:
    jax.jit(lambda x: tapd.id_tap(print, x))(jnp.ones(2))
except tapd.TapDefinitionError as exc:
    print("ID_TAP:", exc)
"""


def test_outside_the_range_import_says_so_in_one_line_and_taps_fail_at_trace_time() -> None:
    result = subprocess.run([sys.executable, "-c", OUTSIDE], capture_output=True, text=True,
                            timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.splitlines()
    words = f"tapd supports {jax_compat.SUPPORTED}, and this is jax 0.7.2"
    assert line.startswith(words)
    assert result.stdout.splitlines() == [f"TAP: {line}", f"ID_TAP: {line}"]


def test_inside_the_range_import_says_nothing() -> None:
    result = subprocess.run([sys.executable, "-c", "import tapd"], capture_output=True,
                            text=True, timeout=PROCESS_TIMEOUT)  # fmt: skip
    assert (result.returncode, result.stderr) == (0, "")


def test_the_installed_jax_is_read_without_importing_it() -> None:
    code = (
        "import sys, tapd.emitter.jax_compat as c; print(c.installed_jax(), 'jax' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=PROCESS_TIMEOUT)  # fmt: skip
    import jax

    assert result.stdout.split() == [jax.__version__, "False"]
    assert re.match(r"\d+\.\d+", jax.__version__)
