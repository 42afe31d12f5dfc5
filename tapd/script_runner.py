"""Run a script or module as `python` would, for `python -m tapd.hcb` and `python -m
tapd.debug`, which install something first: as `__main__`, with `sys.argv` the script
and its arguments, the script's directory first on `sys.path` (the current directory for
`-m module`), and its exit status."""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Callable, Sequence


def main(args: Sequence[str], usage: str, install: Callable[[], None]) -> None:
    """`args` is `script.py [args...]` or `-m module [args...]`: `install()`, then run it.
    No script (or -h, --help): `usage` on stderr, and exit 2 (0 if it was asked for)."""
    if not args or args[0] in ("-h", "--help") or list(args) == ["-m"]:
        sys.stderr.write(usage)
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    install()
    run(args)


def run(args: Sequence[str]) -> None:
    """`args` is `script.py [args...]` or `-m module [args...]`."""
    if args[0] == "-m":
        # sys.path[0] is the current directory already, as `python -m module` has it;
        # run_module sets argv[0] to the module's file.
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    script = args[0]
    sys.argv = [script, *args[1:]]
    if not sys.flags.safe_path:
        # `python script.py` puts the script's directory first on sys.path, where this
        # `-m` put the current directory.
        directory = os.path.dirname(os.path.abspath(script))
        if sys.path and sys.path[0] in ("", os.getcwd()):
            sys.path[0] = directory
        else:
            sys.path.insert(0, directory)
    runpy.run_path(script, run_name="__main__")
