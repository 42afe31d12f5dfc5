"""Loaded by every Python process of a scripts/suite-profile run (the directory is put on
PYTHONPATH): at exit, the process's CPU, its argv and whether it imported JAX, one JSON
line in $SUITE_PROFILE_DIR/processes. A process killed with SIGKILL writes nothing."""

import atexit
import json
import os
import resource
import sys
import time

_START = time.time()


def _record() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    line = json.dumps(
        {
            "argv": sys.argv[:3],
            "jax": "jax" in sys.modules,
            "cpu": usage.ru_utime + usage.ru_stime,
            "wall": time.time() - _START,
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
        }
    )
    try:  # (one write of O_APPEND: lines of concurrent processes do not interleave)
        fd = os.open(os.path.join(os.environ["SUITE_PROFILE_DIR"], "processes"),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)  # fmt: skip
        os.write(fd, (line + "\n").encode())
        os.close(fd)
    except (KeyError, OSError):
        pass


if "SUITE_PROFILE_DIR" in os.environ:
    atexit.register(_record)
