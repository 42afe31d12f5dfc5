"""Builds tapd's optional native library (the XLA FFI tap and the shared-memory ring).

Everything else is in pyproject.toml. The library needs the XLA FFI headers that jaxlib
ships; they are looked for in $TAPD_XLA_FFI_INCLUDE, then in an importable jaxlib (use
`pip install --no-build-isolation` after installing jax, as scripts/setup does). Without
headers or a C++ compiler the install still succeeds: tapd then compiles the library
on first use if it can, or falls back to the portable backend (`tapd doctor` says which).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def ffi_include_dir() -> str | None:
    candidates = [os.environ.get("TAPD_XLA_FFI_INCLUDE", "")]
    spec = importlib.util.find_spec("jaxlib")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(p) / "include") for p in spec.submodule_search_locations]
    for candidate in candidates:
        if candidate and (Path(candidate) / "xla" / "ffi" / "api" / "ffi.h").exists():
            return candidate
    return None


class OptionalBuildExt(build_ext):
    """A failed native build is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, headers broken, ...
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(exc)

    def _skip(self, exc: Exception) -> None:
        print(
            f"tapd: native library not built ({exc}); the portable backend will be used",
            file=sys.stderr,
        )


include = ffi_include_dir()
extensions = []
if include is None:
    print(
        "tapd: XLA FFI headers not found (jaxlib not importable at build time); "
        "the native library is not built now",
        file=sys.stderr,
    )
else:
    extensions.append(
        Extension(
            "tapd.native._tapd_native",
            sources=["tapd/native/tapd_native.cc"],
            extra_compile_args=["-std=c++17", "-O3", "-isystem", include],
            language="c++",
            optional=True,
        )
    )

setup(ext_modules=extensions, cmdclass={"build_ext": OptionalBuildExt})
