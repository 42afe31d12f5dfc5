"""A native library built against a newer jaxlib's XLA FFI headers is never registered
on an older jaxlib: XLA refuses such a handler, and the refusal can take down JAX's
whole CPU backend ("Unable to initialize backend 'cpu'"). "Newer" here: this jaxlib's
headers with the FFI API's minor version raised by one, compiled for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import PROCESS_TIMEOUT, Daemon, native_unavailable

pytestmark = pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable()))

# In a fresh process: the library as tapd finds it, then JAX's CPU backend and a tap.
PROBE = """
import json, sys
from pathlib import Path
from tapd.native import library
# The library `pip install` would have put next to tapd ("-": none).
packaged = None if sys.argv[1] == "-" else Path(sys.argv[1])
library._packaged = lambda stem="_tapd_native": packaged if stem == "_tapd_native" else None
import jax, jax.numpy as jnp, tapd
total = float(jax.jit(lambda x: tapd.tap(x, "probe").sum())(jnp.ones(3)))
print(json.dumps({"handler": library.has_handler("cpu"), "reason": library.handler_reason("cpu"),
                  "backend": tapd.backend(), "total": total}))
"""


@pytest.fixture(scope="module")
def newer_headers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tapd.native import build

    include = build.ffi_include_dir()
    assert include is not None
    newer = tmp_path_factory.mktemp("newer-jaxlib") / "include"
    shutil.copytree(include, newer)
    c_api = newer / "xla" / "ffi" / "api" / "c_api.h"
    text = c_api.read_text()
    minor = int(re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text).group(1))  # type: ignore[union-attr]
    c_api.write_text(re.sub(r"(#define\s+XLA_FFI_API_MINOR\s+)\d+", rf"\g<1>{minor + 1}", text))
    return newer


@pytest.fixture(scope="module")
def newer_library(newer_headers: Path) -> Path:
    from tapd.native import build

    return build.compile_ring(newer_headers.parent / "libtapd_newer.so", newer_headers)


def probe(
    daemon: Daemon, library: str, cache: Path, env: dict[str, str] | None = None
) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, library],
        env={
            **os.environ,
            "XDG_CACHE_HOME": str(cache),
            "TAPD_ENDPOINT": daemon.endpoint,
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    output: dict[str, object] = json.loads(result.stdout.splitlines()[-1])
    return output


def test_a_packaged_library_built_for_a_newer_jaxlib_is_not_registered(
    start_daemon: Callable[..., Daemon], newer_library: Path, tmp_path: Path
) -> None:
    found = probe(
        start_daemon(), str(newer_library), tmp_path / "cache", {"CXX": "/nonexistent/c++"}
    )
    assert found["handler"] is False and found["backend"] == "portable"
    assert re.search(r"built for XLA FFI API 0\.\d+, this jaxlib has 0\.\d+", str(found["reason"]))
    assert found["total"] == 3.0  # JAX's CPU backend is alive


def test_a_library_built_against_newer_headers_named_by_the_environment_is_not_registered(
    start_daemon: Callable[..., Daemon], newer_headers: Path, newer_library: Path, tmp_path: Path
) -> None:
    # TAPD_XLA_FFI_INCLUDE names the headers to build against; what runs is still this
    # jaxlib, whose own headers decide. (The cache holds the build for those headers.)
    from tapd.native import build

    cache = tmp_path / "cache"
    (cache / "tapd").mkdir(parents=True)
    shutil.copy(newer_library, cache / "tapd" / f"libtapd_{build.ring_key(newer_headers)}.so")
    found = probe(start_daemon(), "-", cache, {"TAPD_XLA_FFI_INCLUDE": str(newer_headers)})
    assert found["handler"] is False and found["backend"] == "portable"
    assert "this jaxlib has" in str(found["reason"])
    assert found["total"] == 3.0
