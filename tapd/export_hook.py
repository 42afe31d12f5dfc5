"""`import tapd` is all a process needs to load a tapped `jax.export` artifact.

`jax.export.deserialize` calls its serialization module's `deserialize`
(`jax._src.export.serialization`, which some JAX versions import with `jax` itself).
As that module is imported, this hook wraps that function so that it first registers
tapd's part (tapd.emitter.exported.register: its effects, which JAX makes again by class
name, its FFI handler, and the site resolver): `jax.export.deserialize` and the call
that follows then work in a process that never traced a tap. Registering waits for the
first deserialize, when JAX is whole. Importing tapd imports no JAX; the hook costs
other imports one string comparison.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

MODULE = "jax._src.export.serialization"

_lock = threading.Lock()


def _wrap(module: ModuleType) -> None:
    """Make `module.deserialize` register tapd's part first (idempotent)."""
    deserialize = getattr(module, "deserialize", None)
    if deserialize is None or getattr(deserialize, "tapd_registers", False):
        return

    @functools.wraps(deserialize)
    def deserialize_with_tapd(*args: Any, **kwargs: Any) -> Any:
        from tapd.emitter import exported

        exported.register()
        return deserialize(*args, **kwargs)

    deserialize_with_tapd.tapd_registers = True  # type: ignore[attr-defined]
    module.deserialize = deserialize_with_tapd  # type: ignore[attr-defined]


class _Loader(importlib.abc.Loader):
    """JAX's own loader of the module, then tapd's registration."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _wrap(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


_FINDER = _Finder()


def install() -> None:
    """Register tapd's part when JAX's serialization module is imported (at once if it
    has been; idempotent)."""
    with _lock:
        if MODULE in sys.modules:
            _wrap(sys.modules[MODULE])
        elif _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
