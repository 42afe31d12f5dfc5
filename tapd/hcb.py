"""tapd as `jax.experimental.host_callback`, for code that imports host_callback itself.

Libraries that used host_callback (progress bars in sampling libraries, say) import it
themselves, and their users cannot edit them. After `tapd.install_host_callback()`,
`from jax.experimental import host_callback` and `import jax.experimental.host_callback
as hcb` give this module, in this process, from then on. It holds host_callback's
API as tapd has it: `id_tap`, `id_print`, `barrier_wait`, `CallbackException`
(`TapFunctionException`), `CallbackFlavor`; `call` and `stop_outfeed_receiver` say
what to use instead (docs/MIGRATING.md).

With no code changed at all:

    python -m tapd.hcb script.py [args...]     # as `python script.py [args...]`
    python -m tapd.hcb -m package.module [args...]

installs it, then runs the script as Python would: as `__main__`, with `sys.argv` the
script and its arguments, the script's directory first on `sys.path`, and its exit
status.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from tapd import (
    CallbackException,
    CallbackFlavor,
    TapFunctionException,
    barrier_wait,
    id_print,
    id_tap,
    script_runner,
)

MODULE = "jax.experimental.host_callback"

__all__ = [
    "CallbackException",
    "CallbackFlavor",
    "TapFunctionException",
    "barrier_wait",
    "id_print",
    "id_tap",
    "install",
]


def __getattr__(name: str) -> Any:
    """host_callback's `call` and `stop_outfeed_receiver`: an AttributeError that says
    what to use instead (tapd's words for them)."""
    import tapd

    if name in tapd._NOT_HERE:
        return getattr(tapd, name)  # raises, saying what to use
    raise AttributeError(f"module {MODULE!r} (tapd.hcb) has no attribute {name!r}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves `jax.experimental.host_callback` with this module (`tapd.hcb`)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, origin=__file__)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        # Whichever copy runs as `python -m tapd.hcb`, the API module is `tapd.hcb`.
        return importlib.import_module("tapd.hcb")

    def exec_module(self, module: ModuleType) -> None:
        pass  # imported already


_FINDER = _Finder()
_lock = threading.Lock()


def installed() -> bool:
    """Whether `install()` has run in this process (then `jax.effects_barrier()` raises
    what this process's tap functions raised, as host_callback's did)."""
    return _FINDER in sys.meta_path


def install() -> None:
    """Make `jax.experimental.host_callback` this module in this process (idempotent).
    Does not import JAX; a module already imported under that name is replaced."""
    with _lock:
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        # Done already, or the name was taken before: the import system asks the finders
        # only for a name that is not in sys.modules.
        existing = sys.modules.get(MODULE)
        if existing is not None and existing is not sys.modules.get("tapd.hcb"):
            del sys.modules[MODULE]
        if "jax.experimental" in sys.modules:  # then import it now, which sets the
            importlib.import_module(MODULE)  # attribute of jax.experimental


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tapd.hcb script.py [args]` or `python -m tapd.hcb -m module [args]`."""
    args = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m tapd.hcb script.py [args...]\n"
        "       python -m tapd.hcb -m module [args...]\n"
        "Runs the script as Python would, with `jax.experimental.host_callback` "
        "served by tapd.\n"
    )
    script_runner.main(args, usage, install)


if __name__ == "__main__":
    main()
