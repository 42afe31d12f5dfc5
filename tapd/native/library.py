"""Find, or build, and load tapd's native library; bind its C functions with ctypes.

Looked for, in order: the library `pip install` built next to this file, then the
per-user cache (`~/.cache/tapd/`), where `build()` compiles it on first use when a C++
compiler and jaxlib's XLA FFI headers are present. `load()` returns None with the reason
in `unavailable_reason()` when none of that works; callers fall back to the portable
backend and say so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

logger = logging.getLogger("tapd.native")

SOURCE = Path(__file__).with_name("tapd_native.cc")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False


def _packaged() -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(f"_tapd_native{suffix}")
        if path.exists():
            return path
    return None


def _ffi_include_dir() -> Path | None:
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        include = Path(location) / "include"
        if (include / "xla" / "ffi" / "api" / "ffi.h").exists():
            return include
    return None


def _cache_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes())
    include = _ffi_include_dir()
    if include is not None:
        digest.update((include / "xla" / "ffi" / "api" / "c_api.h").read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tapd"
    return root / f"libtapd_native-{digest.hexdigest()[:16]}.so"


def build(destination: Path) -> Path:
    """Compile the library to `destination`; raises RuntimeError saying what is missing."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    include = _ffi_include_dir()
    if include is None:
        raise RuntimeError("jaxlib's XLA FFI headers were not found (is jaxlib installed?)")
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_suffix(f".{os.getpid()}.tmp")
    command = [compiler, "-std=c++17", "-O3", "-fPIC", "-shared", "-isystem", str(include),
               str(SOURCE), "-o", str(partial)]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{result.stderr[-2000:]}")
    partial.replace(destination)  # atomic: concurrent builders do not see half a file
    return destination


def load(*, allow_build: bool = True) -> ctypes.CDLL | None:
    """The bound library, or None (see `unavailable_reason()`)."""
    global _library, _reason, _loaded
    with _lock:
        if _loaded:
            return _library
        _loaded = True
        path = _packaged()
        if path is None:
            cached = _cache_path()
            if cached.exists():
                path = cached
            elif allow_build:
                try:
                    path = build(cached)
                    logger.info("built tapd's native library at %s", path)
                except (RuntimeError, OSError) as exc:
                    _reason = str(exc)
                    return None
            else:
                _reason = "the native library was not built at install time"
                return None
        try:
            _library = _bind(ctypes.CDLL(str(path), use_errno=True))  # errno for messages
        except OSError as exc:
            _reason = f"cannot load {path}: {exc}"
            return None
        return _library


def unavailable_reason() -> str | None:
    return _reason


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    signatures = {
        "tapd_ring_create": ([c.c_char_p, c.c_uint64, c.c_uint32], c.c_void_p),
        "tapd_ring_open": ([c.c_char_p], c.c_void_p),
        "tapd_ring_close": ([c.c_void_p], None),
        "tapd_ring_install": ([c.c_void_p], None),
        "tapd_ring_readable": ([c.c_void_p, c.c_uint64, c.POINTER(c.c_void_p)], c.c_uint64),
        "tapd_ring_release": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_sleep": ([c.c_void_p, c.c_uint64], c.c_int),
        "tapd_ring_counters": ([c.c_void_p, c.POINTER(c.c_uint64)], None),
        "tapd_ring_set_reader": ([c.c_void_p, c.c_int64], None),
        "tapd_ring_write": ([c.c_void_p, c.c_uint64, c.c_uint32, c.c_int32, c.c_int64,
                             c.c_char_p, c.c_uint64], c.c_int),
        "tapd_ring_record_header_bytes": ([], c.c_uint64),
    }  # fmt: skip
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    return lib
