"""What a hung process is doing: its native stacks (gdb) and its Python stacks
(faulthandler), for a test that runs a real program and must say why a run hung.

A run can hang inside jaxlib itself: jaxlib 0.10.2's CPU LAPACK kernels deadlocked here
about 1 run in 8 under a batched QR, with JAX alone (shared/DESIGN.md, "Known traps"):
`lapack_sgeqrf_ffi` -> `jax::ParallelBatchMap` -> `BlockingCounter::Wait`, every Eigen
worker idle. `jaxlib_deadlock` tells that hang from one of tapd's by those frames.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import subprocess

GDB_TIMEOUT = 60.0  # s: gdb attaching and walking every thread of a JAX process
# s: what reporting a hung run may take beyond its limit: gdb, then the SIGABRT's wait.
# A test's own timeout (pytest-timeout) must leave it that, or the report is lost.
HANG_REPORT_S = GDB_TIMEOUT + 20.0

# jaxlib's LAPACK kernels (lapack_sgeqrf_ffi, lapack_dpotrf_ffi, ...) waiting in its
# batch loop: the deadlock of the known trap, not tapd's.
_LAPACK_FRAME = re.compile(r"\blapack_\w+_ffi\b")
_BATCH_WAIT = re.compile(r"ParallelBatchMap|BlockingCounter::Wait")


def native_stacks(pid: int) -> str:
    """Every thread's native stack (`gdb -batch -ex 'thread apply all bt'`), or why there
    is none (no gdb here, ptrace refused, the process gone)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "(no native stacks: gdb is not installed)"
    try:
        done = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-nx", "-ex", "set pagination off",
             "-ex", "thread apply all bt"],
            capture_output=True, text=True, timeout=GDB_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"(no native stacks: gdb took more than {GDB_TIMEOUT:g} s)"
    stacks = "\n".join(
        line for line in done.stdout.splitlines() if line.startswith(("#", "Thread"))
    )
    return stacks or f"(no native stacks: gdb said {done.stderr.strip()[-2000:]!r})"


def jaxlib_deadlock(stacks: str) -> bool:
    """Whether native stacks show jaxlib's LAPACK batch deadlock (see the module's doc)."""
    return bool(_LAPACK_FRAME.search(stacks) and _BATCH_WAIT.search(stacks))


@dataclasses.dataclass
class Run:
    """A finished run of a program, or a hung one with what it was doing."""

    returncode: int
    out: str
    err: str
    hung: bool = False
    native: str = ""  # a hung run's native stacks (its Python ones end `err`: faulthandler)

    def describe_hang(self, limit: float) -> str:
        return (
            f"hung for {limit:g} s; native stacks:\n{self.native[-100000:]}\n"
            f"Python stacks (faulthandler) and stderr:\n{self.err[-20000:]}\nstdout:\n{self.out}"
        )


def run_bounded(argv: list[str], env: dict[str, str], limit: float) -> Run:
    """Run `argv` to its end, or for `limit` seconds: then read its native stacks, send
    SIGABRT (faulthandler, turned on by PYTHONFAULTHANDLER=1, prints every thread's
    Python stack) and kill it if that does not end it."""
    env = {**env, "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:  # fmt: skip
        try:
            out, err = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            native = native_stacks(process.pid)
            process.send_signal(signal.SIGABRT)
            try:
                out, err = process.communicate(timeout=HANG_REPORT_S - GDB_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                out, err = process.communicate()
            return Run(process.returncode, out, err, hung=True, native=native)
        return Run(process.returncode, out, err)
