"""`python -m tapd.debug [--io-callback] script.py [args...]` (or `-m module [args...]`):
run a script as Python would, with `jax.debug.callback`, `jax.debug.print` and
`jax.effects_barrier` served by tapd (`tapd.install_debug()`, done before the script
imports anything, so that libraries that bind `from jax.debug import callback` at
import get tapd's too). `--io-callback` also takes `jax.experimental.io_callback` calls
whose result is None (progress bars)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tapd import script_runner
from tapd.debug.install import install

USAGE = (
    "usage: python -m tapd.debug [--io-callback] script.py [args...]\n"
    "       python -m tapd.debug [--io-callback] -m module [args...]\n"
    "Runs the script as Python would, with jax.debug.callback and jax.debug.print run "
    "off the step by tapd\n(and, with --io-callback, io_callback calls that return "
    "nothing).\n"
)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    io_callback = bool(args) and args[0] == "--io-callback"
    if io_callback:
        args = args[1:]
    script_runner.main(args, USAGE, lambda: install(io_callback=io_callback))


if __name__ == "__main__":
    main()
