"""The suite's JAX programs, forked from a process that has imported JAX already.

Each JAX process of the suite (~400 a run: emitters, local-path and debug programs)
spent ~0.6 s of CPU importing numpy and jax before its first line ran: a quarter of
the suite's CPU (scripts/suite-profile). `run_program` runs `python SCRIPT ARGS` as
`subprocess.run` does, but forks the program from a zygote (one per pytest worker,
started at its first use) that imported numpy and jax once, and nothing else: no tapd,
no backend, no thread of JAX's. The program is otherwise a fresh process of its own:
its argv, environment, working directory and stdin/stdout/stderr are the caller's, it
runs as `__main__`, and it exits as Python exits (atexit, tapd's exit drain), with its
status passed back.

Where the import itself may depend on the environment (JAX_*, XLA_*, PYTHON*, LD_* and
TF_CPP_* variables, read by JAX or Python at import), the program is forked from a zygote
that imported with the program's values of those: one zygote a set of values (a worker's
programs use a few: JAX_PLATFORMS=cpu, a count of forced devices), at most
`MAX_ZYGOTES` of them a worker, the least recently used closed first. Each program
that set JAX_PLATFORMS or XLA_FLAGS (~150 a run: test_gathered_slices, test_live,
test_debug*, ...) was started afresh before, paying the import each time. A command that
is not `python SCRIPT` is started by `subprocess.run`; TAPD_TEST_ZYGOTE=0 starts every
program so.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# Read at import by JAX (its flags), by Python (PYTHON*) or the loader: a program whose
# value of one differs from the zygote's starts as a process of its own.
_AT_IMPORT = ("JAX_", "XLA_", "PYTHON", "LD_", "TF_CPP_")

# The zygote: imports numpy and jax, then forks a child per connection. The child reads
# the request (argv, environment, working directory; stdin, stdout and stderr as file
# descriptors), forks the program, says its pid, waits for it and says its exit status.
# The program's process returns from serve() and runs its script at the top level, so
# that the interpreter's own exit (atexit) ends it.
_ZYGOTE = r"""
import json, os, runpy, select, socket, sys
import numpy, jax, jax.numpy  # (the point: imported once, before any fork)

def serve(path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    children = 0
    print("ready", flush=True)
    while True:
        # Reaped here (not by SIGCHLD ignored): so their CPU, and their programs', is
        # counted in ours, and ours in the worker's (time, scripts/suite-profile).
        while children and os.waitpid(-1, os.WNOHANG)[0]:
            children -= 1
        ready, _, _ = select.select([listener, sys.stdin], [], [], 1.0)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            for _ in range(children):  # the pytest worker that started us is done
                os.wait()
            os._exit(0)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            request = handle(conn)
            if request is not None:
                return request
            os._exit(0)
        children += 1
        conn.close()

def handle(conn):
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        return request
    for fd in fds:
        os.close(fd)
    conn.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
    return None

request = serve(sys.argv[1])
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
sys.argv = request["argv"][1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
del serve, handle, request
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# Zygotes a worker keeps at once (each ~160 MB, shared with its programs until written).
MAX_ZYGOTES = 6


def _import_environment(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables of `env` that the import may read: a zygote's key."""
    return tuple(
        sorted((name, value) for name, value in env.items() if name.startswith(_AT_IMPORT))
    )


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="tapd-zy-", dir="/tmp")
        self.path = os.path.join(self.directory, "z.sock")
        self.env = env
        self.running = 0  # programs it runs now (it is not closed under them)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, self.path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=self.env,
        )
        assert self.process.stdout is not None
        ready = self.process.stdout.readline()
        if ready != "ready\n":
            raise RuntimeError(f"the JAX zygote did not start: {ready!r}")
        atexit.register(self.close)

    @staticmethod
    def takes(argv: list[str]) -> bool:
        return len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float | None
    ) -> subprocess.CompletedProcess[str]:
        with (
            open(os.devnull, "rb") as stdin,
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
            socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn,
        ):
            conn.connect(self.path)
            request = {"argv": argv, "env": env, "cwd": os.getcwd()}
            socket.send_fds(
                conn, [json.dumps(request).encode()], [stdin.fileno(), out.fileno(), err.fileno()]
            )
            pid = json.loads(conn.recv(4096))["pid"]
            conn.settimeout(timeout)
            try:
                reply = conn.recv(4096)
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                conn.recv(4096)  # (its child has reaped it: the pid is free only now)
                raise subprocess.TimeoutExpired(
                    argv, timeout or 0.0, _read(out), _read(err)
                ) from None
            except BaseException:  # (pytest-timeout's, say): killed, as subprocess.run does
                os.kill(pid, signal.SIGKILL)
                raise
            returncode = json.loads(reply)["returncode"]
            return subprocess.CompletedProcess(argv, returncode, _read(out), _read(err))

    def close(self) -> None:
        if self.process.poll() is None:
            assert self.process.stdin is not None
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        Path(self.path).unlink(missing_ok=True)
        if os.path.isdir(self.directory):  # (closed once already if it was evicted)
            os.rmdir(self.directory)


def _read(file: Any) -> str:
    file.seek(0)
    data: bytes = file.read()
    return data.decode("utf-8", errors="replace")


# By the import environment they were started with, the most recently used last.
_zygotes: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_lock = threading.Lock()


def _zygote_for(env: dict[str, str]) -> _Zygote:
    key = _import_environment(env)
    with _lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or zygote.process.poll() is not None:
            idle = [k for k, z in _zygotes.items() if z.running == 0]
            while len(_zygotes) >= MAX_ZYGOTES and idle:
                _zygotes.pop(idle.pop(0)).close()
            # (its own interpreter starts with the program's PYTHON* and LD_* too)
            others = {n: v for n, v in os.environ.items() if not n.startswith(_AT_IMPORT)}
            zygote = _Zygote({**others, **dict(key)})
        _zygotes[key] = zygote
        zygote.running += 1
        return zygote


def run_program(
    argv: list[str], *, env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)`,
    forked from a zygote where it can be (the module's doc says when)."""
    if os.environ.get("TAPD_TEST_ZYGOTE", "1") != "0" and _Zygote.takes(argv):
        zygote = _zygote_for(env)
        try:
            return zygote.run(argv, env, timeout)
        finally:
            with _lock:
                zygote.running -= 1
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
