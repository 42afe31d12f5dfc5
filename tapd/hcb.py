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

import sys
from collections.abc import Sequence
from typing import Any

import tapd
from tapd import (
    CallbackException,
    CallbackFlavor,
    TapFunctionException,
    barrier_wait,
    id_print,
    id_tap,
    script_runner,
)
from tapd.hcb_hook import MODULE, install

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
    if name in tapd._NOT_HERE:
        return getattr(tapd, name)  # raises, saying what to use
    raise AttributeError(f"module {MODULE!r} (tapd.hcb) has no attribute {name!r}")


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
