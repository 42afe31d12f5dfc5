"""Builds tapd's native libraries, each optional (everything else is in pyproject.toml).

- `tapd.native._tapd_native`: the shared-memory ring (a C++17 compiler is all it
  needs), with the XLA FFI handler for CPU built in where jaxlib's FFI headers are found:
  $TAPD_XLA_FFI_INCLUDE, else an importable jaxlib. An isolated build (`pip install .`)
  asks for jaxlib as a build requirement (`setup_requires`, which setuptools' PEP 517
  backend reports and pip installs into the build environment) where jaxlib publishes
  wheels: Linux with glibc on x86_64 or aarch64. Elsewhere, or with
  TAPD_BUILD_WITH_JAXLIB=0, it does not, and the CPU handler is compiled on first use.
- `tapd.native._tapd_cuda`: the XLA FFI handler for CUDA, where the CUDA runtime from
  pip's nvidia-cuda-runtime-cu12 (and the crt/ headers of nvidia-cuda-nvcc-cu12) is
  importable too; with build isolation it is not, and tapd compiles it on first use
  where JAX has a GPU.

A library that cannot be built is a warning, not a failed install: tapd then compiles
it on first use if it can, or falls back to the portable backend (`tapd doctor` says
which). The sources ship in the wheel for that.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _native_build() -> Any:
    """tapd/native/build.py (standard library only), without importing tapd."""
    path = HERE / "tapd" / "native" / "build.py"
    spec = importlib.util.spec_from_file_location("_tapd_native_build", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


class OptionalBuildExt(build_ext):
    """A failed native build is a warning, not a failed install. Always a fresh build:
    what goes in (the handlers, the jaxlib headers) depends on the build environment,
    which setuptools' up-to-date check on the sources alone does not see.

    What the libraries hold is decided here, when they are built, not when setup.py is
    loaded: pip also loads it to ask for the build requirements, before jaxlib is in the
    build environment, and nothing is to be said about the headers then."""

    def finalize_options(self) -> None:
        self.distribution.ext_modules = extensions()  # in place of PLACEHOLDER
        super().finalize_options()
        self.force = True
        if not self.parallel:  # (each library is a compiler run of ~5 s: one a core)
            self.parallel = True

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, headers broken, ...
            self._skip("native libraries", exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._skip(ext.name, exc)

    def _skip(self, what: str, exc: Exception) -> None:
        print(
            f"tapd: {what} not built ({exc}); tapd compiles it on first use if it can, "
            "else uses the portable backend",
            file=sys.stderr,
        )


def jaxlib_build_requirement() -> list[str]:
    """jaxlib (for its FFI headers: ~85 MB, with numpy and scipy ~130 MB, pip caches
    it) where it has wheels for this interpreter; nothing elsewhere, so that a build
    never fails for want of it."""
    # Which one: a handler built against XLA FFI API 0.N runs on every jaxlib whose API
    # is 0.M, M >= N (tapd.native.library checks). Prebuilt wheels take the oldest
    # jaxlib tapd supports (TAPD_BUILD_JAXLIB, see [tool.cibuildwheel]) to serve them all.
    requirement = os.environ.get("TAPD_BUILD_JAXLIB") or "jaxlib>=0.8.0,<0.13"
    choice = os.environ.get("TAPD_BUILD_WITH_JAXLIB", "")
    if choice in ("0", "1"):
        return [requirement] if choice == "1" else []
    supported = (
        platform.system() == "Linux"
        and platform.machine().lower() in ("x86_64", "aarch64")
        and platform.libc_ver()[0] == "glibc"
        and (3, 11) <= sys.version_info[:2] < (3, 15)
    )
    return [requirement] if supported else []


def extensions() -> list[Extension]:
    native = _native_build()
    ffi = native.ffi_include_dir()
    cuda = native.cuda_runtime()
    flags = ["-std=c++17", "-O3", "-fvisibility-inlines-hidden"]
    sources = ["tapd/native/ring.cc"]
    if ffi is None:
        print(
            "tapd: jaxlib's XLA FFI headers not found at build time: the ring library is "
            "built without the CPU handler (compiled on first use if jaxlib is there then)",
            file=sys.stderr,
        )
    else:
        sources.append("tapd/native/ffi_cpu.cc")
        flags += ["-isystem", str(ffi)]
    built = [
        Extension(
            "tapd.native._tapd_native",
            sources=sources,
            depends=["tapd/native/ring.h"],
            extra_compile_args=flags,
            language="c++",
            optional=True,
        )
    ]
    if ffi is not None and cuda is not None:
        cuda_flags = [*flags]
        for include in cuda.includes:
            cuda_flags += ["-isystem", str(include)]
        built.append(
            Extension(
                "tapd.native._tapd_cuda",
                sources=["tapd/native/ffi_cuda.cc"],
                depends=["tapd/native/ring.h"],
                extra_compile_args=cuda_flags,
                extra_link_args=native.cuda_link_args(cuda),
                language="c++",
                optional=True,
            )
        )
    return built


# A stand-in, so that setuptools knows there are extensions to build (a platform wheel);
# build_ext puts the real ones in its place (OptionalBuildExt.finalize_options).
PLACEHOLDER = Extension("tapd.native._tapd_native", sources=["tapd/native/ring.cc"], optional=True)

setup(
    ext_modules=[PLACEHOLDER],
    setup_requires=jaxlib_build_requirement(),
    cmdclass={"build_ext": OptionalBuildExt},
    # The sources, so that tapd can compile what the install could not.
    package_data={"tapd.native": ["*.cc", "*.h"]},
)
