"""Notebooks under a real IPython kernel: what a cell's computations call back shows in
that cell's output, whole lines, in the order JAX's own `jax.debug` shows it.

The same notebook (cells built here with nbformat) runs with nbclient in a real
ipykernel on this Python, twice: with JAX's own `jax.debug` (the reference) and with
`import tapd; tapd.install_debug()` as its first cell. Each cell's stdout (its stream
outputs, concatenated) must be the reference's, character for character: a line that
shows in a later cell, or never, or is spliced into another line, fails its cell. The
reference is also checked against the text written out here, so that a change in JAX or
ipykernel shows as such, not as tapd's fault.

`id_print` has no JAX reference since JAX 0.8 removed host_callback; there the expected
text is host_callback's documented behaviour: the tap function ran before the
computation's result was available, so its lines show in the cell, before anything the
cell prints after reading that result, in `tapd.printing.print_tap`'s format.

Also: the cell's loop does not wait for a slow callback while it runs; a cell whose
callbacks outlast its bound (TAPD_CELL_TIMEOUT) says so in its output; and nothing a
cell's callbacks were to do is lost when the kernel shuts down (as Jupyter shuts it
down: a shutdown request, then a bounded wait) or restarts with some of it left.

One kernel per notebook run (started from a kernelspec naming this Python, in the
test's environment: a private runtime directory, JAX on CPU, no autostart), one tapd
daemon for the module; every cell has a timeout. A check that tapd's receiver ran the
callbacks keeps the comparisons from comparing JAX with itself.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import READY_PREFIX, rings_of, stop_process
from tapd.printing import print_tap

try:
    import ipykernel  # noqa: F401  (the kernel's own import; here to skip early)
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.util import run_sync
except ImportError as exc:  # the dev extra brings them
    pytest.skip(
        f"the notebook tests need nbclient, nbformat and ipykernel (pip install -e .[dev]): {exc}",
        allow_module_level=True,
    )

CELL_TIMEOUT = 60  # seconds for one cell, kernel startup likewise
KERNEL_NAME = "tapd-test"
RECEIVER = "tapd"  # how the names of tapd's threads begin (its receiver runs callbacks)

# ---- the notebooks ---------------------------------------------------------------------

INSTALL = "import tapd\ntapd.install_debug()"

IMPORTS = """
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
"""

# (name, source, JAX's output): the cells after the imports, in order. Each cell's text
# names it (c1, c2, ...), so that a line shown in the wrong cell says where it came from.
DEBUG_CELLS: list[tuple[str, str, str]] = [
    (
        "c1_three_prints",
        """
        @jax.jit
        def c1(x):
            jax.debug.print("c1 x {}", x)
            y = x * 2
            jax.debug.print("c1 y {}", y)
            jax.debug.print("c1 sum {s}", s=x + y)
            return y

        y1 = c1(jnp.float32(1.5)).block_until_ready()
        """,
        "c1 x 1.5\nc1 y 3.0\nc1 sum 4.5\n",
    ),
    (
        "c2_callback",
        """
        def show(step, value):
            with open(CALLBACK_THREADS, "a") as file:
                file.write(threading.current_thread().name + "\\n")
            print(f"c2 step {int(step)} value {float(value):.2f}")

        @jax.jit
        def c2(x):
            def body(i, acc):
                acc = acc + i
                jax.debug.callback(show, i, acc)
                return acc
            return lax.fori_loop(0, 4, body, x)

        y2 = c2(jnp.float32(0.0)).block_until_ready()
        """,
        "".join(f"c2 step {i} value {v:.2f}\n" for i, v in enumerate([0, 1, 3, 6])),
    ),
    (
        "c3_slow_callback",
        """
        def slow(i):
            time.sleep(0.05)
            print(f"c3 slow {int(i)}")

        @jax.jit
        def c3(x):
            def body(carry, i):
                jax.debug.callback(slow, i)
                return carry + i, None
            return lax.scan(body, x, jnp.arange(5))[0]

        y3 = c3(jnp.int32(0))
        print("c3 result", y3)
        """,
        "".join(f"c3 slow {i}\n" for i in range(5)) + "c3 result 10\n",
    ),
    (
        "c4_ordered_then_print",
        """
        @jax.jit
        def c4(x):
            jax.debug.print("c4 {}", x, ordered=True)
            return x * 2

        y = c4(jnp.int32(21))
        print("c4 result", y)
        """,
        "c4 21\nc4 result 42\n",
    ),
    (
        "c5_loop_of_steps",
        """
        @jax.jit
        def step(x):
            jax.debug.print("c5 step {}", x)
            return x + 1

        x = jnp.int32(0)
        for _ in range(20):
            x = step(x)
        print("c5 final", x)
        """,
        "".join(f"c5 step {i}\n" for i in range(20)) + "c5 final 20\n",
    ),
    (
        "c6_slow_loop",
        """
        def tick_slowly(i):
            time.sleep(0.1)
            print(f"c6 tick {int(i)}")

        @jax.jit
        def tick(i):
            jax.debug.callback(tick_slowly, i)
            return i + 1

        tick(jnp.int32(-1)).block_until_ready()  # compiled before the loop is timed
        start = time.perf_counter()
        i = jnp.int32(0)
        for _ in range(10):
            i = tick(i)
        i.block_until_ready()
        Path(LOOP_SECONDS).write_text(str(time.perf_counter() - start))
        print("c6 done", i)
        """,
        "".join(f"c6 tick {i}\n" for i in range(-1, 10)) + "c6 done 10\n",
    ),
    ("c7_plain_print", 'print("c7 plain")', "c7 plain\n"),
]
SLOW_LOOP_SLEEP = 10 * 0.1  # what c6's callbacks sleep in its timed loop, in all

ID_PRINT_CELLS = [  # after IMPORTS and INSTALL: id_print after a jax.debug.print cell
    (
        "i1_debug_print",
        """
        @jax.jit
        def i1(x):
            jax.debug.print("i1 x {}", x)
            return x + 1

        print("i1 result", i1(jnp.int32(1)))
        """,
    ),
    (
        "i2_id_print_then_print",
        """
        @jax.jit
        def i2(x):
            return tapd.id_print(x * 2, what="i2 x*2") + 1

        print("i2 result", i2(jnp.arange(3.0)))
        """,
    ),
    (
        "i3_id_print_in_scan",
        """
        @jax.jit
        def i3(xs):
            def body(total, x):
                tapd.id_print((x, total), what="i3")
                return total + x, None
            return lax.scan(body, jnp.int32(0), xs)[0]

        print("i3 result", i3(jnp.arange(3, dtype=jnp.int32)))
        """,
    ),
    ("i4_plain_print", 'print("i4 plain")'),
]

ID_PRINT_FIRST_CELLS = [  # after IMPORTS and `import tapd`: id_print is the first tapd call
    (
        "j1_id_print_then_print",
        """
        @jax.jit
        def j1(x):
            return tapd.id_print(x * 2, what="j1 x*2") + 1

        print("j1 result", j1(jnp.arange(3.0)))
        """,
    ),
    (
        "j2_id_print",
        """
        @jax.jit
        def j2(x):
            return tapd.id_print(x + 10, what="j2")

        y = j2(jnp.int32(5)).block_until_ready()
        """,
    ),
    ("j3_plain_print", 'print("j3 plain")'),
]


def id_printed(arg: Any, **kwargs: Any) -> str:
    """What `tapd.id_print(arg, **kwargs)` prints, by tapd's own formatter (host_callback's
    format: the keywords on one line, then the value)."""
    stream = StringIO()
    print_tap(arg, [], output_stream=stream, **kwargs)
    return stream.getvalue()


def _i3_expected() -> str:
    xs, total, text = range(3), 0, ""
    for x in xs:
        text += id_printed((np.int32(x), np.int32(total)), what="i3")
        total += x
    return text + f"i3 result {total}\n"


ID_PRINT_EXPECTED = {
    "i1_debug_print": "i1 x 1\ni1 result 2\n",
    "i2_id_print_then_print": id_printed(np.arange(3.0, dtype=np.float32) * 2, what="i2 x*2")
    + "i2 result [1. 3. 5.]\n",
    "i3_id_print_in_scan": _i3_expected(),
    "i4_plain_print": "i4 plain\n",
    "j1_id_print_then_print": id_printed(np.arange(3.0, dtype=np.float32) * 2, what="j1 x*2")
    + "j1 result [1. 3. 5.]\n",
    "j2_id_print": id_printed(np.int32(15), what="j2"),
    "j3_plain_print": "j3 plain\n",
}

# A cell that dispatches a loop whose callbacks append a line each to a file, slowly,
# and returns without reading the loop's result. Run where the end of a cell waits for
# less than their work takes, it says so and leaves some of it to the kernel's exit:
# what they do must all be done once the kernel has shut down or restarted.
APPEND_LINES = 40  # each sleeps 0.02 s: 0.8 s of work, more than CELL_BOUND
CELL_BOUND = "0.2"  # TAPD_CELL_TIMEOUT where the kernel is to shut down with work left
APPEND_CELL = """
def append_line(i):
    time.sleep(0.02)
    with open({path!r}, "a") as file:
        file.write(f"line {{int(i)}}\\n")

@jax.jit
def appending(x):
    def body(i, acc):
        jax.debug.callback(append_line, i)
        return acc + i
    return lax.fori_loop(0, {lines}, body, x)

out = appending(jnp.int32(0))
"""


def appending_notebook(path: Path) -> list[str]:
    return [INSTALL, IMPORTS, APPEND_CELL.format(path=str(path), lines=APPEND_LINES)]


def appended(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ---- running them ----------------------------------------------------------------------


@dataclass
class Cell:
    """One executed cell's outputs: stdout (stream texts concatenated, in order), each
    stream chunk as it came, stderr, and any error."""

    stdout: str
    chunks: list[str]
    stderr: str
    errors: list[str]

    @classmethod
    def of(cls, cell: Any) -> Cell:
        stdout = [o["text"] for o in cell.outputs if _stream(o, "stdout")]
        stderr = [o["text"] for o in cell.outputs if _stream(o, "stderr")]
        errors = [
            f"{o['ename']}: {o['evalue']}" for o in cell.outputs if o["output_type"] == "error"
        ]
        return cls("".join(stdout), stdout, "".join(stderr), errors)

    def describe(self) -> str:
        return f"stdout chunks {self.chunks!r}, stderr {self.stderr!r}, errors {self.errors!r}"


def _stream(output: Any, name: str) -> bool:
    return bool(output["output_type"] == "stream" and output["name"] == name)


class Kernel:
    """A real ipykernel on this test's Python (sys.executable), started in `env`, and
    shut down as Jupyter shuts one down: a shutdown request, then a bounded wait."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        kernels = workdir / "kernels"
        (kernels / KERNEL_NAME).mkdir(parents=True, exist_ok=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "tapd tests",
            "language": "python",
        }
        (kernels / KERNEL_NAME / "kernel.json").write_text(json.dumps(spec))
        self.manager = AsyncKernelManager(
            kernel_name=KERNEL_NAME,
            kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]),
            connection_file=str(workdir / f"kernel-{time.monotonic_ns()}.json"),
            transport="ipc",  # sockets in the private work directory, no TCP ports
        )
        self.manager.ip = str(workdir / "kernel")
        run_sync(self.manager.start_kernel)(env=env, cwd=str(workdir))

    def run(self, sources: list[str]) -> list[Cell]:
        """Execute a notebook of these cells here; each cell's outputs."""
        cells = [nbformat.v4.new_code_cell(textwrap.dedent(s).strip()) for s in sources]
        notebook = nbformat.v4.new_notebook(cells=cells)
        client = NotebookClient(
            notebook,
            km=self.manager,
            kernel_name=KERNEL_NAME,
            timeout=CELL_TIMEOUT,
            startup_timeout=CELL_TIMEOUT,
            allow_errors=True,
        )
        try:
            client.execute()
        finally:
            if client.kc is not None:
                client.kc.stop_channels()
        return [Cell.of(cell) for cell in notebook.cells]

    def restart(self) -> None:
        run_sync(self.manager.restart_kernel)(now=False)

    def shutdown(self) -> None:
        if run_sync(self.manager.is_alive)():
            run_sync(self.manager.shutdown_kernel)(now=False)


@dataclass
class Setting:
    """Where kernels run: a private work directory, and the environment every kernel
    gets: this module's tapd daemon, its runtime directory, JAX on CPU, no autostart."""

    workdir: Path
    env: dict[str, str]

    def kernel(self, **env: str) -> Kernel:
        """A kernel of its own, with `env` added to the environment."""
        return Kernel(self.workdir, {**self.env, **env})

    def run(self, sources: list[str]) -> list[Cell]:
        """A notebook of these cells, run in a kernel of its own, then shut down."""
        kernel = self.kernel()
        try:
            return kernel.run(sources)
        finally:
            kernel.shutdown()


@pytest.fixture(scope="module")
def setting() -> Iterator[Setting]:
    # Short on purpose: ipc:// paths must stay under 107 bytes (as conftest's runtime_dir).
    runtime = Path(tempfile.mkdtemp(prefix="tapd-", dir="/tmp"))
    os.chmod(runtime, 0o700)
    workdir = runtime / "work"
    workdir.mkdir()
    endpoint = f"ipc://{runtime}/tapd.sock"
    log = runtime / "tapd.log"
    argv = [sys.executable, "-m", "tapd", "start", "--endpoint", endpoint]
    argv += ["--pidfile", str(runtime / "tapd.pid"), "--startup-grace", "0"]
    with open(log, "w") as stderr:
        daemon = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert daemon.stdout is not None
    line = daemon.stdout.readline()  # blocks until ready (or exit)
    try:
        if not line.startswith(READY_PREFIX):
            pytest.fail(f"daemon did not become ready: {line!r}\n{log.read_text()}")
        env = {
            **os.environ,
            "TAPD_RUNTIME_DIR": str(runtime),
            "TAPD_ENDPOINT": endpoint,
            "TAPD_AUTOSTART": "0",
            "JAX_PLATFORMS": "cpu",
            "IPYTHONDIR": str(workdir / "ipython"),
            "JUPYTER_PLATFORM_DIRS": "1",
        }
        yield Setting(workdir, env)
    finally:
        stop_process(daemon)
        sys.stderr.write(log.read_text())  # shown by pytest when a test failed
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(rings_of(runtime), ignore_errors=True)


def debug_notebook(setting: Setting, name: str, *, tapd: bool) -> list[str]:
    """The debug notebook's sources, with tapd's install cell first when `tapd`."""
    loop_seconds, threads = setting.workdir / f"{name}-loop-seconds", threads_file(setting, name)
    imports = IMPORTS + f"LOOP_SECONDS = {str(loop_seconds)!r}\n"
    imports += f"CALLBACK_THREADS = {str(threads)!r}\n"
    return [*([INSTALL] if tapd else []), imports, *(source for _, source, _ in DEBUG_CELLS)]


def threads_file(setting: Setting, name: str) -> Path:
    return setting.workdir / f"{name}-callback-threads"


@dataclass
class DebugRun:
    cells: dict[str, Cell]  # by DEBUG_CELLS name
    setup: list[Cell]  # the install and imports cells
    loop_seconds: float | None  # c6's timed loop
    callback_threads: list[str]  # where c2's callbacks ran


def run_debug_notebook(setting: Setting, name: str, *, tapd: bool) -> DebugRun:
    cells = setting.run(debug_notebook(setting, name, tapd=tapd))
    setup, rest = cells[: len(cells) - len(DEBUG_CELLS)], cells[-len(DEBUG_CELLS) :]
    seconds = setting.workdir / f"{name}-loop-seconds"
    return DebugRun(
        {cell_name: cell for (cell_name, _, _), cell in zip(DEBUG_CELLS, rest, strict=True)},
        setup,
        float(seconds.read_text()) if seconds.exists() else None,
        appended(threads_file(setting, name)),
    )


@pytest.fixture(scope="module")
def jax_run(setting: Setting) -> DebugRun:
    """The debug notebook with JAX's own jax.debug: the reference."""
    return run_debug_notebook(setting, "jax", tapd=False)


@pytest.fixture(scope="module")
def tapd_run(setting: Setting) -> DebugRun:
    """The same notebook, `tapd.install_debug()` in its first cell."""
    return run_debug_notebook(setting, "tapd", tapd=True)


def run_id_print_notebook(
    setting: Setting, first: str, cells: list[tuple[str, str]]
) -> tuple[Cell, dict[str, Cell]]:
    ran = setting.run([first, *(source for _, source in cells)])
    return ran[0], {name: cell for (name, _), cell in zip(cells, ran[1:], strict=True)}


@pytest.fixture(scope="module")
def id_print_run(setting: Setting) -> tuple[Cell, dict[str, Cell]]:
    return run_id_print_notebook(setting, INSTALL + "\n" + IMPORTS, ID_PRINT_CELLS)


@pytest.fixture(scope="module")
def id_print_first_run(setting: Setting) -> tuple[Cell, dict[str, Cell]]:
    return run_id_print_notebook(setting, "import tapd\n" + IMPORTS, ID_PRINT_FIRST_CELLS)


def spliced(got: str, expected: str) -> list[str]:
    """Lines of `got` that are no whole line of `expected` (a line written in pieces,
    and another's text between them)."""
    whole = set(expected.splitlines())
    return [line for line in got.splitlines() if line not in whole]


def assert_cell(name: str, got: Cell, expected: str, of: str) -> None:
    assert not got.errors, f"cell {name} raised: {got.describe()}"
    assert got.stdout == expected, (
        f"cell {name} showed {got.stdout!r} where {of} shows {expected!r}; "
        f"lines that are no whole line of {of}'s: {spliced(got.stdout, expected)!r}; "
        f"{got.describe()}"
    )


# ---- the tests -------------------------------------------------------------------------

CELL_NAMES = [name for name, _, _ in DEBUG_CELLS]


@pytest.mark.parametrize("name", CELL_NAMES)
def test_jax_shows_each_cells_lines_in_that_cell(name: str, jax_run: DebugRun) -> None:
    # The reference itself, against the text written out above.
    expected = {cell_name: text for cell_name, _, text in DEBUG_CELLS}[name]
    assert_cell(name, jax_run.cells[name], expected, "this test")


def test_jaxs_loop_waits_for_its_slow_callbacks(jax_run: DebugRun) -> None:
    # What tapd must not do (test_tapds_loop_does_not_wait_for_slow_callbacks): shows
    # that c6 can tell.
    assert jax_run.loop_seconds is not None
    assert jax_run.loop_seconds >= SLOW_LOOP_SLEEP
    assert not any(name.startswith(RECEIVER) for name in jax_run.callback_threads)


def test_tapd_runs_the_callbacks_on_its_receiver(tapd_run: DebugRun) -> None:
    # Not JAX's own calls (tapd.debug's fallback where it has no daemon): otherwise the
    # comparisons below would compare JAX with itself.
    threads = tapd_run.callback_threads
    assert len(threads) == 4, tapd_run.cells["c2_callback"].describe()
    assert all(name.startswith(RECEIVER) for name in threads), threads


@pytest.mark.parametrize("name", CELL_NAMES)
def test_tapd_shows_each_cells_lines_in_that_cell_as_jax_does(
    name: str, jax_run: DebugRun, tapd_run: DebugRun
) -> None:
    for cell in tapd_run.setup:
        assert not cell.errors and not cell.stdout, f"install/imports: {cell.describe()}"
    assert_cell(name, tapd_run.cells[name], jax_run.cells[name].stdout, "jax.debug")


def test_tapds_loop_does_not_wait_for_slow_callbacks(tapd_run: DebugRun) -> None:
    assert tapd_run.loop_seconds is not None, tapd_run.cells["c6_slow_loop"].describe()
    assert tapd_run.loop_seconds < SLOW_LOOP_SLEEP / 2


@pytest.mark.parametrize("name", [name for name, _ in ID_PRINT_CELLS])
def test_id_print_shows_in_its_cell_before_what_the_cell_prints_after(
    name: str, id_print_run: tuple[Cell, dict[str, Cell]]
) -> None:
    first, cells = id_print_run
    assert not first.errors and not first.stdout, first.describe()
    assert_cell(name, cells[name], ID_PRINT_EXPECTED[name], "host_callback")


@pytest.mark.parametrize("name", [name for name, _ in ID_PRINT_FIRST_CELLS])
def test_id_print_as_the_notebooks_first_tapd_call_shows_in_its_cell(
    name: str, id_print_first_run: tuple[Cell, dict[str, Cell]]
) -> None:
    first, cells = id_print_first_run
    assert not first.errors and not first.stdout, first.describe()
    assert_cell(name, cells[name], ID_PRINT_EXPECTED[name], "host_callback")


@dataclass
class ShutdownRun:
    cells: list[Cell]  # install, imports, the appending cell
    asked: int  # lines in the file when the shutdown was asked for
    lines: list[str]  # and once it was done


@pytest.fixture(scope="module")
def shutdown_run(setting: Setting) -> ShutdownRun:
    """The appending notebook with a cell bound shorter than its callbacks' work, so that
    some of it is left when the cell ends; then the kernel is shut down."""
    path = setting.workdir / "shutdown-lines"
    kernel = setting.kernel(TAPD_CELL_TIMEOUT=CELL_BOUND)
    try:
        cells = kernel.run(appending_notebook(path))
        asked = len(appended(path))
    finally:
        kernel.shutdown()
    return ShutdownRun(cells, asked, appended(path))


def test_a_cell_that_reaches_its_bound_says_so(shutdown_run: ShutdownRun) -> None:
    cell = shutdown_run.cells[-1]
    assert not cell.errors, cell.describe()
    assert "TAPD_CELL_TIMEOUT" in cell.stdout + cell.stderr, cell.describe()


def test_nothing_is_lost_when_the_kernel_shuts_down(shutdown_run: ShutdownRun) -> None:
    assert not any(cell.errors for cell in shutdown_run.cells), [
        cell.describe() for cell in shutdown_run.cells
    ]
    lines = shutdown_run.lines
    assert lines == [f"line {i}" for i in range(APPEND_LINES)], (
        f"{len(lines)} lines after the shutdown, {shutdown_run.asked} when it was asked for"
    )


def test_nothing_is_lost_when_the_kernel_restarts(setting: Setting, tmp_path: Path) -> None:
    # (files of this test's own: the module's workdir outlives it, and a file the
    # notebook appends to must start empty each time the test runs)
    before, after = tmp_path / "restart-lines-1", tmp_path / "restart-lines-2"
    kernel = setting.kernel(TAPD_CELL_TIMEOUT=CELL_BOUND)
    try:
        cells = kernel.run(appending_notebook(before))
        asked = len(appended(before))
        kernel.restart()
        restarted = appended(before)
        # The restarted kernel serves tapd's callbacks again; then it shuts down.
        cells += kernel.run(appending_notebook(after))
    finally:
        kernel.shutdown()
    assert not any(cell.errors for cell in cells), [cell.describe() for cell in cells]
    assert restarted == [f"line {i}" for i in range(APPEND_LINES)], (
        f"{len(restarted)} lines after the restart, {asked} when it was asked for"
    )
    assert appended(after) == [f"line {i}" for i in range(APPEND_LINES)]
