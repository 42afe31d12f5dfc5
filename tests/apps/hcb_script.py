"""A script run as `python -m tapd.hcb hcb_script.py STATUS [ARGS]`: uses a library that
imports host_callback itself, prints one JSON line of what it saw, exits with STATUS
(or raises, for STATUS "raise")."""

from __future__ import annotations

import json
import sys

import progress_lib  # found on sys.path as `python hcb_script.py` would find it

if __name__ == "__main__":
    total = progress_lib.run_chain(5)
    from jax.experimental import host_callback

    print(json.dumps({
        "name": __name__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "total": total,
        "seen": progress_lib.seen,
        "module": host_callback.__name__,
        "same": progress_lib.same_module(),
    }), flush=True)  # fmt: skip
    if sys.argv[1] == "raise":
        raise ValueError("the script failed")
    sys.exit(int(sys.argv[1]))
