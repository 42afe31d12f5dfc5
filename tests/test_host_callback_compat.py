"""host_callback's tap test matrix, ported: `import tapd as hcb` must behave as
`jax.experimental.host_callback` did (issue 9).

The expectations are those of jax's `tests/host_callback_test.py` (class
HostCallbackTapTest, jax commit 2228115cf4, the last full version), in its legacy
mode, which is what host_callback did through jax 0.4.30 (outfeed/custom call, one
ordering token, one tap per batch under vmap). The case code is in
tests/apps/hcb_cases.py; it runs in real JAX processes with 2 host devices.

Every case runs four times: per emitter backend (`native`, `portable`), and per
place its tap functions run:

- `closure`: the tap functions as host_callback's tests wrote them: closures and
  `id_print(..., output_stream=stream)`, run in the emitting process;
- `module`: the same functions at the top level of tests/apps/hcb_funcs.py and
  `id_print` without a stream, run in subscriber processes (`tapd subscribe
  hcb_funcs`, `tapd subscribe tapd.printing`), whose stdout is the output checked.

To stay fast, one emitter process runs a whole group of cases (GROUPS) per backend and
mode, and each test checks one case's result. Output is compared as host_callback's
tests did: floats rounded to 2 decimals, whitespace around line breaks ignored.

One deliberate difference from host_callback (issue 9, item 8): under
`grad(checkpoint(f))` host_callback tapped `f` twice (forward and rematerialisation);
tapd taps once, as tests/test_end_to_end.py asserts. REMAT_TAPS_TWICE flips that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from conftest import (
    APPS,
    READY_PREFIX,
    Daemon,
    native_unavailable,
    rings_of,
    stop_process,
    wait_until,
)

pytestmark = pytest.mark.timeout(900)  # the first test of a group runs the whole group

REMAT_TAPS_TWICE = False  # issue 9, item 8: tapd taps a checkpointed region once

# Two emitter processes per backend and mode: JAX's import and the compiles are most of
# the cost. A case that crashes its process is reported, with the cases after it.
GROUPS: dict[str, list[str]] = {
    "eager_jit_control": [
        "api_names", "tap_eval", "tap_with_tuple_results", "tap_with_dict_results",
        "tap_with_result", "tap_with_result_no_arg", "tap_result_unused", "tap_with_device",
        "tap_empty", "tap_jit_simple", "tap_jit_no_invars", "tap_jit_multiple_invars",
        "tap_jit_constant", "tap_jit_sequence1", "tap_jit2", "tap_jit_result_unused",
        "tap_jit_nested", "tap_jit_devices", "tap_pytree[with_jit=True]",
        "tap_pytree[with_jit=False]", "tap_multiple", "tap_jit_large",
        "tap_jit_several_together", "tap_jit_interleaving", "tap_callback_delay_barrier",
        "tap_id_tap_removed_kwargs",
        # control flow: order
        "tap_cond[with_jit=True]", "tap_cond[with_jit=False]", "tap_while_cond[with_jit=True]",
        "tap_while_cond[with_jit=False]", "tap_jit_while_pred_tap",
        "tap_scan_cond[with_jit=True]", "tap_scan_cond[with_jit=False]", "tap_scan_order",
        "tap_while", "tap_named_call", "tap_remat_0", "tap_thousands_interleaved",
        "tap_thousands_two_functions",
        # barrier_wait raising the tap functions' exceptions, last
        "tap_eval_exception", "tap_jit_tap_exception",
    ],
    "transforms_devices": [
        "tap_jvp", "tap_grad_primal_unused", "tap_grad_simple", "tap_grad_grad",
        "tap_grad_pytree", "tap_jvp_float0", "tap_grad_float0", "tap_grad_float0_result",
        "tap_higher_order_grad_float0_result", "tap_transforms_doc_impl",
        "tap_transforms_doc_jvp", "tap_transforms_doc_jvp_tangents", "tap_transforms_doc_grad",
        "tap_transforms_doc_grad_cotangents", "tap_transforms_doc_vmap",
        "tap_transforms_doc_vmap_grad", "tap_transforms_doc_vmap_grad_cotangents",
        "tap_transforms_doc_grad_remat", "tap_scan_custom_jvp", "tap_custom_jvp_grad",
        "tap_scan_custom_vjp", "tap_odeint",
        *(f"tap_remat[use_result={u},grad_func={g},use_remat={r}]"
          for u in (True, False) for g in ("grad", "value_and_grad") for r in ("new", "none")),
        "tap_vmap", "tap_vmap_not_batched", "tap_vmap_vmap", "tap_vmap_while",
        "tap_vmap_while_tap_cond", "tap_vmap_transforms_tuples",
        # devices: pmap, sharded jit, keys, dtypes
        "tap_pmap", "tap_pmap_vmap", "tap_pmap_pmap_vmap", "tap_pmap_pmap_extra",
        "tap_jvp_pmap_vmap", "tap_vmap_pmap", "tap_jit_pmap_extra",
        "tap_pjit[device_index=0]", "tap_pjit[device_index=1]", "tap_id_tap_random_key",
        "tap_typed_key",
        *(f"tap_jit_dtypes[dtype={d}]" for d in (
            "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "bfloat16",
            "float16", "float32")),
    ],
}  # fmt: skip
GROUP_OF = {case: group for group, cases in GROUPS.items() for case in cases}
EMITTER_TIMEOUT = 600.0


# ---- daemon, subscribers and emitter runs ------------------------------------------


@dataclass
class Env:
    daemon: Daemon
    logs: dict[str, Path]
    directory: Path
    results: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def hcb_env() -> Iterator[Env]:
    """One daemon, and the two subscribers the module-level tap functions need."""
    directory = Path(tempfile.mkdtemp(prefix="tapd-", dir="/tmp"))
    os.chmod(directory, 0o700)
    endpoint = f"ipc://{directory}/tapd.sock"
    processes: list[subprocess.Popen[str]] = []
    daemon_log = directory / "daemon.log"
    try:
        with open(daemon_log, "w") as stderr:
            daemon_process = subprocess.Popen(
                [sys.executable, "-m", "tapd", "start", "--endpoint", endpoint, "--pidfile",
                 str(directory / "tapd.pid"), "--startup-grace", "0"],
                stdout=subprocess.PIPE, stderr=stderr, text=True)  # fmt: skip
        processes.append(daemon_process)
        assert daemon_process.stdout is not None
        line = daemon_process.stdout.readline()
        if not line.startswith(READY_PREFIX):
            pytest.fail(f"daemon did not become ready: {line!r}\n{daemon_log.read_text()}")
        daemon = Daemon(daemon_process, line.removeprefix(READY_PREFIX).split(), daemon_log)
        logs = {"print": directory / "print.out", "funcs": directory / "funcs.out"}
        pythonpath = os.pathsep.join([str(APPS), os.environ.get("PYTHONPATH", "")])
        for name, module in (("print", "tapd.printing"), ("funcs", "hcb_funcs")):
            before = daemon.subscriber_count()
            with open(logs[name], "w") as out, open(directory / f"{name}.err", "w") as err:
                sub = subprocess.Popen(
                    [sys.executable, "-m", "tapd", "subscribe", module, "--endpoint", endpoint],
                    stdout=out, stderr=err, text=True,
                    env={**os.environ, "PYTHONPATH": pythonpath})  # fmt: skip
            processes.append(sub)
            wait_until(
                lambda b=before, s=sub: daemon.subscriber_count() > b or s.poll() is not None,
                f"`tapd subscribe {module}` to connect",
            )
            assert sub.poll() is None, (directory / f"{name}.err").read_text()
        yield Env(daemon, logs, directory)
    finally:
        for process in reversed(processes):
            stop_process(process)
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(rings_of(directory), ignore_errors=True)


COMBOS = [(backend, mode) for backend in ("native", "portable") for mode in ("closure", "module")]


@dataclass
class CaseResult:
    case: str
    mode: str
    status: str
    values: dict[str, Any]
    output: str
    error: str
    traceback: str

    devices: list[str]  # str() of the emitting process's first 2 devices ("cpu:0", ...)

    def describe(self) -> str:
        return f"{self.error}\n{self.traceback}\noutput so far:\n{self.output}"


@pytest.fixture(scope="module", params=COMBOS, ids=[f"{b}-{m}" for b, m in COMBOS])
def run(request: pytest.FixtureRequest, hcb_env: Env) -> Callable[[str], CaseResult]:
    backend, mode = request.param
    if backend == "native" and (reason := native_unavailable()):
        pytest.skip(reason)

    def result_of(case: str) -> CaseResult:
        group = GROUP_OF[case]
        key = (backend, mode, group)
        if key not in hcb_env.results:
            hcb_env.results[key] = run_group(hcb_env, backend, mode, group)
        raw = hcb_env.results[key][case]
        return CaseResult(case, mode, raw["status"], raw.get("values", {}), raw.get("output", ""),
                          raw.get("error", ""), raw.get("traceback", ""),
                          raw.get("devices", ["cpu:0", "cpu:1"]))  # fmt: skip

    return result_of


def run_group(env: Env, backend: str, mode: str, group: str) -> dict[str, dict[str, Any]]:
    """Run a group's cases in one emitter process; a case the process never reported
    (it crashed or hung) is an error naming what happened."""
    results_path = env.directory / f"{backend}-{mode}-{group}.jsonl"
    environment = {
        **os.environ,
        "TAPD_ENDPOINT": env.daemon.endpoint,
        "TAPD_BACKEND": backend,
        "HCB_MODE": mode,
        "HCB_RESULTS": str(results_path),
        "HCB_PRINT_LOG": str(env.logs["print"]),
        "HCB_FUNCS_LOG": str(env.logs["funcs"]),
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    try:
        completed = subprocess.run(
            [sys.executable, str(APPS / "hcb_cases.py"), *GROUPS[group]],
            env=environment, capture_output=True, text=True, timeout=EMITTER_TIMEOUT,
        )  # fmt: skip
        ending = f"exited {completed.returncode}; stderr ends:\n{completed.stderr[-3000:]}"
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        ending = f"timed out after {EMITTER_TIMEOUT} s; stderr ends:\n{stderr[-3000:]}"
    if keep := os.environ.get("HCB_KEEP_RESULTS"):  # a folder to keep every case's result in
        Path(keep).mkdir(parents=True, exist_ok=True)
        if results_path.exists():
            shutil.copy(results_path, keep)
    results: dict[str, dict[str, Any]] = {}
    if results_path.exists():
        for line in results_path.read_text().splitlines():
            record = json.loads(line)
            results[record["case"]] = record
    for case in GROUPS[group]:
        if case not in results:
            results[case] = {"status": "error", "error": f"no result: the emitter {ending}"}
    return results


def values_of(result: CaseResult) -> dict[str, Any]:
    if result.status == "skip":
        pytest.skip(result.error)
    if result.status != "ok":
        pytest.fail(result.describe(), pytrace=False)
    return result.values


# ---- comparing output as host_callback's tests did ------------------------------------


def normalize(text: str) -> str:
    """host_callback_test's assertMultiLineStrippedEqual: floats rounded to 2 decimals,
    then dedented, stripped, and whitespace around line breaks dropped."""

    def repl_floats(match: re.Match[str]) -> str:
        matched = match.group(0)
        if matched == ".":
            return matched
        return f"{np.around(float(matched), decimals=2):.2f}"

    text = re.sub(r"\-?\d+\.[\-\def]*", repl_floats, text)
    text = re.sub(r"^\s*\n", "", text, flags=re.MULTILINE)
    text = textwrap.dedent(text)
    return re.sub(r"\s*\n\s*", "\n", text.strip())


def assert_output(expected: str, actual: str) -> None:
    assert normalize(actual) == normalize(expected)


def assert_same(expected: Any, actual: Any, what: str) -> None:
    """Values returned by a case: floats approximately, strings as output is compared."""
    if isinstance(expected, str) and isinstance(actual, str):
        assert normalize(actual) == normalize(expected), what
    elif isinstance(expected, list) and isinstance(actual, list):
        assert len(actual) == len(expected), what
        for e, a in zip(expected, actual, strict=True):
            assert_same(e, a, what)
    elif isinstance(expected, float):
        assert actual == pytest.approx(expected), what
    else:
        assert actual == expected, what


def sorted_by_device(text: str) -> str:
    """host_callback_test's output_sorted_by_device: the output of each tap (its
    `device: ...` line and the lines after it) grouped by device, in arrival order."""
    by_device: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        found = re.match(r".*device: (\S+)", line)
        if found:
            by_device.append((found.group(1), []))
        assert by_device, f"output does not include 'device:': {text!r}"
        by_device[-1][1].append(line)
    by_device.sort(key=lambda entry: entry[0])
    return "\n".join(line for _, lines in by_device for line in lines)


def assert_device_output(expected: str, result: CaseResult) -> None:
    """As host_callback_test's assertMultiDeviceOutputEqual: `cpu:N` in `expected` is the
    N-th local device, printed as str(device) of the emitting process's JAX (jax 0.10:
    "cpu:0"; jax 0.8, 0.4: "TFRT_CPU_0"), in that process and in a subscriber process,
    which has no JAX, alike."""
    expected = re.sub(r"cpu:(\d+)", lambda m: result.devices[int(m.group(1))], expected)
    assert normalize(sorted_by_device(result.output)) == normalize(expected)


def squeeze(text: str) -> str:
    return " ".join(normalize(text).split())


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---- the checks, one per case -------------------------------------------------------

Check = Callable[[CaseResult], None]
CHECKS: dict[str, Check] = {}


def check(*cases: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        for case in cases:
            CHECKS[case] = fn
        return fn

    return register


def expect(case: str, output: str, **values: Any) -> None:
    """The case printed `output` and returned `values` (floats compared approximately)."""

    def fn(result: CaseResult) -> None:
        got = values_of(result)
        for key, value in values.items():
            assert_same(value, got.get(key), key)
        assert_output(output, result.output)

    CHECKS[case] = fn


A2 = "what: a * 2\n10.00\nwhat: y * 3\n30.00"
expect("tap_eval", A2, result=100.0)
expect("tap_with_tuple_results", "( 6.00 9.00 )", result=15.0)
expect("tap_with_dict_results", "{ a=6.00 b=9.00 }", result=15.0)
expect("tap_with_result", "( 6.00 9.00 )", result=12.0)
expect("tap_with_result_no_arg", "called tap_func with None", result=3.0)
expect("tap_result_unused", "called tap_func with None", result=3.0)
expect("tap_empty", "(  )\nwhat: second\n( 1.00 [] )")
expect("tap_jit_simple", "what: here\n10.00", result=30.0)
expect("tap_jit_no_invars", "42", result=42)
expect("tap_jit_multiple_invars", "42", result=42)
expect("tap_jit_constant", "42", result=5)
expect("tap_jit_sequence1", "where: 1\n1\nwhere: 2\n2", result=2)
SEQ2 = "where: 1\n1\nwhere: 2\n2\nwhere: 1\n10\nwhere: 2\n11"
expect("tap_jit2", SEQ2, results=[2, 11])
expect("tap_jit_result_unused", SEQ2, results=[2, 11])
expect("tap_jit_nested", "where: 1\n1\nwhere: nested\n2\nwhere: 3\n3", result=3)
COND = "where: 1\n1\nwhere: 2\n2\nwhere: cond_f\n-1\nwhere: end\n4"
expect("tap_cond[with_jit=True]", COND, result=4)
expect("tap_cond[with_jit=False]", COND, result=4)
WHILE_COND = """
    where: 1
    1
    where: 2
    2
    where: w_b_1
    2
    where: w_b_t
    3
    where: w_b_2
    3
    where: w_b_1
    3
    where: w_b_f
    -1
    where: w_b_2
    4
    where: end
    4"""
expect("tap_while_cond[with_jit=True]", WHILE_COND, result=4)
expect("tap_while_cond[with_jit=False]", WHILE_COND, result=4)
# host_callback's test printed "where: 1" to stdout; here it is in the stream too.
expect("tap_jit_while_pred_tap", """
    where: 1
    1
    where: w_p
    True
    where: w_b
    2
    where: w_p
    True
    where: w_b
    3
    where: w_p
    False
    where: 3
    3""", result=3)  # fmt: skip
SCAN_COND = """
    where: 1
    1
    where: 2
    2
    where: s_1
    0
    where: s_t
    1
    where: s_2
    1
    where: s_1
    1
    where: s_f
    -1
    where: s_2
    2
    where: s_1
    2
    where: s_t
    3
    where: s_2
    3
    where: 10
    [1 2 3]"""
expect("tap_scan_cond[with_jit=True]", SCAN_COND, result=[1, 2, 3])
expect("tap_scan_cond[with_jit=False]", SCAN_COND, result=[1, 2, 3])
expect("tap_scan_order", "where: s_1\n0\nwhere: s_2\n1\nwhere: s_1\n1\nwhere: s_2\n2",
       result=[1, 2])  # fmt: skip
expect("tap_while", "1\n2\n3\n4")
expect("tap_named_call", "what: step_nr\n0\nwhat: step_nr\n1", equal=True, result=4)
expect("tap_remat_0", "3\n10", result=90)

# differentiation
expect("tap_jvp", A2, primals=100.0, tangents=4.0)
expect("tap_grad_primal_unused", "what: x * 3\n15.00", after_jaxpr="", grad=6.0)
expect("tap_grad_simple", "what: x * 2\n10.00\nwhat: y * 3\n30.00", grad=60.0)
expect("tap_grad_grad", "what: x * 2\n10.00", after_jaxpr="", grad=12.0)
expect("tap_grad_pytree", "what: pair\n( 10.00 15.00 )", grad=14.0)
expect("tap_jvp_float0", "", result=[6.0, 0.6])
expect("tap_grad_float0", "what: pair\n( 5.00 2 )", grad=2.0)
FLOAT0 = "( [0.70 0.80] [11 12 13] )"
expect("tap_grad_float0_result", FLOAT0, g0=[3.0, 3.0], g1_float0=True)
X_X2 = "what: x,x^2\n( 3. 9. )"
expect("tap_transforms_doc_impl", X_X2, result=27.0)
expect("tap_transforms_doc_jvp", X_X2, result=[27.0, 2.7])
expect("tap_transforms_doc_jvp_tangents", X_X2 + "\nwhat: tangents\n( 0.1 0.6 )",
       result=[27.0, 2.7])  # fmt: skip
expect("tap_transforms_doc_grad", X_X2, result=27.0)
expect("tap_transforms_doc_grad_cotangents", X_X2 + "\nwhat: cotangents\n( 9. 3. )", result=27.0)
VMAP_X_X2 = "transforms: [('batch', {'batch_dims': (0, 0)})] what: x,x^2\n( [2. 3.] [4. 9.] )"
expect("tap_transforms_doc_vmap", VMAP_X_X2, result=[8.0, 27.0])
expect("tap_transforms_doc_vmap_grad", VMAP_X_X2, result=[12.0, 27.0])
expect("tap_transforms_doc_vmap_grad_cotangents", VMAP_X_X2 + """
    transforms: [('batch', {'batch_dims': (0, 0)})] what: cotangents
    ( [4. 9.] [2. 3.] )""", result=[12.0, 27.0])  # fmt: skip
# host_callback: forward of the inner power3, the outer one, then the rematerialisation.
expect("tap_transforms_doc_grad_remat",
       X_X2 + "\nwhat: x,x^2\n( 27. 729. )" + ("\n" + X_X2 if REMAT_TAPS_TWICE else ""),
       result=59049.0)  # fmt: skip
X_TWICE = "what: x\n0.7\nwhat: x\n0.7"
expect("tap_scan_custom_jvp", X_TWICE + """
    transforms: ['transpose'] what: x_dot
    2.1
    transforms: ['transpose'] what: x_dot
    2.1""", value=0.98, eval_output=X_TWICE, grad=[2.1, 2.1])  # fmt: skip
expect("tap_custom_jvp_grad", "transforms: ['transpose'] what: x_dot\n2.1", grad=2.1)
expect("tap_scan_custom_vjp", X_TWICE + "\nwhat: ct_b\n1.\nwhat: ct_b\n1.",
       value=0.98, eval_output=X_TWICE, grad=[2.1, 2.1])  # fmt: skip
for use_result in (True, False):
    for grad_func in ("grad", "value_and_grad"):
        for use_remat in ("new", "none"):
            twice = use_remat == "new" and REMAT_TAPS_TWICE
            expect(f"tap_remat[use_result={use_result},grad_func={grad_func},use_remat={use_remat}]",
                   "2.\n2." if twice else "2.", after_jaxpr="",
                   result=[3.0] if grad_func == "grad" else [6.0, 3.0])  # fmt: skip

# vmap
BATCH0 = "transforms: [('batch', {'batch_dims': (0,)})]"
expect("tap_vmap", f"""
    {BATCH0} what: a * 2
    [ 8.00 10.00]
    {BATCH0} what: y * 3
    [24.00 30.00]""", result=[64.0, 100.0])  # fmt: skip
expect("tap_vmap_not_batched", """
    transforms: [('batch', {'batch_dims': (None, 0)})]
    ( 3.00 [4.00 5.00] )""", result=[7.0, 8.0])  # fmt: skip
expect("tap_vmap_vmap", """
    transforms: [('batch', {'batch_dims': (0,)}), ('batch', {'batch_dims': (0,)})]
    [[0 1 2 3 4]
     [1 2 3 4 5]
     [2 3 4 5 6]]""", result=[[i + j for j in range(5)] for i in range(3)])  # fmt: skip
expect("tap_vmap_while", f"""
    {BATCH0} where: before:x
    [0 1 2 3 4]
    {BATCH0} where: body:x+1
    [1 2 3 4 5]
    {BATCH0} where: body:x+1
    [2 3 3 4 5]
    {BATCH0} where: after:x
    [2 2 2 3 4]""", result=[2, 2, 2, 3, 4])  # fmt: skip
expect("tap_vmap_while_tap_cond", f"""
    {BATCH0} where: 1
    [0 1 2 3 4]
    {BATCH0} where: w_c
    [ True  True False False False]
    {BATCH0} where: w_b
    [1 2 3 4 5]
    {BATCH0} where: w_c
    [ True False False False False]
    {BATCH0} where: w_b
    [2 3 3 4 5]
    {BATCH0} where: w_c
    [False False False False False]
    {BATCH0} where: 3
    [2 2 2 3 4]""", result=[2, 2, 2, 3, 4])  # fmt: skip
expect("tap_vmap_transforms_tuples",
       "(3, [0, 1]) transforms=[('batch', {'batch_dims': (None, 0)})]",
       nested="[[1, 1, 1], [1, 1, 1]] transforms="
              "[('batch', {'batch_dims': (0,)}), ('batch', {'batch_dims': (0,)})]")  # fmt: skip


@check("api_names")
def _api_names(result: CaseResult) -> None:
    got = values_of(result)
    assert got["CallbackException"], "tapd has no CallbackException"
    assert got["alias"], "TapFunctionException is not CallbackException"
    assert {"tap_func", "arg", "result", "tap_with_device", "device_index"} <= set(
        got["id_tap_params"]
    )
    assert {"arg", "result", "tap_with_device", "device_index", "output_stream",
            "threshold"} <= set(got["id_print_params"])  # fmt: skip


@check("tap_with_device")
def _with_device(result: CaseResult) -> None:
    assert values_of(result)["result"] == 12.0
    assert_device_output("device: cpu:0\n( 6.00 9.00 )", result)


@check("tap_jit_devices")
def _jit_devices(result: CaseResult) -> None:
    got = values_of(result)
    assert got["results"] == [112] * got["devices"]
    assert len(re.findall(r"111", result.output)) == got["devices"], result.output
    assert len(re.findall(r"112", result.output)) == got["devices"], result.output


@check("tap_pytree[with_jit=True]", "tap_pytree[with_jit=False]")
def _pytree(result: CaseResult) -> None:
    assert values_of(result)["results"] == {
        "pair_1_x": "(1, 10)", "pair_x_2x": "(10, 20)", "dict": "{'a': 20, 'b': 30}"}  # fmt: skip
    # host_callback's test counted the calls and compared each arg, in no given order.
    assert sorted(lines(result.output)) == sorted(
        ["pair_1_x: (1, 5)", "pair_x_2x: (5, 10)", "dict: {'a': 10, 'b': 15}"]
    )


@check("tap_multiple")
def _multiple(result: CaseResult) -> None:
    values_of(result)
    assert sorted(lines(result.output)) == [f"pause_tap {i}" for i in range(5)]


@check("tap_jit_large")
def _jit_large(result: CaseResult) -> None:
    values_of(result)
    arg = np.arange(10000, dtype=np.int32).reshape((10, 10, 5, -1))
    assert_output(np.array2string(arg), result.output)


@check("tap_jit_several_together")
def _several_together(result: CaseResult) -> None:
    values_of(result)
    x = np.arange(50, dtype=np.int32).reshape((10, 5))
    parts = [np.array2string(a) for a in (x, np.ones(100, dtype=np.int32), x * 2)]
    assert squeeze(result.output) == squeeze(f"( {' '.join(parts)} )")


@check("tap_jit_interleaving")
def _interleaving(result: CaseResult) -> None:
    assert values_of(result)["result"] == 410
    assert lines(result.output) == ["tap list 5"] * 100


@check("tap_callback_delay_barrier")
def _delay_barrier(result: CaseResult) -> None:
    expected = """
        what: x times 1
        [[0. 1. 2.]
         [3. 4. 5.]]
        what: x times 2
        [[ 0.  2.  4.]
         [ 6.  8. 10.]]
        what: x times 3
        [[ 0.  6. 12.]
         [18. 24. 30.]]"""
    assert_output(expected, values_of(result)["first"])
    assert_output(expected, result.output)


@check("tap_id_tap_removed_kwargs")
def _removed_kwargs(result: CaseResult) -> None:
    got = values_of(result)
    assert got["raised"] == "TypeError", got
    assert re.search(r"Support for \*\*kwargs in ``id_tap``", got["message"]), got["message"]
    assert "functools.partial" in got["message"]


def _interleaved_expected(prefix_of: Callable[[int], str]) -> list[str]:
    return [f"{prefix_of(k)} ({i}, {k})" for i in range(2000) for k in range(3)]


@check("tap_thousands_interleaved")
def _thousands(result: CaseResult) -> None:
    assert values_of(result)["totals"] == [499500, 1499500]
    got = lines(result.output)
    assert len(got) == 6000
    assert got == _interleaved_expected(lambda k: "record")


@check("tap_thousands_two_functions")
def _thousands_two(result: CaseResult) -> None:
    assert values_of(result)["totals"] == [499500, 1499500]
    got = lines(result.output)
    expected = _interleaved_expected(lambda k: "other" if k == 1 else "record")
    assert len(got) == 6000
    if result.mode == "closure":
        assert got == expected  # one receiver in the emitting process: program order
    for prefix in ("record", "other"):  # per tap function, program order
        assert [g for g in got if g.startswith(prefix)] == [
            e for e in expected if e.startswith(prefix)
        ]


@check("tap_higher_order_grad_float0_result")
def _higher_order(result: CaseResult) -> None:
    got = values_of(result)
    assert_output(FLOAT0, got["order0"])
    assert_output(FLOAT0, got["order1"])


@check("tap_odeint")
def _odeint(result: CaseResult) -> None:
    # x(t) = exp(-k t): d x(0.001) / dk at k = 1 is -0.001 exp(-0.001)
    assert values_of(result)["grad"] == pytest.approx(-0.001 * np.exp(-0.001), rel=1e-4)


# devices

DEVICE_BATCH = "transforms: [('batch', {'batch_dims': (0,)})] what: x * 2"


@check("tap_pmap")
def _pmap(result: CaseResult) -> None:
    assert values_of(result)["result"] == [27, 64]
    assert_device_output("""
        device: cpu:0 what: x,x^2
        ( 3 9 )
        device: cpu:1 what: x,x^2
        ( 4 16 )""", result)  # fmt: skip


def expect_devices(case: str, output: str) -> None:
    def fn(result: CaseResult) -> None:
        assert values_of(result)["equal"] is True
        assert_device_output(output, result)

    CHECKS[case] = fn


expect_devices("tap_pmap_vmap", f"""
    device: cpu:0 {DEVICE_BATCH}
    [0.00 2.00 4.00]
    device: cpu:1 {DEVICE_BATCH}
    [20.00 22.00 24.00]""")  # fmt: skip
expect_devices("tap_pmap_pmap_vmap", f"""
    device: cpu:0 {DEVICE_BATCH}
    [0.00 2.00 4.00]
    device: cpu:1 {DEVICE_BATCH}
    [200.00 202.00 204.00]""")  # fmt: skip
expect_devices("tap_pmap_pmap_extra", """
    device: cpu:0 what: before
    [[1.00 2.00 3.00]]
    device: cpu:0 what: inside
    [2.00 4.00 6.00]
    device: cpu:0 what: after
    [[3.00 5.00 7.00]]
    device: cpu:1 what: before
    [[101.00 102.00 103.00]]
    device: cpu:1 what: inside
    [202.00 204.00 206.00]
    device: cpu:1 what: after
    [[203.00 205.00 207.00]]""")  # fmt: skip
expect_devices("tap_jvp_pmap_vmap", f"""
    device: cpu:0 {DEVICE_BATCH}
    [[ 0.00  2.00  4.00]
     [20.00 22.00 24.00]]
    device: cpu:1 {DEVICE_BATCH}
    [[200.00 202.00 204.00]
     [220.00 222.00 224.00]]""")  # fmt: skip
expect_devices("tap_vmap_pmap", f"""
    device: cpu:0 {DEVICE_BATCH}
    [[  0.00   2.00   4.00]
     [200.00 202.00 204.00]]
    device: cpu:1 {DEVICE_BATCH}
    [[ 20.00  22.00  24.00]
     [220.00 222.00 224.00]]""")  # fmt: skip
# host_callback's jit of pmap ran the code around the pmap on every device, so "before"
# and "after" were tapped once per device. In jax >= 0.4.31 a jit is one program over its
# devices: the code around the pmap runs once, and its taps run once, on the first
# device, as jax.debug.callback's do (docs/MIGRATING.md, "jit of pmap").
expect_devices("tap_jit_pmap_extra", """
    device: cpu:0 what: before
    [[ 1.00  2.00  3.00]
     [11.00 12.00 13.00]]
    device: cpu:0 what: inside
    [2.00 4.00 6.00]
    device: cpu:0 what: after
    [[ 3.00  5.00  7.00]
     [23.00 25.00 27.00]]
    device: cpu:1 what: inside
    [22.00 24.00 26.00]""")  # fmt: skip
for index in (0, 1):
    # One call, with the whole value, on device `device_index`.
    expect_devices(f"tap_pjit[device_index={index}]", f"""
        device: cpu:{index} what: z
        [[ 3  3  3  3]
         [33 33 33 33]]""")  # fmt: skip


@check("tap_id_tap_random_key")
def _random_key(result: CaseResult) -> None:
    assert values_of(result)["result"] == [0, 123]
    assert lines(result.output) == ["uint32(2,):[0, 123]"]


@check("tap_typed_key")
def _typed_key(result: CaseResult) -> None:
    got = values_of(result)
    assert got["result"] == [0, 123]
    assert lines(result.output) == [
        "uint32(2,):[0, 123]",
        "{'key': uint32(2,):[0, 123], 'x': float32():1.0}",
        f"uint32(2, 2):{got['split']}",
    ]


def _dtype_check(dtype: str) -> Check:
    def fn(result: CaseResult) -> None:
        assert values_of(result)["identity"] is True
        expected = []
        for nr_args in (1, 2):
            for shape in ((), (2,), (2, 3), (2, 3, 4)):
                size = int(np.prod(shape))
                if dtype == "bool":
                    arg = (np.arange(size) % 2 == 0).reshape(shape)
                else:
                    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
                    arg = np.arange(size).astype(np_dtype).reshape(shape)
                printed = " ".join([np.array2string(arg)] * nr_args)
                expected.append(f"a_new_test: ************ testcase_name: "
                                f"{shape=}_{dtype=}_{nr_args=}\n[ {printed} ]")  # fmt: skip
        assert squeeze(result.output) == squeeze("\n".join(expected))

    return fn


for _dtype in ("bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "bfloat16",
               "float16", "float32"):  # fmt: skip
    CHECKS[f"tap_jit_dtypes[dtype={_dtype}]"] = _dtype_check(_dtype)


# exceptions


def _exception_check(exc_name: str, message: str | None) -> Check:
    # host_callback_test's own regex (test_tap_eval_exception, test_tap_jit_tap_exception):
    # the message holds the tap function's exception as `traceback.format_exc()` gave it.
    formatted = f"{exc_name}: {message}" if message else exc_name
    jax_regex = re.compile(
        f"There were exceptions during callback processing. Last one was:.*{formatted}", re.DOTALL
    )

    def fn(result: CaseResult) -> None:
        got = values_of(result)
        assert got["result"] == 3  # the computation is not affected by the tap's error
        assert got["raised"] is not None, "barrier_wait did not raise"
        assert got["is_callback_exception"], f"barrier_wait raised {got['raised']}"
        assert jax_regex.search(got["message"]), got["message"]
        assert "Traceback (most recent call last):" in got["message"], got["message"]
        assert ", in tap_err" in got["message"], got["message"]  # the tap function's frame
        if result.mode == "closure":  # raised here: chained, as host_callback did
            assert got["cause"] == (f"{exc_name}({message!r})" if message else f"{exc_name}()")
        else:  # raised in a subscriber process: its traceback came as text
            assert got["cause"] is None, got["cause"]
        # Everything but the failing tap was delivered; the error is reported once.
        assert_output("what: x1\n1\nwhat: x3\n3", got["output_before"])
        assert got["second"] == {"raised": None}

    return fn


CHECKS["tap_eval_exception"] = _exception_check("ValueError", "Some user message")
CHECKS["tap_jit_tap_exception"] = _exception_check("NotImplementedError", None)

assert set(CHECKS) == set(GROUP_OF), set(CHECKS) ^ set(GROUP_OF)


@pytest.mark.parametrize("case", list(GROUP_OF))
def test_host_callback_case(run: Callable[[str], CaseResult], case: str) -> None:
    CHECKS[case](run(case))
