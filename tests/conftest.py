"""Fixtures that start real daemons, subscribers and JAX emitters as processes.

Every process is started with a short `ipc://` endpoint in a private temporary
directory and waited for by readiness (the daemon's ready line, the daemon's view of
its subscribers), never by a fixed sleep. Every process is stopped with a time bound.
"""

from __future__ import annotations

import atexit
import compileall
import fcntl
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from stacks import native_stacks
from zygote import run_program

from tapd.clients import control
from tapd.daemon.router import Router
from tapd.protocol import Message, decode
from tapd.runtime import ring_dir_for

# Every test starts the daemons it uses; none is started on demand behind its back
# (tests/test_autostart.py turns autostart on for its own runtime directories).
os.environ["TAPD_AUTOSTART"] = "0"
# Nor does one meet a daemon it did not start: the default endpoint is in a runtime
# directory of this process's (and of the processes it starts), not the user's, where
# their own daemons live (one started on demand by a JAX program stays 10 minutes). A
# test that reached the default endpoint by mistake talked to whatever served there.
os.environ["TAPD_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tapd-rt-", dir="/tmp")
atexit.register(shutil.rmtree, os.environ["TAPD_RUNTIME_DIR"], ignore_errors=True)
# Rings of 32 MiB unless a test sets its own size. A ring is mapped with MAP_POPULATE:
# at the 256 MB default each emitter, and the daemon that reads it, faults in the whole
# double mapping up front (0.2-0.3 s of system CPU a process, a sixth of the suite's).
# No test fills one by default; test_settings checks the default with TAPD_* cleared.
os.environ.setdefault("TAPD_BUFFER_BYTES", str(32 * 2**20))

APPS = Path(__file__).parent / "apps"
READY_PREFIX = "tapd ready:"
PROCESS_TIMEOUT = 60.0
ROOT = Path(__file__).parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Where Python writes no bytecode (PYTHONDONTWRITEBYTECODE, as in this project's
    containers), each of the suite's ~1200 processes (daemons, subscribers, JAX
    programs) compiled tapd's modules from source again: ~0.1 s of CPU each, a tenth of
    the suite's. They are compiled once here, before any test (a module changed since is
    compiled again by the next run, or from source by Python, as ever)."""
    if sys.dont_write_bytecode and os.environ.get("PYTEST_XDIST_WORKER") is None:
        for folder in ("tapd", "client", "tests"):
            compileall.compile_dir(ROOT / folder, quiet=1)


# ---- the fast tier (`pytest -m fast`) -----------------------------------------------
# A test marked `fast` starts no process: no daemon, no subscriber, no JAX subprocess,
# no CLI run. The audit hook holds it to that, so that the tier stays fast as tests are
# added: starting one fails the test, naming it.

_FAST_TEST: str | None = None  # the node id of the fast test running, if one is
_SPAWNS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.fork", "os.system", "os.exec"})


def _no_process_in_a_fast_test(event: str, args: tuple[Any, ...]) -> None:
    if _FAST_TEST is not None and event in _SPAWNS:
        raise RuntimeError(
            f"{_FAST_TEST} is marked fast, so it starts no process, but it ran {event} "
            f"{args[:2]!r}: drop its fast mark"
        )


sys.addaudithook(_no_process_in_a_fast_test)


# The modules with the longest tests (a minute or more of one worker, measured), run
# first: started last, one of them would keep its worker busy after the others finish.
LONG_FIRST = ("test_debug_repeated", "test_host_callback_compat", "test_multihost")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the marks made here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`scripts/test` runs `-n ... --dist loadgroup`), the tests that
    share a module-scoped fixture (one per value of its params) run on one worker, which
    makes it once; every other test goes to whichever worker is free."""

    # The gallery (tests/test_gallery.py: public programs, minutes, .venv-gallery) runs
    # only when asked for by name: `pytest -m gallery`.
    if "gallery" not in (config.getoption("markexpr", "") or ""):
        gallery = [item for item in items if item.get_closest_marker("gallery")]
        if gallery:
            config.hook.pytest_deselected(items=gallery)
            items[:] = [item for item in items if not item.get_closest_marker("gallery")]

    def rank(item: pytest.Item) -> int:
        name = item.module.__name__ if item.module else ""
        return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # (stable: the rest keep their order)
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        if item.get_closest_marker("waits") is not None:
            # Spread over the workers, the waiting tests met: in a run measured on 2 cores
            # the CPU fell to half for a minute while two or three workers sat in cut
            # links and idle exits at once. On one worker (~6 minutes of waiting, ~1 of
            # CPU) they leave the other workers the cores. (A group of many tests starts early:
            # pytest-xdist hands out the largest groups first.)
            item.add_marker(pytest.mark.xdist_group("waits"))
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = sorted(
            name
            for name, definitions in info.name2fixturedefs.items()
            if definitions[-1].scope == "module"
        )
        if shared:
            params = getattr(item, "callspec", None)
            values = [str(params.params[n]) for n in shared if params and n in params.params]
            group = "-".join([item.module.__name__ if item.module else "", *values])
            item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("loadgroup", False):  # (set in pytest-xdist's workers)
        for item in items:
            _group_in_node_id(item)


def _group_in_node_id(item: pytest.Item) -> None:
    """pytest-xdist's loadgroup sends the tests whose node ids end in one `@group` to one
    worker. Its own hook writes that ending to `item._nodeid`, which pytest 9.2 no longer
    reads (a node's id is `item._id`, a NodeId): no test was grouped, and each worker
    that ran a test of a module-scoped fixture made the fixture again (test_host_callback_
    compat's emitter groups ran 25 times instead of 8, 120 s of the suite's CPU). Where
    the id is a NodeId, the ending is written here; pytest-xdist's own then changes
    nothing that is read (on pytest 8 it does the work itself)."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9.2: pytest-xdist's hook works
        return
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})  # fmt: skip
    if names and isinstance(getattr(item, "_id", None), NodeId) and "@" not in item.nodeid:
        item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# ---- tests that run alone (the `alone` mark) -------------------------------------------
# A daemon at its start, and `tapd clean`, remove every ring directory in /dev/shm whose
# job is gone, of any job of this user: another test's too, and another run's (a clean
# clone's suite beside a worktree's, on a shared machine where every engineer is root:
# one started a daemon between an `alone` test's `tapd clean --dry-run` and its clean,
# which then found nothing to remove). A test that leaves one on purpose and checks who
# removes it runs while no other test runs, across pytest-xdist's workers and across
# this user's runs on this machine: each test holds a shared lock on a file of this
# user's, an `alone` one an exclusive lock; it takes the gate first, so that the others'
# next tests wait behind it instead of starving it. (The locks are taken before
# pytest-timeout's timer starts: a wait for another run's long test is not the test's.)


def _run_lock() -> tuple[int, int]:
    base = Path(tempfile.gettempdir()) / f"tapd-tests-{os.getuid()}"
    gate = os.open(f"{base}.gate", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    run_fd = os.open(f"{base}.run", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    return gate, run_fd


_LOCKS = _run_lock()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _FAST_TEST
    _FAST_TEST = item.nodeid if item.get_closest_marker("fast") else None
    alone = item.get_closest_marker("alone") is not None
    gate, run = _LOCKS
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    if not alone:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        return (yield)
    finally:
        _FAST_TEST = None
        fcntl.flock(run, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    """What a failed test left behind is collected in its own teardown: pytest keeps the
    failure's traceback (and every frame's locals: processes, pipes, sockets) in
    sys.last_* until the next test's call, whose ResourceWarnings they then became.
    Dropped here, before the teardown, whose end collects this test's warnings."""
    if getattr(sys, "last_value", None) is not None:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        gc.collect()
    return (yield)


def wait_until(condition: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    """Poll `condition` until truthy; fail the test naming `what` otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def stop_process(process: subprocess.Popen[str], timeout: float = 20.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        # What it was doing: a daemon writes its Python stacks to its log on SIGUSR1
        # (`tapd start`); gdb gives the native ones of any process.
        process.send_signal(signal.SIGUSR1)
        where = native_stacks(process.pid)
        process.kill()
        process.wait()
        pytest.fail(f"process {process.args!r} ignored SIGTERM for {timeout} s:\n{where}")
    finally:
        if process.stdout is not None:
            process.stdout.close()


def tapd_cmd(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run the `tapd` command in a subprocess, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", "tapd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def native_unavailable() -> str | None:
    from tapd.native import library

    if library.load() is None:
        return f"needs tapd's native library: {library.unavailable_reason()}"
    return None


@pytest.fixture(params=["native", "portable"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test once per emitter backend (emitters inherit TAPD_BACKEND)."""
    name: str = request.param
    if name == "native" and (reason := native_unavailable()):
        pytest.skip(reason)
    monkeypatch.setenv("TAPD_BACKEND", name)
    return name


def rings_of(runtime_dir: Path) -> Path:
    """The ring directory of the daemon whose socket is in `runtime_dir`."""
    directory = ring_dir_for(f"ipc://{runtime_dir}/tapd.sock")
    assert directory is not None
    return directory


def ring_files(runtime_dir: Path) -> list[Path]:
    """Emitters' ring and sites files there (named `<pid>-<random>.ring`/`.sites`; the
    daemon's `wake.sock` beside them is not one)."""
    return list(rings_of(runtime_dir).glob("*-*"))


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    # Short on purpose: ipc:// paths must stay under 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="tapd-", dir="/tmp"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(rings_of(path), ignore_errors=True)


class Daemon:
    def __init__(
        self, process: subprocess.Popen[str], endpoints: list[str], log: Path | None = None
    ) -> None:
        self.process = process
        self.endpoints = endpoints
        self.endpoint = endpoints[0]
        self.log_path = log

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path else ""

    def stats(self) -> dict[str, Any]:
        return control.stats(self.endpoint, timeout=5.0)

    def counters(self) -> dict[str, int]:
        return dict(self.stats()["counters"])

    def subscriber_count(self) -> int:
        return len(self.stats()["subscribers"])

    def stop(self) -> int:
        return stop_process(self.process)


@pytest.fixture
def start_daemon(runtime_dir: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*flags: str, name: str = "tapd.sock") -> Daemon:
        endpoint = f"ipc://{runtime_dir / name}"
        argv = [
            sys.executable,
            "-m",
            "tapd",
            "start",
            "--endpoint",
            endpoint,
            "--pidfile",
            str(runtime_dir / f"{name}.pid"),
            "--startup-grace",  # no subscriber is waiting to reconnect; tests may override
            "0",
            *flags,
        ]
        log = runtime_dir / f"{name}.log"
        with open(log, "w") as stderr:
            process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
        assert process.stdout is not None
        line = process.stdout.readline()  # blocks until ready (or exit)
        if not line.startswith(READY_PREFIX):
            process.kill()
            pytest.fail(f"daemon did not become ready: {line!r}\n{log.read_text()}")
        daemon = Daemon(process, line.removeprefix(READY_PREFIX).split(), log)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        stop_process(daemon.process)
        sys.stderr.write(daemon.log())  # shown by pytest when the test failed


class SubscriberProcess:
    """tests/apps/subscriber_app.py: records every tap it handles as a JSON line."""

    def __init__(self, process: subprocess.Popen[str], record: Path) -> None:
        self.process = process
        self.record = record

    def records(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        lines = self.record.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=PROCESS_TIMEOUT)


@pytest.fixture
def start_subscriber(runtime_dir: Path) -> Iterator[Callable[..., SubscriberProcess]]:
    started: list[SubscriberProcess] = []
    counter = iter(range(1000))

    def start(
        daemon: Daemon,
        *consumers: str,
        sleep_ms: float = 0,
        raise_on: str = "",
        window: int = 64,
        endpoint: str | None = None,
        env: dict[str, str] | None = None,
        assemble: bool = False,
        batch: bool = False,
        hold: Path | None = None,
        timed: bool = False,
    ) -> SubscriberProcess:
        """A subscriber of `daemon` (at `endpoint`, default its local one), connected;
        with `assemble`, its handlers are Assemblers recording one line per step; with
        `hold`, none of its handlers runs before that file exists; `timed`, its records
        say when each was handled (`handled_at`, wall clock)."""
        record = runtime_dir / f"sub{next(counter)}.jsonl"
        before = daemon.subscriber_count()
        argv = [
            sys.executable,
            str(APPS / "subscriber_app.py"),
            "--endpoint",
            endpoint or daemon.endpoint,
            "--record",
            str(record),
            "--sleep-ms",
            str(sleep_ms),
            "--raise-on",
            raise_on,
            "--window",
            str(window),
            *(["--assemble"] if assemble else []),
            *(["--batch"] if batch else []),
            *(["--hold", str(hold)] if hold else []),
            *(["--timed"] if timed else []),
            *consumers,
        ]
        process = subprocess.Popen(argv, env={**os.environ, **(env or {})})
        subscriber = SubscriberProcess(process, record)
        started.append(subscriber)
        wait_until(
            lambda: daemon.subscriber_count() > before or process.poll() is not None,
            "the subscriber to connect",
        )
        assert process.poll() is None, "subscriber exited early"
        return subscriber

    yield start
    for subscriber in started:
        stop_process(subscriber.process)


def run_emitter(
    endpoint: str,
    scenario: str,
    *args: str,
    env: dict[str, str] | None = None,
    expect_rc: int = 0,
    app: str = "emitter_app.py",
    timeout: float = PROCESS_TIMEOUT,
) -> dict[str, Any]:
    """Run one scenario of tests/apps/`app` (a real JAX process) against the daemon at
    `endpoint`; return the JSON object it prints last, with its stdout and stderr."""
    full_env = {**os.environ, "TAPD_ENDPOINT": endpoint, **(env or {})}
    result = run_program(
        [sys.executable, str(APPS / app), scenario, *args], env=full_env, timeout=timeout
    )
    assert result.returncode == expect_rc, (
        f"emitter {scenario} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"emitter {scenario} printed no result\n{result.stdout}\n{result.stderr}"
    output: dict[str, Any] = json.loads(lines[-1])
    output["stdout"], output["stderr"] = result.stdout, result.stderr
    return output


def run_own_ring_app(
    runtime_dir: Path, app: str, scenario: str, gather: str, *args: str, **settings: str
) -> dict[str, Any]:
    """One scenario of tests/apps/`app`, a gathered program on the portable backend that
    reads its own ring back (no daemon runs at the endpoint), TAPD_GATHER=`gather`."""
    env = {
        "TAPD_EXIT_TIMEOUT": "0",
        "TAPD_LOCAL_FALLBACK": "0",
        "TAPD_BACKEND": "portable",
        "TAPD_GATHER": gather,
        **settings,
    }
    endpoint = f"ipc://{runtime_dir}/tapd.sock"
    return run_emitter(endpoint, scenario, *args, env=env, app=app, timeout=240)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """`tapd keygen NAME --dir DIRECTORY`: the public and secret key files."""
    result = tapd_cmd("keygen", name, "--dir", str(directory))
    assert result.returncode == 0, result.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


class BackgroundEmitter(threading.Thread):
    """`run_emitter` on a thread, for what a test does while the emitter taps;
    `outcome()` waits for its result, or raises what it raised."""

    def __init__(self, endpoint: str, *scenario: str) -> None:
        super().__init__(daemon=True)
        self.args = (endpoint, *scenario)
        self.result: dict[str, Any] | BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = run_emitter(*self.args)
        except BaseException as exc:  # re-raised by the test, not lost in the thread
            self.result = exc

    def outcome(self) -> dict[str, Any]:
        self.join(timeout=PROCESS_TIMEOUT + 10)
        if not isinstance(self.result, dict):
            raise AssertionError(f"the emitter failed: {self.result!r}")
        return self.result


@pytest.fixture
def raw_peer() -> Iterator[Callable[[str], zmq.Socket[bytes]]]:
    """Plain ZeroMQ DEALER sockets, connected to an endpoint: a peer speaking the wire
    protocol by hand. Closed (bounded linger) after the test."""
    context = zmq.Context()
    sockets: list[zmq.Socket[bytes]] = []

    def connect(endpoint: str) -> zmq.Socket[bytes]:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(endpoint)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close(linger=1000)
    context.term()


# ---- a Router without sockets ---------------------------------------------------------


class InProcessRouter:
    """A daemon's Router with no sockets and no process: what it sends, to whom, is
    recorded (`sent`, `to`). The tests play its emitters and subscribers by calling it."""

    def __init__(
        self,
        *,
        policy: str = "block",
        queue_bytes: int = 1 << 20,
        daemon_id: str = "d",
        spool: tuple[Path, int, str] | None = None,
    ) -> None:
        self.sent: list[tuple[Any, list[Any]]] = []
        self.router = Router(
            self._record,
            policy=policy,
            queue_bytes=queue_bytes,
            window_bytes=1 << 20,
            daemon_id=daemon_id,
        )
        if spool is not None:  # (directory, limit, fallback)
            self.router.subscribers.configure_spool(*spool)
        self._seen: dict[Any, int] = {}  # taps each subscriber was sent and handled
        self._closed = False

    def _record(self, key: Any, frames: list[Any]) -> bool:
        self.sent.append((key, frames))
        return True

    def emitter(self, key: str = "em", pid: int = 1) -> None:
        self.router.emitter_hello(key, {"host": "h", "pid": pid, "process": 0})

    def subscribe(self, key: str, consumers: list[str], **fields: Any) -> None:
        """A subscriber's hello (window 64, named `key`, unless `fields` say otherwise)."""
        hello = {"consumers": consumers, "window": 64, "name": key, **fields}
        self.router.subscribers.hello(key, hello, now=0.0)
        # (as the daemon's loop does once its wants table is written; none here holds it)
        self.router.subscribers.send_welcomes(unless=lambda: False)

    def to(self, peer: Any, kind: str | None = None) -> list[Message]:
        """Decoded messages sent to `peer` (of `kind`, if given), in order."""
        messages = [decode(frames) for key, frames in self.sent if key == peer]
        return [m for m in messages if kind is None or m.kind == kind]

    def taken(self) -> list[tuple[Any, str]]:
        """(subscriber, consumer) of every tap sent since the last call."""
        out = []
        for key, frames in self.sent:
            message = decode(frames)
            if message.kind == "tap":
                out.append((key, message.header["consumer"]))
        self.sent.clear()
        return out

    def handle_all(self, peer: Any = "sub") -> list[int]:
        """Play subscriber `peer` (window 1 or more, no batches): ack each tap as it
        comes until no more come; their seqs, in arrival order."""
        seqs: list[int] = []
        for _ in range(1000):
            self.router.subscribers.pump()
            taps = self.to(peer, "tap")[self._seen.get(peer, 0) :]
            if not taps:
                return seqs
            for message in taps:
                self._seen[peer] = self._seen.get(peer, 0) + 1
                seqs.append(message.header["seq"])
                self.router.subscribers.ack(
                    peer, {"upto": message.header["tid"], "errors": []}, 0.0
                )
        raise AssertionError(f"{peer!r} is still sent taps after 1000 rounds")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.router.subscribers.close_spools()


MakeRouter = Callable[..., InProcessRouter]


@pytest.fixture
def in_process_router() -> Iterator[MakeRouter]:
    """Makes `InProcessRouter`s (keywords: policy, queue_bytes, daemon_id, spool); their
    spools are closed after the test."""
    made: list[InProcessRouter] = []

    def make(**options: Any) -> InProcessRouter:
        made.append(InProcessRouter(**options))
        return made[-1]

    yield make
    for box in made:
        box.close()
