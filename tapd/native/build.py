"""Where tapd's native sources and the headers they need are, and how to compile them.

Two libraries:

- the ring library (`ring.cc`; needs a C++17 compiler, nothing else), with the XLA FFI
  handler for CPU (`ffi_cpu.cc`) built in where jaxlib's FFI headers are found;
- the CUDA handler library (`ffi_cuda.cc`), where the FFI headers and a CUDA runtime
  are found: headers and libcudart from pip's wheels (CUDA 12: `nvidia-cuda-runtime-cu12`
  plus the `crt/` headers of `nvidia-cuda-nvcc-cu12`; CUDA 13: `nvidia-cuda-runtime` and
  `nvidia-cuda-crt`, both in `nvidia/cu13/`), else a toolkit ($CUDA_HOME, /usr/local/cuda).
  The major version JAX's CUDA plugin uses is preferred, so that one libcudart serves
  both. It is a library of its own so that a machine without CUDA never needs libcudart
  to load the ring.

Standard library only: setup.py loads this file by path at build time, where tapd's
dependencies may not be installed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
RING_SOURCES = ("ring.cc",)
CPU_SOURCES = ("ffi_cpu.cc",)
CUDA_SOURCES = ("ffi_cuda.cc",)
HEADERS = ("ring.h",)
FLAGS = ("-std=c++17", "-O3", "-fPIC", "-fvisibility-inlines-hidden")
CUDA_MAJORS = (12, 13)  # the libcudart.so.N tapd builds against


class BuildError(RuntimeError):
    """A library could not be compiled; the message says what is missing or failed."""


def compiler() -> str:
    found = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not found:
        raise BuildError("no C++ compiler found (set CXX or install g++)")
    return found


def _package_dirs(name: str) -> list[Path]:
    """The directories of an importable package, without importing it (a namespace
    package such as `nvidia` may have several)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def ffi_include_dir() -> Path | None:
    """jaxlib's XLA FFI headers: $TAPD_XLA_FFI_INCLUDE, else an importable jaxlib's."""
    candidates = [Path(p) for p in [os.environ.get("TAPD_XLA_FFI_INCLUDE")] if p]
    candidates += [p / "include" for p in _package_dirs("jaxlib")]
    for candidate in candidates:
        if (candidate / "xla" / "ffi" / "api" / "ffi.h").is_file():
            return candidate
    return None


def ffi_api_version(include: Path | None) -> int | None:
    """XLA_FFI_API_MAJOR << 16 | XLA_FFI_API_MINOR of the headers in `include`."""
    if include is None:
        return None
    try:
        text = (include / "xla" / "ffi" / "api" / "c_api.h").read_text(errors="replace")
    except OSError:
        return None
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    minor = re.search(r"#define\s+XLA_FFI_API_MINOR\s+(\d+)", text)
    if major is None or minor is None:
        return None
    return int(major.group(1)) << 16 | int(minor.group(1))


def ffi_compatible(built: int, runtime: int | None) -> bool:
    """Whether a handler built against FFI API `built` runs on a jaxlib whose headers
    say `runtime` (None: no jaxlib headers to tell; assume so). The same major version,
    and a minor at least the handler's."""
    if runtime is None:
        return True
    return built >> 16 == runtime >> 16 and built & 0xFFFF <= runtime & 0xFFFF


def version_name(version: int) -> str:
    return f"{version >> 16}.{version & 0xFFFF}"


@dataclasses.dataclass(frozen=True)
class CudaRuntime:
    includes: tuple[Path, ...]  # cuda_runtime_api.h, and the crt/ headers it includes
    lib_dir: Path  # holds `soname`
    soname: str = "libcudart.so.12"

    @property
    def library(self) -> Path:
        return self.lib_dir / self.soname

    def version(self) -> str:
        """CUDART_VERSION from the headers (e.g. "12090"), or "?"."""
        text = (self.includes[0] / "cuda_runtime_api.h").read_text(errors="replace")
        found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
        return found.group(1) if found else "?"


def _plugin_major() -> int | None:
    """The CUDA major of JAX's CUDA plugin, if one is installed: the handler is built
    against the same one, so that one libcudart serves the process."""
    for major in CUDA_MAJORS:
        try:
            if importlib.util.find_spec(f"jax_cuda{major}_plugin") is not None:
                return major
        except (ImportError, ValueError):
            pass
    return None


def _runtime_candidates() -> list[tuple[Path, Path | None]]:
    """(runtime directory with include/ and lib/, where else crt/ may be), in order."""
    nvidia = _package_dirs("nvidia")
    nvcc12_crt = next(
        (
            p / "cuda_nvcc" / "include"
            for p in nvidia
            if (p / "cuda_nvcc" / "include" / "crt" / "host_defines.h").is_file()
        ),
        None,
    )
    candidates = [(p / "cuda_runtime", nvcc12_crt) for p in nvidia]  # CUDA 12's wheels
    candidates += [(p / "cu13", None) for p in nvidia]  # CUDA 13's
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if value := os.environ.get(variable):
            candidates.append((Path(value), None))
    candidates.append((Path("/usr/local/cuda"), None))
    return candidates


def cuda_runtime() -> CudaRuntime | None:
    """A CUDA runtime to build the handler against ($TAPD_CUDA_RUNTIME_DIR first: a
    directory with include/ and lib/ or lib64/ holding libcudart.so.12 or .13, and only
    it when set), or None. JAX's plugin's major first; then the first place found."""
    chosen = os.environ.get("TAPD_CUDA_RUNTIME_DIR")
    candidates: list[tuple[Path, Path | None]] = (
        [(Path(chosen), None)] if chosen else _runtime_candidates()
    )
    plugin = _plugin_major()
    searches: list[tuple[list[tuple[Path, Path | None]], tuple[int, ...]]] = []
    if plugin is not None:
        searches.append((candidates, (plugin,)))
    searches += [([candidate], CUDA_MAJORS) for candidate in candidates]
    for places, majors in searches:
        for major in majors:
            for runtime, crt_elsewhere in places:
                if (found := _runtime_at(runtime, crt_elsewhere, major)) is not None:
                    return found
    return None


def _runtime_at(runtime: Path, crt_elsewhere: Path | None, major: int) -> CudaRuntime | None:
    soname = f"libcudart.so.{major}"
    include = runtime / "include"
    lib = next((d for d in (runtime / "lib", runtime / "lib64") if (d / soname).is_file()), None)
    if lib is None or not (include / "cuda_runtime_api.h").is_file():
        return None
    # cuda_runtime_api.h includes crt/host_defines.h: a toolkit and CUDA 13's wheels have
    # it beside; CUDA 12's runtime wheel does not, its nvcc wheel does.
    if (include / "crt" / "host_defines.h").is_file():
        return CudaRuntime((include,), lib, soname)
    if crt_elsewhere is not None and major == 12:
        return CudaRuntime((include, crt_elsewhere), lib, soname)
    return None


def cuda_missing() -> str:
    """Why cuda_runtime() found nothing."""
    return (
        "the CUDA runtime was not found (pip install nvidia-cuda-runtime-cu12 "
        "nvidia-cuda-nvcc-cu12, as jax[cuda12] does; or nvidia-cuda-runtime "
        "nvidia-cuda-crt for CUDA 13; or set TAPD_CUDA_RUNTIME_DIR to a toolkit)"
    )


def _digest(names: tuple[str, ...], *extra: bytes) -> str:
    digest = hashlib.sha256()
    for name in names:
        try:
            digest.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
        except OSError as exc:
            raise BuildError(f"tapd's native sources are not installed here: {exc}") from exc
    for item in extra:
        digest.update(item)
    return digest.hexdigest()[:16]


def ring_key(ffi_include: Path | None) -> str:
    """Names a ring library build: sources, and the FFI ABI if the CPU handler is in."""
    if ffi_include is None:
        return "ring-" + _digest(HEADERS + RING_SOURCES)
    abi = (ffi_include / "xla" / "ffi" / "api" / "c_api.h").read_bytes()
    return "ring+cpu-" + _digest(HEADERS + RING_SOURCES + CPU_SOURCES, abi)


def cuda_key(ffi_include: Path, cuda: CudaRuntime) -> str:
    abi = (ffi_include / "xla" / "ffi" / "api" / "c_api.h").read_bytes()
    return "cuda-" + _digest(
        HEADERS + CUDA_SOURCES, abi, cuda.version().encode(), str(cuda.library).encode()
    )


def ring_command(output: Path, ffi_include: Path | None) -> list[str]:
    sources = RING_SOURCES + (CPU_SOURCES if ffi_include is not None else ())
    includes = ["-isystem", str(ffi_include)] if ffi_include is not None else []
    return [
        compiler(),
        *FLAGS,
        "-shared",
        *includes,
        *[str(SOURCE_DIR / s) for s in sources],
        "-o",
        str(output),
    ]


def cuda_link_args(cuda: CudaRuntime) -> list[str]:
    # The wheel has no unversioned libcudart.so to link by -lcudart. The rpaths: where
    # it was found, and the same place relative to an installed tapd/native/.
    wheel_lib = "cu13/lib" if cuda.soname.endswith(".13") else "cuda_runtime/lib"
    return [
        "-L",
        str(cuda.lib_dir),
        f"-l:{cuda.soname}",
        f"-Wl,-rpath,{cuda.lib_dir}",
        f"-Wl,-rpath,$ORIGIN/../../nvidia/{wheel_lib}",
    ]


def cuda_command(output: Path, ffi_include: Path, cuda: CudaRuntime) -> list[str]:
    includes = ["-isystem", str(ffi_include)]
    for path in cuda.includes:
        includes += ["-isystem", str(path)]
    return [
        compiler(),
        *FLAGS,
        "-shared",
        *includes,
        *[str(SOURCE_DIR / s) for s in CUDA_SOURCES],
        "-o",
        str(output),
        *cuda_link_args(cuda),
    ]


def compile_ring(output: Path, ffi_include: Path | None) -> Path:
    return compile_with(lambda partial: ring_command(partial, ffi_include), output)


def compile_cuda(output: Path, ffi_include: Path, cuda: CudaRuntime) -> Path:
    return compile_with(lambda partial: cuda_command(partial, ffi_include, cuda), output)


def compile_with(command_for: Callable[[Path], list[str]], output: Path) -> Path:
    """Compile to `output` atomically (concurrent builders never see half a file)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    try:
        command = command_for(partial)
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        partial.unlink(missing_ok=True)
        raise BuildError(f"could not run the compiler: {exc}") from exc
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(f"compiling {output.name} failed:\n{result.stderr[-2000:]}")
    partial.replace(output)
    return output


def cuda_program_args(cuda: CudaRuntime) -> list[str]:
    """g++ arguments for a standalone CUDA runtime program (bench/gpu_baseline.cc):
    the runtime's headers, and its libcudart with an rpath to it."""
    includes = [arg for path in cuda.includes for arg in ("-isystem", str(path))]
    return [
        *includes,
        "-L",
        str(cuda.lib_dir),
        f"-l:{cuda.soname}",
        f"-Wl,-rpath,{cuda.lib_dir}",
        "-lpthread",
    ]


def main() -> int:
    """`python -m tapd.native.build`: what would be built here, and with what.
    `--cuda-program-args`: cuda_program_args, one a line (exit 1 without a runtime)."""
    include = ffi_include_dir()
    cuda = cuda_runtime()
    if sys.argv[1:] == ["--cuda-program-args"]:
        if cuda is None:
            print(cuda_missing(), file=sys.stderr)
            return 1
        print("\n".join([compiler(), *cuda_program_args(cuda)]))
        return 0
    print(f"compiler: {os.environ.get('CXX') or shutil.which('c++') or 'none'}")
    print(f"XLA FFI headers: {include or 'not found (the ring builds without the CPU handler)'}")
    print(f"CUDA runtime: {cuda or cuda_missing()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
