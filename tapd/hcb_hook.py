"""The import hook that makes `jax.experimental.host_callback` give `tapd.hcb`.

`tapd.install_host_callback()` (and `python -m tapd.hcb script.py`) puts a finder first
on `sys.meta_path` that serves the name `jax.experimental.host_callback` with the module
`tapd.hcb`, in this process from then on. Whether it has (`installed()`) decides what
`jax.effects_barrier()` does with what this process's tap functions raised
(tapd.emitter.lifecycle.after_jax_barrier): raise it, as host_callback's barrier did.

Its own module, apart from `tapd.hcb`, so that the emitter can ask without importing the
API module above it, and so that the hook has one state per process even where
`python -m tapd.hcb` runs a second copy of `tapd.hcb` as `__main__`. Imports no JAX.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

MODULE = "jax.experimental.host_callback"
_API = "tapd.hcb"  # the module served under MODULE's name


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `jax.experimental.host_callback` with `tapd.hcb`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=__file__)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # Whichever copy runs as `python -m tapd.hcb`, the API module is `tapd.hcb`.
        return importlib.import_module(_API)

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported already


_FINDER = _Finder()
_lock = threading.Lock()


def installed() -> bool:
    """Whether `install()` has run in this process (then `jax.effects_barrier()` raises
    what this process's tap functions raised, as host_callback's did)."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make `jax.experimental.host_callback` the module `tapd.hcb` in this process
    (idempotent). Does not import JAX; a module already imported under that name is
    replaced."""
    with _lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        # Done already, or the name was taken before: the import system asks the finders
        # only for a name that is not in sys.modules.
        existing = sys.modules.get(MODULE)
        if existing is not None and existing is not sys.modules.get(_API):
            del sys.modules[MODULE]
        if "jax.experimental" in sys.modules:  # then import it now, which sets the
            importlib.import_module(MODULE)  # attribute of jax.experimental
