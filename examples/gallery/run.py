"""The gallery: public JAX programs run with stock `jax.debug`, under tapd's drop-ins,
and with `tapd.tap` to a subscriber process; each run checked against the reference.

    python examples/gallery/run.py [--out DIR] [--report FILE.md] [PROGRAM ...]

One worker process a mode (a TPU process costs ~15 s to open the chip), in turn:
- `reference`: `python worker.py`, stock `jax.debug` (the host_callback programs with
  `id_tap` as an ordered `jax.debug.callback`);
- `tapd`: `python -m tapd.debug worker.py` (the others);
- `hcb`: `python -m tapd.hcb worker.py` (the programs written for host_callback);
- `tap`: `python -m tapd.debug worker.py` with each `jax.debug.print` sent by `tapd.tap`
  to a subscriber process (examples/gallery/subscriber.py) of a `tapd` daemon at an
  ipc:// endpoint (a TPU machine allows no TCP).
Every host function takes 50 ms in the slow runs (harness.py). Checks against the
reference, per program and mode: the same host calls (printed lines, callback
arguments; as a sequence where JAX promises the order, else as a multiset); results
identical; the timed loop with 50 ms host functions under half the reference's, and
within 1.1x of the same loop with host functions that take no time (or 2 ms of it: below
that the ratio measures the clock, not the host functions). Writes a markdown table
(`--report`) and DIR/summary.json; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

# name: (modes besides the reference, what the program is)
PROGRAMS: dict[str, tuple[tuple[str, ...], str]] = {
    "flax_optax_scan_tqdm": (("tapd",), "Flax Linen + Optax training, jax-tqdm bar (scan)"),
    "jax_tqdm_fori": (("tapd",), "jax-tqdm loop_tqdm (fori_loop)"),
    "jaxopt_lbfgs_verbose": (("tapd", "tap"), "JAXopt LBFGS verbose (while)"),
    "optax_lbfgs_while": (("tapd", "tap"), "Optax L-BFGS, print per iteration (while)"),
    "jax_debugging_docs": (("tapd",), "JAX debugging docs: print in vmap/grad, callback in cond"),
    "purejaxrl_cartpole": (("tapd",), "PureJaxRL-style CartPole rollout, DEBUG callback"),
    "shard_map_data_parallel": (("tapd", "tap"), "shard_map data-parallel step (fori)"),
    "host_callback_logging": (("hcb",), "host_callback id_tap + tqdm (while/fori)"),
    "tqdm_closed_after_call": (("tapd",), "tqdm bar closed by host code after the call"),
    # Last in each mode, the longest: on the TPU its loop's own steps take ~87 ms (a solve
    # ~3.9 s, docs/TAPPING.md), and a mode cut short by --deadline keeps the rows of the
    # programs before it.
    "optimistix_diffeq": (("tapd", "tap"), "optimistix verbose least_squares, vmapped Diffrax"),
}
LAUNCH = {
    "reference": [],
    "tapd": ["-m", "tapd.debug"],
    "hcb": ["-m", "tapd.hcb"],
    "tap": ["-m", "tapd.debug"],
}
RATIO_VS_REFERENCE = 0.5
RATIO_VS_FREE = 1.1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None, help="raw results (default: temp)")
    parser.add_argument("--report", type=Path, help="write the markdown table here")
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds a program")
    parser.add_argument("--modes", default="reference,tapd,hcb,tap")
    parser.add_argument(
        "--within-spread",
        action="store_true",
        help="the 1.1x check also passes when the slow loop's best is within the free "
        "loop's own spread (its slowest call): for a shared CPU, whose noise is larger",
    )
    parser.add_argument("--deadline", type=float, default=3600.0, help="seconds for it all")
    parser.add_argument("--fast-repeats", type=int, default=4)
    parser.add_argument("--slow-repeats", type=int, default=4)
    parser.add_argument(
        "--clock-floor",
        type=float,
        default=0.002,
        help="seconds of difference below which the 1.1x check passes (the clock's noise)",
    )
    parser.add_argument("programs", nargs="*")
    args = parser.parse_args(argv)
    names = args.programs or list(PROGRAMS)
    out = args.out or Path(tempfile.mkdtemp(prefix="gallery-"))
    out.mkdir(parents=True, exist_ok=True)
    args.ends_at = time.monotonic() + args.deadline
    for mode in args.modes.split(","):
        chosen = [n for n in names if mode == "reference" or mode in PROGRAMS[n][0]]
        if chosen:
            run_mode(mode, chosen, out, args)
    rows = [
        check(name, mode, out, args.clock_floor, args.within_spread)
        for name in names
        for mode in PROGRAMS[name][0]
    ]
    table = markdown(rows, out, args.delay_ms)
    print(table)
    (out / "summary.json").write_text(json.dumps(rows, indent=1))
    if args.report:
        args.report.write_text(table)
    return 0 if all(row["passed"] for row in rows) else 1


def run_mode(mode: str, names: list[str], out: Path, args: argparse.Namespace) -> None:
    """One worker process runs `names` in `mode` (with a daemon and subscriber for tap)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (env.get("PYTHONPATH", ""), str(ROOT), str(ROOT / "client")) if p
    )
    argv = [sys.executable, *LAUNCH[mode], str(HERE / "worker.py"), "--mode", mode,
            "--out", str(out), "--delay-ms", str(args.delay_ms),
            "--timeout", str(args.timeout), "--fast-repeats", str(args.fast_repeats),
            # (the reference's slow call takes seconds: its clock noise is nothing)
            "--slow-repeats", "1" if mode == "reference" else str(args.slow_repeats),
            *names]  # fmt: skip
    # What is left of --deadline (a device command has a limit): a mode cut short says
    # so in its rows ("no result"), the others' rows stand.
    budget = min(args.timeout * len(names) + 60, args.ends_at - time.monotonic() - 10)
    if budget < 30:
        print(f"{mode}: not run, {budget:.0f} s of --deadline left", file=sys.stderr)
        return
    started: list[subprocess.Popen[str]] = []
    log = open(out / f"worker-{mode}.log", "w")  # noqa: SIM115 (closed below)
    try:
        if mode == "tap":
            runtime = Path(tempfile.mkdtemp(prefix="gtap-", dir="/tmp"))
            env.update(start_tap_processes(runtime, env, started, log))
            argv[argv.index("--timeout"):argv.index("--timeout")] = [
                "--delay-file", env["GALLERY_DELAY_FILE"]]  # fmt: skip
        begin = time.monotonic()
        worker = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=budget, check=False)  # fmt: skip
        print(f"{mode}: exit {worker.returncode} in {time.monotonic() - begin:.1f} s",
              file=sys.stderr)  # fmt: skip
    except subprocess.TimeoutExpired:
        print(f"{mode}: the worker ran past its time", file=sys.stderr)
    except RuntimeError as exc:  # the tap mode's daemon or subscriber: its rows say so
        print(f"{mode}: {exc}", file=sys.stderr)
        log.write(f"{exc}\n")
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        log.close()


def start_tap_processes(
    runtime: Path, env: dict[str, str], started: list[subprocess.Popen[str]], log: Any
) -> dict[str, str]:
    """A `tapd` daemon at an ipc:// endpoint in `runtime`, and the gallery's subscriber
    connected to it (waited for in the daemon's own view of its subscribers)."""
    from tapd.clients import control

    endpoint = f"ipc://{runtime / 'tapd.sock'}"
    quiet = {**env, "JAX_PLATFORMS": "cpu"}  # neither needs the chip (one holder at a time)
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tapd",
            "start",
            "--endpoint",
            endpoint,
            "--startup-grace",
            "0",
            "--pidfile",
            str(runtime / "tapd.pid"),
        ],
        env=quiet,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    started.append(daemon)
    assert daemon.stdout is not None
    ready = daemon.stdout.readline()
    if not ready.startswith("tapd ready"):
        raise RuntimeError(f"the daemon did not start: {ready!r}")
    lines, delay = runtime / "lines.txt", runtime / "delay.txt"
    lines.touch()
    delay.write_text("0")
    subscriber = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "subscriber.py"),
            "--endpoint",
            endpoint,
            "--lines",
            str(lines),
            "--delay-file",
            str(delay),
        ],
        env=quiet,
        stdout=log,
        stderr=log,
        text=True,
    )
    started.append(subscriber)
    deadline = time.monotonic() + 60
    while not control.stats(endpoint, timeout=5.0)["subscribers"]:
        if subscriber.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the gallery's subscriber did not connect")
        time.sleep(0.05)
    return {"TAPD_ENDPOINT": endpoint, "TAPD_AUTOSTART": "0",
            "GALLERY_SUBSCRIBER_LINES": str(lines), "GALLERY_DELAY_FILE": str(delay)}  # fmt: skip


def load(name: str, mode: str, out: Path) -> dict[str, Any]:
    path = out / f"{name}.{mode}.json"
    if not path.exists():
        return {"error": f"no result (the {mode} worker did not reach it: worker-{mode}.log)"}
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def same_results(name: str, mode: str, out: Path) -> tuple[bool, str]:
    try:
        ref = np.load(out / f"{name}.reference.npz")
        got = np.load(out / f"{name}.{mode}.npz")
    except OSError as exc:
        return False, f"results missing ({exc})"
    if len(ref.files) != len(got.files):
        return False, f"{len(got.files)} result leaves, the reference {len(ref.files)}"
    worst = 0.0
    for key in ref.files:
        a, b = ref[key], got[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, f"leaf {key}: {b.dtype}{b.shape}, the reference {a.dtype}{a.shape}"
        if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
            worst = max(worst, float(np.max(np.abs(a.astype(float) - b.astype(float)))))
    if worst:
        return False, f"results differ (max |diff| {worst:.3g})"
    return True, "identical"


def same_calls(ref: dict[str, Any], got: dict[str, Any]) -> tuple[bool, str]:
    a, b = ref["calls"], got["calls"]
    if ref.get("ordered"):
        if a == b:
            return True, f"{len(a)} in order"
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        where = f"first difference at {first}" if first is not None else "lengths differ"
        return False, f"{len(b)} calls, the reference {len(a)} ({where})"
    if Counter(a) == Counter(b):
        return True, f"{len(a)} as a multiset"
    missing, extra = Counter(a) - Counter(b), Counter(b) - Counter(a)
    sample = next(iter(missing or extra))
    return False, (f"{len(b)} calls, the reference {len(a)}: {sum(missing.values())} "
                   f"missing, {sum(extra.values())} extra, e.g. {sample[:120]!r}")  # fmt: skip


def check(
    name: str, mode: str, out: Path, clock_floor: float, within_spread: bool = False
) -> dict[str, Any]:
    ref, got = load(name, "reference", out), load(name, mode, out)
    row: dict[str, Any] = {"program": name, "mode": mode, "what": PROGRAMS[name][1]}
    failures = [
        f"{which}: {r['error']}" for which, r in (("reference", ref), (mode, got)) if "error" in r
    ]
    if failures:
        row.update(passed=False, failures=failures)
        return row
    calls_ok, calls_note = same_calls(ref, got)
    results_ok, results_note = same_results(name, mode, out)
    vs_reference = got["slow_s"] / ref["slow_s"]
    vs_free = got["slow_s"] / got["fast_s"]
    fast_enough = vs_reference < RATIO_VS_REFERENCE
    free_enough = vs_free <= RATIO_VS_FREE or got["slow_s"] - got["fast_s"] <= clock_floor
    spread_note = ""
    if not free_enough and within_spread and got["slow_s"] <= max(got["fast_all"]):
        free_enough = True
        spread_note = f" (÷ 0 ms {vs_free:.2f}: within the free loop's spread)"
    if not calls_ok:
        failures.append(f"host calls: {calls_note}")
    if not results_ok:
        failures.append(results_note)
    if not fast_enough:
        # (the reference's own loop, host functions free, is the floor no tapd run beats)
        floor = ref["fast_s"] / ref["slow_s"]
        failures.append(
            f"slow loop {vs_reference:.2f} of the reference's (want < 0.5; the reference "
            f"with free host functions is {floor:.2f} of it)"
        )
    if not free_enough:
        failures.append(f"slow loop {vs_free:.2f} of itself with free host functions")
    row.update(
        passed=not failures, failures=failures, calls=calls_note + spread_note,
        results=results_note,
        ref_slow_s=ref["slow_s"], ref_fast_s=ref["fast_s"], slow_s=got["slow_s"],
        fast_s=got["fast_s"], vs_reference=vs_reference, vs_free=vs_free,
    )  # fmt: skip
    return row


def markdown(rows: list[dict[str, Any]], out: Path, delay_ms: float) -> str:
    lines = [
        f"| program | mode | host calls | results | reference, {delay_ms:g} ms host (s) "
        f"| tapd, {delay_ms:g} ms (s) | tapd, 0 ms (s) | ÷ reference | ÷ 0 ms | checks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "slow_s" not in row:
            lines.append(f"| {row['program']} | {row['mode']} | | | | | | | | "
                         f"FAIL: {'; '.join(row['failures'])} |")  # fmt: skip
            continue
        verdict = "pass" if row["passed"] else "FAIL: " + "; ".join(row["failures"])
        lines.append(
            f"| {row['program']} | {row['mode']} | {row['calls']} | {row['results']} "
            f"| {row['ref_slow_s']:.3f} | {row['slow_s']:.4f} | {row['fast_s']:.4f} "
            f"| {row['vs_reference']:.3f} | {row['vs_free']:.2f} | {verdict} |"
        )
    passed = sum(row["passed"] for row in rows)
    lines.append("")
    lines.append(f"{passed} of {len(rows)} runs passed every check (raw results: {out}).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
