"""The gathered path (tapd/emitter/gathered/: the rewrite, rewrite.py; the flush,
flush.py) on the CPU, where `TAPD_BACKEND=portable TAPD_GATHER=on` forces it.

Each program of tests/apps/gathered_app.py runs under TAPD_GATHER=off (one host callback
a tap: the reference), and gathered with logs of 1 record (TAPD_GATHER_BYTES smaller
than one), 2, 3 and 7 records (TAPD_GATHER_TAPS: flushes in the middle of loops and
branches) and the default 1024. What the tap functions get must be what the reference
got, call for call, and what host_callback and jax.debug promise: program order inside
scan, fori_loop, while_loop, cond and jit-in-jit (host_callback's own cases), exact
counts, values and steps, transforms under vmap/grad/checkpoint, tapd.debug and
jax.debug under install_debug, id_print's text, hostile dtypes and shapes, barriers,
exceptions, the exit drain and full rings; a subscriber in another process gets the
same records (seq, step, device, transforms) either way. The HLO shows the path is
taken (one flush callback instead of one callback a tap), and where it must not be (a
tap in a loop's condition or in shard_map, a strict tap, a site with two shapes,
jax.export) the per-tap path runs, as before.

The local programs of every setting run at once, in one module fixture (each JAX process
costs seconds of CPU); each test then checks one property across the settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import APPS, Daemon, SubscriberProcess, native_unavailable, run_emitter, wait_until
from tapd.emitter.jax_compat import cpu_partition_id_in_branches

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]

pytestmark = [
    # The portable taps write the ring through tapd's native library.
    pytest.mark.skipif(native_unavailable() is not None, reason=str(native_unavailable())),
    pytest.mark.timeout(600),  # the first test runs every setting's programs
]

RUN_TIMEOUT = 400.0
BASE_ENV = {
    "TAPD_BACKEND": "portable",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    "JAX_PLATFORMS": "cpu",
    # The fixture's programs are compiled once each and run briefly: most of their CPU
    # (~70 s, the suite's largest single item) is XLA's backend optimizing code that runs
    # for microseconds. JAX's own switch for programs that cost more to optimize than to
    # run (XLA's backend at -O0) takes a quarter off; what is checked here (program
    # order, flushes, the HLO's callbacks) is decided in JAX's lowering and tapd's
    # rewrite, before that backend.
    "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
}


def taps(records: int) -> dict[str, str]:
    """Logs of `records` records, counted loops too (one log of a counted run only where
    it packs into a byte: never): flushes in the middle of loops and branches."""
    return {"TAPD_GATHER_TAPS": str(records), "TAPD_GATHER_LOG_BYTES": "1"}


# The cases of gathered_app.py's `local` scenario: those every setting runs (program
# order, transforms, barriers' exceptions), and those that cost more compiling than a
# small log adds to them (run under the reference, the default log, and a log of one).
ORDER_CASES = [
    "cond_with_jit",
    "across_computations",
    "while_cond",
    "nested",
    "scan_counts",
    "zero_length_and_dynamic_loops",
    "beside_jax_ordered_effects",
    "taps_in_a_loop_condition",
    "one_site_two_shapes",
    "vmapped",
    "grads",
    "exceptions",
    "debug_and_print",
    "placement",
]
EXIT_TAPS = 60


@dataclasses.dataclass(frozen=True)
class Setting:
    env: dict[str, str]
    cases: list[str]
    capacity: int | None = None  # records the log holds (None: not gathered)
    exit_drain: bool = False


SETTINGS = {
    "off": Setting(
        {"TAPD_GATHER": "off"},
        [
            *ORDER_CASES,
            "dtypes_and_shapes",
            "tiled_vectors",
            "many_leaves_and_sites",
            "barriers",
            "lowered",
        ],
    ),
    "on": Setting(
        {"TAPD_GATHER": "on"},
        [
            *ORDER_CASES,
            "dtypes_and_shapes",
            "tiled_vectors",
            "many_leaves_and_sites",
            "barriers",
            "lowered",
            "long_loops",
        ],
        capacity=1024,
    ),
    "bytes1": Setting(
        {"TAPD_GATHER": "on", "TAPD_GATHER_BYTES": "1", "TAPD_GATHER_LOG_BYTES": "1"},
        [*ORDER_CASES, "dtypes_and_shapes", "tiled_vectors"],
        capacity=1,
    ),
    "taps2": Setting({"TAPD_GATHER": "on", **taps(2)}, ORDER_CASES, capacity=2),
    "taps3": Setting(
        {"TAPD_GATHER": "on", **taps(3)},
        [*ORDER_CASES, "tiled_vectors"],
        capacity=3,
    ),
    # A 64 KiB ring under `block`: flushes of 7 records of 4 KiB wait for room.
    "taps7_block": Setting(
        {
            "TAPD_GATHER": "on",
            **taps(7),
            "TAPD_BUFFER_BYTES": str(64 * 1024),
            "TAPD_EMITTER_POLICY": "block",
        },
        [*ORDER_CASES, "barriers"],
        capacity=7,
        exit_drain=True,
    ),
}
GATHERED = [name for name, setting in SETTINGS.items() if setting.capacity is not None]


@dataclasses.dataclass
class Run:
    setting: str
    cases: dict[str, Any]
    stdout: str
    stderr: str
    exit_lines: list[str]

    def case(self, name: str) -> dict[str, Any]:
        got: dict[str, Any] = self.cases[name]
        assert "error" not in got, f"{name} under {self.setting} failed:\n{got['error']}"
        return got

    def calls(self, name: str) -> list[Any]:
        return list(self.case(name)["calls"])


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, Run]]:
    """Every setting's `local` programs, run at once (each its own JAX process, with
    two CPU devices), in a private runtime directory; no daemon takes part."""
    directory = Path(tempfile.mkdtemp(prefix="tapd-g-", dir="/tmp"))
    os.chmod(directory, 0o700)
    started: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
    try:
        for name, setting in SETTINGS.items():
            out, err = directory / f"{name}.out", directory / f"{name}.err"
            env = {**os.environ, **BASE_ENV, **setting.env, "TAPD_RUNTIME_DIR": str(directory)}
            if setting.exit_drain:
                env["GATHERED_EXIT_FILE"] = str(directory / f"{name}.exit")
                env["GATHERED_EXIT_TAPS"] = str(EXIT_TAPS)
            with open(out, "wb") as out_file, open(err, "wb") as err_file:
                process = subprocess.Popen(
                    [sys.executable, str(APPS / "gathered_app.py"), "local", *setting.cases],
                    env=env,
                    stdout=out_file,
                    stderr=err_file,
                )
            started[name] = (process, out, err)
        results = {}
        for name, (process, out, err) in started.items():
            try:
                code = process.wait(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = None
            stdout, stderr = out.read_text(), err.read_text()
            lines = [line for line in stdout.splitlines() if line.startswith('{"cases"')]
            assert code == 0 and lines, f"{name}: exited {code}\n{stdout[-3000:]}\n{stderr[-5000:]}"
            exit_file = directory / f"{name}.exit"
            exit_lines = exit_file.read_text().split() if exit_file.exists() else []
            results[name] = Run(name, json.loads(lines[-1])["cases"], stdout, stderr, exit_lines)
        yield results
    finally:
        for process, _, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def with_case(case: str) -> list[str]:
    """The gathered settings that run `case`."""
    return [name for name in GATHERED if case in SETTINGS[name].cases]


# ---- program order: host_callback's cases and deeper nests ----------------------------


@pytest.mark.parametrize("setting", GATHERED)
def test_cond_with_jit_taps_in_program_order(runs: dict[str, Run], setting: str) -> None:
    """host_callback's tap_cond (with_jit) expects `1, 2, cond_f, end`."""
    expected = [["1", 1], ["2", 2], ["cond_f", -1], ["end", 4]]
    reference = runs["off"].case("cond_with_jit")
    assert reference["eager"] == reference["calls"] == expected
    got = runs[setting].case("cond_with_jit")
    assert got["calls"] == expected and got["result"] == 4


@pytest.mark.parametrize("setting", GATHERED)
def test_taps_of_computations_called_back_to_back_run_in_call_order(
    runs: dict[str, Run], setting: str
) -> None:
    """Computations ending with their taps as an output, flushing in a loop, with a
    host callback a tap: one order, the calls'."""
    expected: list[Any] = []
    for k in range(4):
        base = 100 * k
        expected += [["few_a", base], ["few_b", base + 1]]
        expected += [["loop", base + i] for i in range(1, 6)]
        expected += [["strict", base]]
        expected += [["few_a", base + 50], ["few_b", base + 51]]
    assert runs["off"].calls("across_computations") == expected
    assert runs[setting].calls("across_computations") == expected


@pytest.mark.parametrize("setting", GATHERED)
def test_while_cond_taps_in_program_order(runs: dict[str, Run], setting: str) -> None:
    """host_callback's tap_while_cond."""
    expected = [["1", 1], ["2", 2], ["w_b_1", 2], ["w_b_t", 3], ["w_b_2", 3], ["w_b_1", 3],
                ["w_b_f", -1], ["w_b_2", 4], ["end", 4]]  # fmt: skip
    assert runs["off"].calls("while_cond") == runs["off"].case("while_cond")["eager"] == expected
    assert runs[setting].calls("while_cond") == expected


@pytest.mark.parametrize("setting", GATHERED)
@pytest.mark.parametrize(
    "case",
    ["nested", "zero_length_and_dynamic_loops", "taps_in_a_loop_condition", "one_site_two_shapes"],
)
def test_nested_loops_and_branches_run_taps_as_the_program_does(
    runs: dict[str, Run], setting: str, case: str
) -> None:
    """cond in scan in while, a fori_loop in a branch, jit in jit, taps before, between
    and after loops, loops of no steps and of dynamic length; and what keeps the per-tap
    path (a tap in a loop's condition, a site of two shapes): the calls are those of
    the program run as written (jax.disable_jit), in its order."""
    reference = runs["off"].case(case)
    assert reference["calls"][: len(reference["eager"])] == reference["eager"]
    assert reference["result"] == reference["eager_result"]
    got = runs[setting].case(case)
    assert got["calls"] == reference["calls"]
    assert got["result"] == reference["result"]
    if case == "nested":
        tags = [call[0] for call in got["calls"]]
        assert tags[0] == "before" and tags[-1] == "end" and len(tags) == 65
        assert tags.count("w") == 3 and tags.count("s") == tags.count("y") == 12
    if case == "zero_length_and_dynamic_loops":
        # the empty scans' neighbours (the second's body is a tapping while: issue 49)
        assert got["calls"][-3:] == [["a", 3], ["b", 3], ["a", 0]]
        assert [c[1] for c in got["calls"] if c[0] == "dyn"] == [
            11 + j * (j + 1) // 2 for j in range(11)
        ]


@pytest.mark.parametrize("setting", GATHERED)
def test_taps_beside_jax_ordered_effects_keep_their_order(
    runs: dict[str, Run], setting: str
) -> None:
    """A computation that also threads JAX's runtime token (ordered io_callbacks): the
    taps in program order, the io_callbacks in theirs (between the two kinds, JAX's
    order and tapd's are not tied), twice."""
    got = runs[setting].case("beside_jax_ordered_effects")
    assert got == runs["off"].case("beside_jax_ordered_effects") | {
        "flushes": got["flushes"],
        "seconds": got["seconds"],
        "calls": got["calls"],
    }
    taps, ios = [], []
    for x in (1, 2):
        loop = [x + sum(range(k + 1)) for k in range(5)]
        taps += [["first", x], *[["loop", v] for v in loop], ["last", loop[-1]]]
        ios += [["io_first", x], *[["io_loop", v] for v in loop]]
    assert [c for c in got["calls"] if not c[0].startswith("io")] == taps
    assert [c for c in got["calls"] if c[0].startswith("io")] == ios
    assert got["result"] == [11, 12]


def scan_counts_expected() -> list[Any]:
    """What gathered_app.scan_counts taps, computed here."""
    calls: list[Any] = []
    carry = 0
    for k in range(1000):
        calls.append(["pair", [k, 2 * k]])
        if k % 3 == 0:
            carry += k
            calls.append(["third", carry])
        carry += 1
    carry = 0
    for k in reversed(range(23)):
        carry += k
        calls.append(["rev", carry])
    carry = 0
    for k in range(10):
        carry = carry * 2 + k
        calls.append(["unrolled", carry])
    return calls


@pytest.mark.parametrize("setting", ["off", *GATHERED])
def test_a_long_scan_taps_exactly_once_a_step_flushed_as_it_runs(
    runs: dict[str, Run], setting: str
) -> None:
    """1000 steps with a pair tapped each and a cond tapping every third, a reverse
    scan, an unrolled one: every value once, in order; gathered, in flushes of at most
    the log's capacity, enough of them that the log was flushed while the loop ran. By
    default (logs of 1024), the same taps counted before the run (the cond's at most)
    and packed in far less than TAPD_GATHER_LOG_BYTES: each computation's in one log,
    written once, with no flush while it runs."""
    expected = scan_counts_expected()
    got = runs[setting].case("scan_counts")
    assert got["calls"] == expected
    capacity = SETTINGS[setting].capacity
    if capacity is None:
        assert got["flushes"] == []
        return
    if setting == "on":
        assert sum(got["flushes"]) == len(expected), got["flushes"]
        assert max(got["flushes"]) > capacity, got["flushes"]  # (one log, 2000 or more)
        assert len([n for n in got["flushes"] if n]) <= 3, got["flushes"]
        return
    assert sum(got["flushes"]) == len(expected)
    assert all(0 <= n <= capacity for n in got["flushes"])
    assert len([n for n in got["flushes"] if n]) >= math.ceil(len(expected) / capacity)


@pytest.mark.parametrize("setting", GATHERED)
def test_flushes_hold_every_tap_and_never_more_than_the_log(
    runs: dict[str, Run], setting: str
) -> None:
    """In every case the records flushed are the taps made, each flush at most the
    log's capacity: the computations were gathered (none fell back to one callback a
    tap), but for those that must not be, which flushed nothing. (By default a run
    whose taps are counted before it runs takes them in one log however many, where
    they pack into TAPD_GATHER_LOG_BYTES: scan_counts' 1000-step scan, 1334.)"""
    capacity = SETTINGS[setting].capacity
    assert capacity is not None
    assert "could not gather" not in runs[setting].stderr
    # Where calls are not one a tap: prints, a tap function that raised, io_callbacks,
    # strict taps (not gathered); placement's are its jit's one and its shard_map's four
    # (each device's two, gathered on the device: issue 50; a JAX whose CPU compiler
    # cannot take a device's flush in a cond gathers no slice: its jit's one alone).
    placement = 5 if cpu_partition_id_in_branches() else 1
    taps = {"debug_and_print": 25, "exceptions": 25, "placement": placement,
            "beside_jax_ordered_effects": 14, "across_computations": 36,
            "taps_in_a_loop_condition": 0, "one_site_two_shapes": 0}  # fmt: skip
    for case in ORDER_CASES:
        got = runs[setting].case(case)
        flushes = got["flushes"]
        counted_run = setting == "on" and case == "scan_counts"
        bound = 1334 if counted_run else capacity
        assert all(0 <= n <= bound for n in flushes), (case, flushes)
        assert sum(flushes) == taps.get(case, len(got["calls"])), (case, flushes)


def test_a_100k_step_scan_and_while_loop_deliver_every_tap(runs: dict[str, Run]) -> None:
    got = runs["on"].case("long_loops")
    assert got["result"] == [100_000, 100_000]
    assert got["scan"] == [100_000, True] and got["while"] == [100_000, True]
    assert sum(got["flushes"]) == 200_000
    # The scan's taps, counted before it runs, in one log (TAPD_GATHER_LOG_BYTES); the
    # while loop's, not counted, in logs of TAPD_GATHER_TAPS.
    assert 100_000 in got["flushes"]
    rest = list(got["flushes"])
    rest.remove(100_000)
    assert max(rest) == SETTINGS["on"].capacity


# ---- transforms, dtypes, trees ------------------------------------------------------------


@pytest.mark.parametrize("setting", GATHERED)
def test_vmap_gives_one_call_per_batched_tap_with_its_batch_dims(
    runs: dict[str, Run], setting: str
) -> None:
    reference = runs["off"].case("vmapped")
    got = runs[setting].case("vmapped")
    assert got["calls"] == reference["calls"]
    assert got["result"] == reference["result"]
    batch0 = [["batch", {"batch_dims": [0]}]]
    first = got["calls"][0]
    assert first == [
        "x,x^2",
        [["float32", [2], [2.0, 3.0]], ["float32", [2], [4.0, 9.0]]],
        [["batch", {"batch_dims": [0, 0]}]],
    ]
    # A while whose predicate is batched: it runs while any element goes on, each
    # element keeping its own value (the others' steps are tapped, as JAX runs them).
    whiles = [c for c in got["calls"] if c[0] == "vwhile"]
    assert [c[1][2] for c in whiles] == [[1, 2, 3, 4, 5], [2, 3, 4, 4, 5], [3, 4, 4, 4, 5]]
    assert all(c[2] == batch0 for c in whiles)
    assert got["result"][1] == ["int32", [5], [6, 6, 6, 6, 7]]
    assert got["calls"][-1][2] == batch0 * 2  # nested vmaps: one call, both batch dims


@pytest.mark.parametrize("setting", GATHERED)
def test_grad_taps_primals_once_and_transposed_tangents_and_remat_once(
    runs: dict[str, Run], setting: str
) -> None:
    reference = runs["off"].case("grads")
    got = runs[setting].case("grads")
    assert got["calls"] == reference["calls"]
    assert got["result"] == reference["result"]
    assert got["result"][:3] == [27.0, 27.0, 27.0] and got["result"][4] == 59049.0
    calls = got["calls"]
    assert calls[:5] == [
        ["x,x^2", [3.0, 9.0]],
        ["x,x^2", [3.0, 9.0]],
        ["tangents", [0.0, 0.0], [["transpose", {}]]],  # host_callback's: transposed
        ["x,x^2", [3.0, 9.0]],
        ["cotangents", [9.0, 3.0]],
    ]
    # The scan: six forward steps, then the backward pass, reversed, a tangent's
    # transpose and a cotangent each step.
    assert [c[0] for c in calls[5:23]] == ["fwd"] * 6 + ["tangents", "cotangents"] * 6
    # checkpoint: the inner power3 tapped once, not again when it is recomputed.
    assert calls[23:25] == [["x,x^2", [3.0, 9.0]], ["x,x^2", [27.0, 729.0]]]
    assert [c[0] for c in calls[25:]] == ["x,x^2", "cotangents"]


@pytest.mark.parametrize("setting", with_case("dtypes_and_shapes"))
def test_hostile_dtypes_and_shapes_arrive_exactly(runs: dict[str, Run], setting: str) -> None:
    """Zero-size arrays, bool, int8, uint16, bfloat16, float16, complex64, scalars, a
    rank-3 array from a constant, tapped in a scan, eagerly and under jit."""
    reference = runs["off"].calls("dtypes_and_shapes")
    got = runs[setting].calls("dtypes_and_shapes")
    assert got == reference
    assert len(got) == 2 * 3 * 10
    assert sum(runs[setting].case("dtypes_and_shapes")["flushes"]) == len(got)
    step2 = {c[0]: c[1] for c in got[20:30]}
    assert step2["empty"] == ["float32", [0, 3], []]
    assert step2["empty_int"] == ["int8", [2, 0], [[], []]]
    assert step2["bool"] == ["bool", [2], [False, True]]
    assert step2["int8"] == ["int8", [4], [2, 62, 122, -74]]
    assert step2["uint16"] == ["uint16", [], 65533]
    assert step2["bf16"] == ["bfloat16", [2], [4.5, -6.75]]
    assert step2["c64"] == ["complex64", [2], [[2.0, 4.0], [0.0, -6.0]]]
    assert step2["scalar"] == 2
    assert step2["rank3"][:2] == ["float32", [3, 4, 5]]
    assert step2["rank3"][2][2][3] == [57.0, 58.0, 59.0, 60.0, 61.0]


def tiled_expected() -> list[Any]:
    """tiled_vectors' taps as numpy computes them: [tag, [dtype, shape, values]]."""
    expected: list[Any] = []
    for k in [0, 1, 2, 0, 1, 5]:  # (the scan's steps, the while loop's, the cond's)
        values = {
            "f32_1024": np.arange(1024, dtype=np.float32) * 0.5 + k,
            "f32_1152": np.arange(1152, dtype=np.float32) - k,
            "bf16_4096": ((np.arange(4096) % 128) * 2.0**k).astype(np.float32),
            "int8_8192": (np.arange(8192) % 251 + k).astype(np.int8),
            "bool_4096": np.arange(4096) % 3 == k % 3,
            "u16_2048": (np.arange(2048) * 31 + k).astype(np.uint16),
            "c64_1024": np.stack([np.arange(1024), np.full(1024, k)], -1).astype(np.float32),
            "f32_8x128": np.full((8, 128), k, np.float32),
        }
        for tag, value in values.items():
            # (bfloat16 is described as float32 values; complex as (real, imaginary))
            dtype = {"bf16_4096": "bfloat16", "c64_1024": "complex64"}.get(tag, str(value.dtype))
            shape = list(value.shape[:1]) if tag == "c64_1024" else list(value.shape)
            expected.append([tag, [dtype, shape, value.tolist()]])
    return expected


@pytest.mark.parametrize("setting", ["off", *with_case("tiled_vectors")])
def test_vectors_of_whole_tpu_tiles_arrive_as_numpy_computes_them(
    runs: dict[str, Run], setting: str
) -> None:
    """Vectors the gathered path stores as [n / 128, 128] rows (a TPU's tiles, so that a
    record is written in place: rewrite.stored_shape), with near misses stored as they
    are, in a scan, a while loop and a cond: each arrives with its own shape and values,
    as numpy computes them, gathered in logs of 1, 3 and 1024 records or not."""
    got = runs[setting].calls("tiled_vectors")
    assert got == tiled_expected()


def test_a_tree_of_many_leaves_and_many_sites_arrive_whole(runs: dict[str, Run]) -> None:
    """A tap of 100 leaves of mixed shapes and dtypes, and 20 sites in one loop body."""
    reference = runs["off"].calls("many_leaves_and_sites")
    assert runs["on"].calls("many_leaves_and_sites") == reference
    assert sum(runs["on"].case("many_leaves_and_sites")["flushes"]) == len(reference)
    trees = [c for c in reference if c[0] == "tree"]
    assert len(trees) == 4 and len(reference) == 4 * 21
    assert len(trees[3][1]) == 100
    assert trees[3][1]["leaf003"] == ["int16", [], 9]
    assert trees[3][1]["leaf007"] == ["float32", [4], [3.0, 4.0, 5.0, 6.0]]


# ---- tapd.debug, jax.debug, id_print ------------------------------------------------------


@pytest.mark.parametrize("setting", ["off", *GATHERED])
def test_debug_callbacks_prints_and_id_print_as_jax_prints_them(
    runs: dict[str, Run], setting: str
) -> None:
    run = runs[setting]
    got = run.case("debug_and_print")
    # id_print's text, host_callback's format, to its output_stream.
    assert got["written"] == [text for c in (0, 1, 3, 6, 10) for text in ("what: c\n", f"{c}\n")]
    # Unordered jax.debug calls: each site's calls in order (their relative order is
    # JAX's to choose).
    assert [c[1] for c in got["calls"] if c[0] == "tapd.debug"] == [0, 1, 2, 3, 4]
    assert [c[1] for c in got["calls"] if c[0] == "jax.debug"] == [0, 2, 4, 6, 8]
    lines = [line for line in run.stdout.splitlines() if line.startswith("DBG ")]
    tapd_lines = [line for line in lines if line.startswith("DBG tapd")]
    assert tapd_lines == [f"DBG tapd k={k} c={c}" for k, c in enumerate((0, 0, 1, 3, 6))]
    assert [line for line in lines if line.startswith("DBG jax")] == [
        f"DBG jax k={k}" for k in range(5)
    ]


# ---- barriers, exceptions, the exit drain, full rings --------------------------------------


@pytest.mark.parametrize("setting", ["off", "on", "taps7_block"])
def test_barriers_return_once_every_earlier_tap_has_run(runs: dict[str, Run], setting: str) -> None:
    """A tap function that takes 2 ms: after tapd.barrier_wait(), and after
    jax.effects_barrier(), every tap of the two calls before it has run."""
    got = runs[setting].case("barriers")
    assert got["counts"] == [list(range(50)), list(range(50))]


@pytest.mark.parametrize("setting", GATHERED)
def test_a_tap_functions_exception_surfaces_at_the_next_barrier(
    runs: dict[str, Run], setting: str
) -> None:
    got = runs[setting].case("exceptions")
    assert got["raised"] is True  # CallbackException naming "deliberate failure at 5"
    expected = []
    for k in range(8):
        expected += [["before", k], *([["fails", k]] if k != 5 else []), ["after", k]]
    assert got["calls"] == [*expected, ["next", 1]]
    assert got["calls"] == runs["off"].calls("exceptions")


def test_the_exit_drain_runs_every_tap_left_behind(runs: dict[str, Run]) -> None:
    """taps7_block exits with 60 slow taps of a gathered scan not yet run (4 KiB each,
    its ring 64 KiB under `block`): exit runs every one, in order."""
    assert runs["taps7_block"].exit_lines == [str(k) for k in range(EXIT_TAPS)]
    assert "not every tap" not in runs["taps7_block"].stderr


@pytest.mark.parametrize("policy", ["drop_newest"])
def test_a_full_local_ring_under_drop_newest_counts_every_drop(
    runtime_dir: Path, policy: str
) -> None:
    """200 taps of 4 KiB flushed 7 at a time into a 64 KiB ring whose tap function takes
    a millisecond: what ran is in order, and every tap ran or was counted dropped."""
    env = {
        **os.environ,
        **BASE_ENV,
        "TAPD_GATHER": "on",
        **taps(7),
        "TAPD_BUFFER_BYTES": str(64 * 1024),
        "TAPD_EMITTER_POLICY": policy,
        "TAPD_RUNTIME_DIR": str(runtime_dir),
    }
    result = subprocess.run(
        [sys.executable, str(APPS / "gathered_app.py"), "drop", "200"],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout.splitlines()[-1])
    ran, local = got["ran"], got["stats"]["local"]
    assert local["dropped"] > 0
    assert len(ran) == local["ran"] and local["ran"] + local["dropped"] == 200
    assert ran == sorted(set(ran)) and set(ran) <= set(range(200))
    assert got["stats"]["dropped"] == local["dropped"]
    assert sum(got["flushes"]) == 200 and max(got["flushes"]) == 7


# ---- the path is taken, or not ------------------------------------------------------------


def test_hlo_has_no_callback_or_one_a_chunk_where_the_per_tap_path_has_one_a_tap(
    runs: dict[str, Run],
) -> None:
    """`python_cpu_callback` custom calls in the lowered HLO: none for a computation whose
    taps fit in the log (5 taps and a 3-step scan of 2: its buffers come out as an
    output, tapd.emitter.taps_as_outputs), nor for one whose taps are counted before it
    runs and pack into TAPD_GATHER_LOG_BYTES, however many (9 and 17 steps of 1 MiB, a
    1000-step scan of two taps); a few for the same scan with a matmul a step (estimated
    long: paced, a flush a chunk) and for 129 steps of 1 MiB (past 128 MiB: logs of
    TAPD_GATHER_BYTES), against one a tap site per tap; as many as the per-tap path where
    gathering must not apply. The way out is an ordered effect's token, which JAX's
    Python dispatch passes; a gathered step's calls after its first take JAX's C++ path
    all the same, as the per-tap path's do (tapd.emitter.outputs_fast_path): none of
    20 goes through Python."""
    off = runs["off"].case("lowered")
    on = runs["on"].case("lowered")
    assert off["callbacks"]["few"] == 7 and off["callbacks"]["long"] == 2
    assert on["callbacks"]["few"] == 0 and on["callbacks"]["long"] == 0
    assert off["callbacks"]["long_work"] == 1 and 1 <= on["callbacks"]["long_work"] <= 4
    # 9 and 17 taps of 1 MiB, logs of 8 MiB: counted before the run, packed in at most
    # TAPD_GATHER_LOG_BYTES (128 MiB), one log and no callback; 129 flush while they run.
    assert off["callbacks"]["big9"] >= 1 and off["callbacks"]["big129"] >= 1
    assert on["callbacks"]["big9"] == 0 and on["callbacks"]["big17"] == 0
    assert on["callbacks"]["big129"] >= 1
    for kept in ("two_shapes", "strict", "in_condition"):
        assert on["callbacks"][kept] == off["callbacks"][kept] >= 1, kept
    # A shard_map body of one tap: one callback per tap; gathered, none (each device's
    # log leaves as its shard of the output: tapd.emitter.gathered.slices.ends_packed),
    # where this JAX's CPU gathers slices at all.
    gathered_slice = 0 if cpu_partition_id_in_branches() else 1
    assert off["callbacks"]["shard_map"] == 1
    assert on["callbacks"]["shard_map"] == gathered_slice
    assert off["callbacks"]["python_dispatches"] == 0
    assert on["callbacks"]["python_dispatches"] == 0
    assert on["result"] == off["result"]
    assert on["result"][1] == sum(range(1000)) + 1
    assert on["counted"] == off["counted"]
    assert on["counted"]["sm"] == 2 and on["counted"]["l1"] == 1000


def test_jax_export_is_refused_as_on_the_per_tap_path(runs: dict[str, Run]) -> None:
    def unnamed(text: str) -> str:
        return re.sub(r"'local/[^']*'", "'SITE'", text)

    off, on = runs["off"].case("lowered"), runs["on"].case("lowered")
    assert unnamed(on["exported"]) == unnamed(off["exported"])
    assert on["exported"].startswith("TapDefinitionError: tap site 'local/")
    assert "cannot be exported" in on["exported"]


@pytest.mark.parametrize("setting", GATHERED)
def test_placement_a_jit_on_the_second_device_and_shard_map_over_two(
    runs: dict[str, Run], setting: str
) -> None:
    got = runs[setting].case("placement")
    # (the second CPU device, as this JAX names it: cpu:1, TFRT_CPU_1 before jax 0.9)
    assert got["device"] == [["device", ["int32", [3], [0, 2, 4]], got["device"][0][2]]]
    assert got["device"][0][2] in ("cpu:1", "TFRT_CPU_1")
    assert got["shards"] == [
        ["shard", ["int32", [2], [k, k + 1]]] for k in range(4)
    ]  # (sorted: the two devices' order is theirs)
    assert got["result"] == ["int32", [4], [1, 2, 3, 4]]
    assert got == runs["off"].case("placement") | {
        "flushes": got["flushes"],
        "seconds": got["seconds"],
    }


# ---- a subscriber in another process --------------------------------------------------


def named_expected() -> dict[str, list[tuple[int, Any, Any]]]:
    """What gathered_app.named taps, per consumer: (seq, step, value)."""
    loop: list[tuple[int, Any, Any]] = []
    cond: list[tuple[int, Any, Any]] = []
    sampled: list[tuple[int, Any, Any]] = []
    carry = 1
    for i in range(50):
        carry += i
        loop.append((i, i, carry))
        if i % 4 == 0:
            carry *= 2
            cond.append((len(cond), i, carry))
        if i % 3 == 0:
            sampled.append((i, None, i))
    return {"loop": loop, "cond": cond, "sampled": sampled}


def test_a_subscriber_gets_the_same_records_gathered_or_not(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "*")
    env = {**BASE_ENV, "TAPD_GATHER": "off"}
    off = run_emitter(daemon.endpoint, "named", "off", env=env, app="gathered_app.py")
    env = {**BASE_ENV, "TAPD_GATHER": "on", **taps(3)}
    on = run_emitter(daemon.endpoint, "named", "on", env=env, app="gathered_app.py")
    per_run = 1 + 50 + 13 + 17 + 7 + 1 + 1 + 1 + 1 + 1
    records = wait_until(
        lambda: len(r := subscriber.records()) >= 2 * per_run and r, "every record"
    )
    assert len(records) == 2 * per_run

    def by_run(prefix: str) -> dict[str, list[dict[str, Any]]]:
        mine: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            run, _, name = record["consumer"].partition(":")
            if run == prefix:
                kept = {k: v for k, v in record.items() if k not in ("consumer", "emitter")}
                mine.setdefault(name, []).append(kept)
        return mine

    gathered, reference = by_run("on"), by_run("off")
    assert gathered == reference
    # Only the taps sent were flushed: the sampled-out ones were decided on the device
    # (tapd.emitter.gathered.sampling) and moved nothing.
    assert sum(on["flushes"]) == per_run and max(on["flushes"]) <= 3
    assert off["flushes"] == []
    expected = named_expected()
    for name, rows in expected.items():
        got = [(r["seq"], r["step"], r["value"]) for r in gathered[name]]
        assert got == rows, name
    assert [r["meta"] for r in gathered["cond"]] == [{"note": "n"}] * 13
    assert [r["step"] for r in gathered["tree"]] == list(range(7))
    assert gathered["tree"][6]["value"]["v"] == [[6.0, 6.0], [6.0, 6.0]]
    assert [r["seq"] for r in gathered["first"] + gathered["last"]] == [0, 0]
    assert gathered["empty"][0]["shape"] == [0, 2]
    assert gathered["mixed"][0]["value"] == {"flags": [True, False], "small": [0, 7, 14]}
    assert gathered["batched"][0]["transforms"] == [["batch", {"batch_dims": [0]}]]
    assert gathered["batched"][0]["value"] == [0.0, 3.0, 6.0, 9.0]
    assert {
        r["device"] for name, rows in gathered.items() for r in rows if name != "second_device"
    } == {0}
    assert gathered["second_device"][0]["device"] == 1
    assert on["result"] == off["result"]
    assert on["exported"] == off["exported"].replace("'off:", "'on:")
    assert on["exported"].startswith("TapDefinitionError: tap site 'on:exported'")

    def counts(stats: dict[str, Any]) -> dict[str, Any]:
        return {k: stats[k] for k in ("submitted", "sent", "dropped", "delivered", "skipped")}

    assert counts(on["stats"]) == counts(off["stats"])
    assert on["stats"]["delivered"] == per_run and on["stats"]["skipped"] == 50 - 17


def test_a_full_ring_blocks_losslessly_or_drops_and_counts_under_drop_newest(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber
) -> None:
    """Flushes of 7 taps of 16 KiB into an emitter ring of 40 000 bytes, behind a daemon
    that lets 40 000 bytes be in flight to a slow subscriber: under `block` nothing is
    lost; under `drop_newest` the drops are counted and show as gaps in seq."""
    daemon = start_daemon(
        "--policy", "block", "--queue-bytes", "40000", "--emitter-window-bytes", "40000"
    )
    subscriber = start_subscriber(daemon, "*", sleep_ms=5, window=2)
    base = {**BASE_ENV, "TAPD_GATHER": "on", **taps(7),
            "TAPD_BUFFER_BYTES": "40000"}  # fmt: skip
    blocked = run_emitter(
        daemon.endpoint, "flood", "block", "60", "16",
        env={**base, "TAPD_EMITTER_POLICY": "block"}, app="gathered_app.py",
    )  # fmt: skip
    dropping = run_emitter(
        daemon.endpoint, "flood", "drop", "60", "16",
        env={**base, "TAPD_EMITTER_POLICY": "drop_newest"}, app="gathered_app.py",
    )  # fmt: skip
    records = subscriber.records()
    kept = [r for r in records if r["consumer"] == "block:big"]
    assert [(r["seq"], r["step"]) for r in kept] == [(k, k) for k in range(60)]
    assert all(r["value"] == [float(r["step"])] * 4096 for r in kept)
    assert blocked["stats"]["dropped"] == 0 and blocked["stats"]["delivered"] == 60
    assert sum(blocked["flushes"]) == 60 and max(blocked["flushes"]) == 7

    stats = dropping["stats"]
    seqs = [r["seq"] for r in records if r["consumer"] == "drop:big"]
    assert stats["dropped"] > 0
    assert stats["sent"] + stats["dropped"] == 60
    assert stats["delivered"] == len(seqs)
    assert seqs == sorted(set(seqs)) and set(seqs) <= set(range(60))
    assert 60 - len(seqs) == stats["dropped"] + stats["daemon_dropped"]
    steps = [r["step"] for r in records if r["consumer"] == "drop:big"]
    assert steps == seqs  # each record is the step that made it
