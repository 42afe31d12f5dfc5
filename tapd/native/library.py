"""Find, or build, and load tapd's native libraries; bind their C functions with ctypes.

The ring library (the shared-memory ring, with the XLA FFI handler for CPU built in
where jaxlib's FFI headers were found) and the CUDA handler library (`ffi_cuda.cc`,
where the CUDA runtime is found) are looked for, in order: next to this file, where
`pip install` built them, then in the per-user cache (`~/.cache/tapd/`), where they
are compiled on first use (`tapd.native.build` says with what). The ring needs only a
C++ compiler; each handler is optional.

Nothing here raises for a library that cannot be found, built or loaded: `load()`
returns None and `unavailable_reason()` says why; `has_handler(platform)` is False and
`handler_reason(platform)` says why. Callers fall back and say so once.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

from tapd.native import build

logger = logging.getLogger("tapd.native")

API_VERSION = 5  # tapd::kApiVersion in ring.h: the table the CUDA library writes through
PLATFORMS = ("cpu", "cuda")

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_handlers: dict[str, Any] = {}  # platform -> the handler's ctypes function
_handler_reasons: dict[str, str] = {}
_cuda: ctypes.CDLL | None = None  # the CUDA handler's library, once loaded


class _Unavailable(Exception):
    pass


def _packaged(stem: str = "_tapd_native") -> Path | None:
    """The library `pip install` built next to this file, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = Path(__file__).with_name(f"{stem}{suffix}")
        if path.exists():
            return path
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tapd"


def load(*, allow_build: bool = True) -> ctypes.CDLL | None:
    """The bound ring library, or None (see `unavailable_reason()`)."""
    global _library, _reason, _loaded
    with _lock:
        if not _loaded:
            _loaded = True
            try:
                _library = _load_ring(allow_build)
            except Exception as exc:  # whatever happens, the caller falls back
                _reason = str(exc) if isinstance(exc, _Unavailable) else _describe(exc)
                _library = None
        return _library


def unavailable_reason() -> str | None:
    return _reason


def has_handler(platform: str) -> bool:
    """Whether tapd's XLA FFI handler for `platform` ("cpu" or "cuda") is built and
    loaded (loading or building it now if need be)."""
    return handler(platform) is not None


def order_handler() -> Any:
    """The order handler's C function (tapd/emitter/order.py), where the CPU handler was
    built (it comes with it), else None."""
    if handler("cpu") is None:
        return None
    assert _library is not None
    return getattr(_library, "TapdOrder", None)


def handler(platform: str) -> Any:
    """The handler's C function (for `jax.ffi.pycapsule`), or None (see
    `handler_reason`)."""
    platform = platform.lower()
    if load() is None:
        return None
    with _lock:
        if platform not in _handlers and platform not in _handler_reasons:
            try:
                if platform == "cuda":
                    _handlers[platform] = _load_cuda()
                elif platform == "cpu":
                    raise _Unavailable(_handler_reasons.get("cpu", "not built"))
                else:
                    raise _Unavailable(f"tapd has no FFI handler for platform {platform!r}")
            except Exception as exc:
                _handler_reasons[platform] = (
                    str(exc) if isinstance(exc, _Unavailable) else _describe(exc)
                )
        return _handlers.get(platform)


def handler_reason(platform: str) -> str | None:
    """Why there is no handler for `platform`, or None if there is one."""
    if has_handler(platform):
        return None
    if load() is None:
        return f"the ring library is unavailable: {_reason}"
    return _handler_reasons.get(platform.lower(), "unknown")


def status() -> dict[str, str]:
    """One line each on the ring library, the handlers and, where the CUDA handler is
    built, the commit its taps get on the first GPU (for `tapd doctor`)."""
    lib = load()
    lines = {"ring library": str(lib._name) if lib is not None else f"unavailable: {_reason}"}
    for platform in PLATFORMS:
        function = handler(platform)
        lines[f"{platform.upper()} handler"] = (
            "built" if function is not None else f"unavailable: {handler_reason(platform)}"
        )
    if _cuda is not None:
        variant, why = cuda_commit(0)
        lines["CUDA commit"] = f"{variant} ({why})"
    return lines


def cuda_commit(device: int = 0) -> tuple[str, str]:
    """The commit a CUDA tap on `device` gets (ffi_cuda.cc): "stream write", "side-stream
    host function", "host function", or "none" (no CUDA handler, or no such device), and
    why. It asks CUDA, so it initialises the CUDA runtime."""
    if not has_handler("cuda") or _cuda is None:
        return "none", f"no CUDA handler: {handler_reason('cuda')}"
    why = ctypes.create_string_buffer(512)
    variant = int(_cuda.tapd_cuda_commit_variant(device, why, len(why)))
    name = _cuda.tapd_cuda_commit_name(variant).decode()
    return name, why.value.decode(errors="replace")


def cuda_ring_registration() -> dict[str, Any] | None:
    """How this process's ring was registered with CUDA (bytes pinned, whether mapped
    for the devices, seconds it took), or None (no CUDA handler or no ring)."""
    if _cuda is None:
        return None
    pinned, mapped, seconds = ctypes.c_uint64(), ctypes.c_int(), ctypes.c_double()
    if (
        _cuda.tapd_cuda_ring_registration(
            ctypes.byref(pinned), ctypes.byref(mapped), ctypes.byref(seconds)
        )
        != 0
    ):
        return None
    return {"bytes": pinned.value, "mapped": bool(mapped.value), "seconds": seconds.value}


# ---- finding, building, loading --------------------------------------------------------


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _cached(key: str, allow_build: bool, compile_to: Any) -> Path:
    path = cache_dir() / f"libtapd_{key}.so"
    if path.exists():
        return path
    if not allow_build:
        raise _Unavailable("the native library was not built at install time")
    compile_to(path)
    logger.info("built tapd's native library %s", path)
    return path


def _load_ring(allow_build: bool) -> ctypes.CDLL:
    """The ring library: the packaged one if it has the CPU handler or none can be had
    here, else one built (with the handler if the FFI headers are here) in the cache."""
    include = build.ffi_include_dir()
    packaged = _packaged()
    fallback: ctypes.CDLL | None = None
    if packaged is not None:
        try:
            lib = _bind(ctypes.CDLL(str(packaged), use_errno=True))  # errno for messages
        except (OSError, AttributeError) as exc:  # another version's library
            logger.info("not using %s: %s", packaged, exc)
        else:
            incompatible = _incompatible(lib, "cpu", include)
            if hasattr(lib, "TapdTap") and incompatible is None:
                return _with_cpu_handler(lib)
            if incompatible is not None:
                _handler_reasons["cpu"] = incompatible
            if include is None or not allow_build:
                _handler_reasons.setdefault(
                    "cpu",
                    "tapd was built without jaxlib's XLA FFI headers, and they are not "
                    "here now (install jaxlib, or pip install with jaxlib present)",
                )
                return lib
            fallback = lib  # the ring works; try for the handler below
    try:
        try:
            path = _cached(
                build.ring_key(include), allow_build, lambda out: build.compile_ring(out, include)
            )
        except build.BuildError as exc:
            if include is None or fallback is not None:
                raise
            # The handler did not compile (headers of an unexpected jaxlib?): the ring alone.
            _handler_reasons["cpu"] = f"the CPU handler did not compile: {exc}"
            path = _cached(
                build.ring_key(None), allow_build, lambda out: build.compile_ring(out, None)
            )
        lib = _bind(ctypes.CDLL(str(path), use_errno=True))
    except (build.BuildError, OSError, AttributeError, _Unavailable) as exc:
        if fallback is not None:
            _handler_reasons.setdefault("cpu", f"the CPU handler could not be built: {exc}")
            return fallback
        if isinstance(exc, _Unavailable):
            raise
        raise _Unavailable(
            str(exc) if isinstance(exc, build.BuildError) else _describe(exc)
        ) from exc
    incompatible = _incompatible(lib, "cpu", include)
    if hasattr(lib, "TapdTap") and incompatible is None:
        return _with_cpu_handler(lib)
    _handler_reasons.setdefault(
        "cpu", incompatible or "jaxlib's XLA FFI headers were not found (is jaxlib installed?)"
    )
    return lib


def _incompatible(lib: ctypes.CDLL, platform: str, include: Path | None) -> str | None:
    """Why the handler in `lib` cannot run on this jaxlib, or None if it can (or if
    `lib` has no handler)."""
    function = getattr(lib, f"tapd_ffi_api_version_{platform}", None)
    if function is None:
        return None
    function.restype = ctypes.c_uint32
    built = int(function())
    # The API of the jaxlib that runs, from its own headers: $TAPD_XLA_FFI_INCLUDE may
    # name another jaxlib's, to build against (a refused handler downs JAX's CPU backend).
    versions = [build.ffi_api_version(p / "include") for p in build._package_dirs("jaxlib")]
    runtime = next((v for v in versions if v is not None), build.ffi_api_version(include))
    if build.ffi_compatible(built, runtime):
        return None
    assert runtime is not None
    return (
        f"the {platform.upper()} handler was built for XLA FFI API "
        f"{build.version_name(built)}, this jaxlib has {build.version_name(runtime)}"
    )


def _with_cpu_handler(lib: ctypes.CDLL) -> ctypes.CDLL:
    _handlers["cpu"] = lib.TapdTap
    _handler_reasons.pop("cpu", None)
    return lib


def _mapped(soname: str) -> bool:
    """Whether a library of this soname (libcudart.so.13, say) is mapped in this process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return re.search(rf"/{re.escape(soname)}(\.[0-9.]+)?$", maps, re.MULTILINE) is not None


def _load_cuda() -> Any:
    """The CUDA handler library, attached to the ring library; raises _Unavailable."""
    ring = _library
    assert ring is not None
    cuda = build.cuda_runtime()
    include = build.ffi_include_dir()
    # The handler's libcudart: the one JAX's plugin loaded, where it did (the same
    # soname then resolves to it), else the one it was built against.
    if cuda is not None and not _mapped(cuda.soname):
        try:
            ctypes.CDLL(str(cuda.library), mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # then the library's own rpath, or the system's
    path = _packaged("_tapd_cuda")
    buildable = include is not None and cuda is not None
    if path is not None:
        try:
            return _open_cuda(path, ring, include)
        except _Unavailable as exc:
            if not buildable:  # (an older build, or another jaxlib's: build one if we can)
                raise
            logger.info("not using %s: %s", path, exc)
    if include is None:
        raise _Unavailable("jaxlib's XLA FFI headers were not found (is jaxlib installed?)")
    if cuda is None:
        raise _Unavailable(build.cuda_missing())
    found = cuda
    try:
        path = _cached(
            build.cuda_key(include, cuda), True, lambda out: build.compile_cuda(out, include, found)
        )
    except build.BuildError as exc:
        raise _Unavailable(str(exc)) from exc
    return _open_cuda(path, ring, include)


def _open_cuda(path: Path, ring: ctypes.CDLL, include: Path | None) -> Any:
    """Load the CUDA handler library at `path`, check it, attach it to the ring library;
    its handler function. Raises _Unavailable saying why not."""
    global _cuda
    try:
        lib = ctypes.CDLL(str(path))
        function = lib.TapdTapCuda
        lib.tapd_cuda_attach.argtypes = [ctypes.c_void_p]
        lib.tapd_cuda_attach.restype = ctypes.c_int
        lib.tapd_cuda_runtime_version.restype = ctypes.c_int
        lib.tapd_cuda_commit_variant.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint64]
        lib.tapd_cuda_commit_variant.restype = ctypes.c_int
        lib.tapd_cuda_commit_name.argtypes = [ctypes.c_int]
        lib.tapd_cuda_commit_name.restype = ctypes.c_char_p
        lib.tapd_cuda_ring_registration.argtypes = [
            ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_int),
            ctypes.POINTER(ctypes.c_double),
        ]
        lib.tapd_cuda_ring_registration.restype = ctypes.c_int
        incompatible = _incompatible(lib, "cuda", include)
    except (OSError, AttributeError) as exc:
        raise _Unavailable(f"cannot load {path}: {exc}") from exc
    if incompatible is not None:
        raise _Unavailable(incompatible)
    if lib.tapd_cuda_attach(ring.tapd_ring_internal_api(API_VERSION)) != 0:
        raise _Unavailable(f"{path} was built from other sources than the ring library")
    _cuda = lib
    return function


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c = ctypes
    u64p = c.POINTER(c.c_uint64)
    signatures: dict[str, tuple[list[Any], Any]] = {
        "tapd_ring_create": ([c.c_char_p, c.c_uint64, c.c_uint32], c.c_void_p),
        "tapd_ring_open": ([c.c_char_p], c.c_void_p),
        "tapd_ring_close": ([c.c_void_p], None),
        "tapd_ring_install": ([c.c_void_p], None),
        "tapd_ring_install_at": ([c.c_void_p, c.c_int32], None),
        "tapd_ring_readable": ([c.c_void_p, c.c_uint64, c.POINTER(c.c_void_p)], c.c_uint64),
        "tapd_ring_release": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_sleep": ([c.c_void_p, c.c_uint64], c.c_int),
        "tapd_ring_gather": ([c.c_void_p, c.c_int], c.c_int),
        "tapd_ring_counters": ([c.c_void_p, u64p], None),
        "tapd_ring_nonce": ([c.c_void_p], c.c_uint64),
        "tapd_ring_set_reader": ([c.c_void_p, c.c_int64], None),
        "tapd_ring_write": (
            [c.c_void_p, c.c_uint64, c.c_uint32, c.c_int32, c.c_int64, c.c_char_p, c.c_uint64],
            c.c_int,
        ),
        # (ring or None, site, consumer, device, step, every, nleaves, data, sizes): the
        # data and sizes arrays as plain pointers, so that a caller passes ctypes arrays
        # or addresses without conversion.
        "tapd_ring_write_leaves": (
            [
                c.c_void_p,
                c.c_uint64,
                c.c_uint32,
                c.c_int32,
                c.c_int64,
                c.c_uint64,
                c.c_uint32,
                c.c_void_p,
                c.c_void_p,
            ],
            c.c_int,
        ),
        # (packed, device, sites, rings, site ids, consumers, everys, first leaf,
        # leaves, leaf offsets, leaf bytes, step bytes, step offsets: the arrays as plain
        # pointers; the offsets of the log's length, the log, the records' places and
        # the skipped counts; capacity): tapd/emitter/gathered/host.py
        "tapd_ring_write_gathered": (
            [
                c.c_void_p,
                c.c_int32,
                c.c_uint32,
                c.c_void_p,
                *[c.c_void_p] * 9,
                *[c.c_uint64] * 5,
            ],
            c.c_int64,
        ),
        # (the same arguments; the same records, seqs and counts, written in runs: one
        # reservation and one commit for many records)
        "tapd_ring_write_gathered_runs": (
            [
                c.c_void_p,
                c.c_int32,
                c.c_uint32,
                c.c_void_p,
                *[c.c_void_p] * 9,
                *[c.c_uint64] * 5,
            ],
            c.c_int64,
        ),
        # (ring or None, consumer, device): the seq its next tap takes.
        "tapd_ring_next_seq": ([c.c_void_p, c.c_uint32, c.c_int32], c.c_uint64),
        "tapd_ring_record_header_bytes": ([], c.c_uint64),
        "tapd_ring_internal_api": ([c.c_uint32], c.c_void_p),
        "tapd_ring_reserve_for_test": (
            [
                c.c_void_p,
                c.c_uint64,
                c.c_uint32,
                c.c_int32,
                c.c_int64,
                c.c_char_p,
                c.c_uint64,
                u64p,
            ],
            c.c_int,
        ),
        "tapd_ring_commit_for_test": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_abandon_for_test": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_reserve_bare_for_test": ([c.c_void_p, c.c_uint64], c.c_uint64),
        "tapd_ring_device_enqueue_for_test": ([c.c_void_p, c.c_uint64, c.c_int, c.c_int32], None),
        "tapd_ring_device_store_for_test": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_set_held": ([c.c_void_p, c.c_uint32], None),
        "tapd_ring_settled": ([c.c_void_p, c.c_uint32], c.c_uint64),
        "tapd_ring_set_site_every": ([c.c_void_p, c.c_uint64, c.c_uint32], c.c_uint32),
        "tapd_ring_rely_on_site": ([c.c_void_p, c.c_uint64], c.c_uint32),
        "tapd_ring_release_site": ([c.c_void_p, c.c_uint64], None),
        "tapd_ring_site_relied_on": ([c.c_void_p, c.c_uint64], c.c_uint32),
        "tapd_ring_site_every": ([c.c_void_p, c.c_uint64], c.c_uint32),
        "tapd_ring_skipped_by_site": ([c.c_void_p, u64p], c.c_uint32),
        # (ring or None, site, consumer, device, every): 1 if skipped (counted).
        "tapd_ring_skip": ([c.c_void_p, c.c_uint64, c.c_uint32, c.c_int32, c.c_uint64], c.c_int),
        "tapd_ring_skip_many": (
            [c.c_void_p, c.c_uint64, c.c_uint32, c.c_int32, c.c_uint64],
            None,
        ),
        # (ring, entry, its length, site, consumer): tapd/emitter/entries.py
        "tapd_ring_put_entry": ([c.c_void_p, c.c_char_p, c.c_uint64, c.c_uint64, c.c_uint32], None),
    }
    for name, (argtypes, restype) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = restype
    # (takes a ctypes callback of entries._RESOLVER_TYPE, passed as it is)
    lib.tapd_set_site_resolver.restype = None
    return lib
