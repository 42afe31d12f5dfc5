"""Where a host's daemon lives: the per-user 0700 runtime directory and its socket.

The default endpoint is `ipc://<runtime dir>/tapd.sock`, where the runtime directory is
`$TAPD_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/tapd`, else `/tmp/tapd-<uid>`. Only its
owner may enter it, which is what keeps other users off the unauthenticated ipc socket.
Also whether a process named by a pid (a ring's writer, a daemon's pidfile) still lives.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tapd.errors import ConfigError

# The runtime directory and the default endpoint are settings' defaults, defined there.
from tapd.settings import PIDFILE_NAME as PIDFILE_NAME
from tapd.settings import SOCKET_NAME as SOCKET_NAME
from tapd.settings import default_endpoint as default_endpoint
from tapd.settings import default_pidfile as default_pidfile
from tapd.settings import runtime_dir as runtime_dir

IPC_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
PID_MAX = 2**31 - 1  # pid_t is a 32-bit int; os.kill refuses anything larger


def ensure_private_dir(path: Path) -> Path:
    """Create `path` mode 0700, or check an existing one is ours and private: owned by
    this user, no access for others, and not a symbolic link."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:  # a link to nowhere, or a file
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create runtime directory {path}: {exc.strerror}") from exc
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode):
        raise ConfigError(
            f"runtime directory {path} is a symbolic link; tapd uses only a real directory "
            "of its own. Remove the link."
        )
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"runtime directory {path} is not a directory")
    if info.st_uid != os.getuid():
        raise ConfigError(f"runtime directory {path} belongs to uid {info.st_uid}, not to us")
    if info.st_mode & 0o077:
        raise ConfigError(
            f"runtime directory {path} has mode {oct(info.st_mode & 0o777)}; "
            "others could reach the socket. Run `chmod 700` on it or remove it."
        )
    return path


_Made = TypeVar("_Made")


def make_first_file(directory: Path, make: Callable[[], _Made]) -> _Made:
    """Create `directory` as ensure_private_dir does, then call `make`, which creates a
    file in it. A shared ring directory is removed by whoever leaves it looking empty
    (an emitter at exit, its daemon at stop), and it does look empty from our mkdir to our
    first file; if it vanished in that window, make it again and retry."""
    for _ in range(10):
        ensure_private_dir(directory)
        try:
            return make()
        except FileNotFoundError:
            if directory.is_dir():
                raise  # something else is missing
    raise ConfigError(f"{directory} was removed each time it was created; who removes it?")


def check_endpoint_dir(endpoint: str) -> None:
    """Before any client (emitter, subscriber, CLI) connects to an `ipc://` endpoint:
    the socket's directory must be ours, private, and not a link (it is created 0700 if
    missing). A daemon checks the same before it binds. Else ConfigError: another user
    could run a fake daemon there, to be sent taps or to feed subscribers."""
    if endpoint.startswith("ipc://"):
        ensure_private_dir(Path(endpoint.removeprefix("ipc://")).parent)


def check_ipc_endpoint(endpoint: str) -> None:
    """Refuse ipc paths the kernel would truncate, naming the path."""
    if endpoint.startswith("ipc://"):
        path = endpoint.removeprefix("ipc://")
        if len(path.encode()) > IPC_PATH_MAX:
            raise ConfigError(
                f"ipc path {path!r} is {len(path.encode())} bytes; the limit is {IPC_PATH_MAX}. "
                "Set TAPD_RUNTIME_DIR to a shorter directory."
            )


def ring_dir_for(endpoint: str) -> Path | None:
    """Where emitters of the daemon at `endpoint` put their shared-memory rings, so the
    daemon finds them: in /dev/shm (memory, never written back to disk) when it exists,
    in a private directory named after the socket's directory; else beside the socket.
    None for tcp endpoints: a ring is shared memory, so the daemon must be on this host."""
    if not endpoint.startswith("ipc://"):
        return None
    socket_dir = Path(endpoint.removeprefix("ipc://")).parent.resolve()
    shm = SHM_DIR
    if shm.is_dir() and os.access(shm, os.W_OK):
        digest = hashlib.sha256(str(socket_dir).encode()).hexdigest()[:12]
        return shm / f"{ring_dir_prefix()}{digest}"
    return socket_dir / "rings"


SHM_DIR = Path("/dev/shm")
RUNTIME_MARKER = "runtime"  # in a ring directory: the socket directory it serves


def ring_dir_prefix() -> str:
    return f"tapd-{os.getuid()}-"


def local_ring_dir_name(pid: int, token: str) -> str:
    """The name of a process's local ring directory (its wake socket; the ring itself is
    unlinked once mapped: tapd/emitter/local/path.py), beside the daemons' in /dev/shm."""
    return f"{ring_dir_prefix()}local-{pid}-{token}"


def local_ring_dir_pid(name: str) -> int | None:
    """The pid a local ring directory's name gives, or None if it is not one's."""
    found = re.fullmatch(rf"{re.escape(ring_dir_prefix())}local-(\d+)-[0-9a-f]+", name)
    return int(found.group(1)) if found else None


def mark_ring_dir(directory: Path, endpoint: str) -> None:
    """Note in `directory` which socket directory it serves (a daemon does, at start),
    so that `tapd clean` can tell the rings of a job whose runtime directory is gone."""
    socket_dir = Path(endpoint.removeprefix("ipc://")).parent.resolve()
    marker = directory / RUNTIME_MARKER
    if runtime_dir_of_rings(directory) != socket_dir:
        temporary = directory / f".{RUNTIME_MARKER}.{os.getpid()}"
        temporary.write_text(str(socket_dir))
        os.replace(temporary, marker)


def runtime_dir_of_rings(directory: Path) -> Path | None:
    """The socket directory a ring directory serves, as its daemon noted it; None if
    none did (or the note is not a plain absolute path)."""
    try:
        fd = os.open(directory / RUNTIME_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)
    return Path(text) if text.startswith("/") and "\0" not in text else None


def boot_id() -> str | None:
    """This boot of this host (the kernel's random boot id): two processes that read the
    same one run on one host, so they can share memory. None where the kernel has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def flock_holder(path: Path) -> int | None:
    """The pid holding a flock on `path`, from /proc/locks; None when nobody holds one
    (or the kernel does not say), 0 when one is held by a pid this namespace cannot see.
    Read, never taken: taking the lock even for an instant would make a daemon that
    starts at that instant exit "already running"."""
    try:
        status = path.stat()
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234567 0 EOF"; a waiter's line has "->".
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
            return max(int(fields[4]), 0) if fields[4].lstrip("-").isdigit() else 0
    return None


def read_pidfile(path: Path) -> int | None:
    """The pid a pidfile names, or None (no file, or not a number)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists. A number no process can have (0 and negative ones
    name process groups to os.kill; over pid_t's range it raises) is not alive."""
    if not (isinstance(pid, int) and 0 < pid <= PID_MAX):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited: only its parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
