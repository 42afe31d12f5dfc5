"""Runs gallery programs in one process, in one mode, and writes what each did.

    python examples/gallery/worker.py --mode reference --out DIR prog1 prog2 ...
    python -m tapd.debug examples/gallery/worker.py --mode tapd --out DIR ...
    python -m tapd.hcb examples/gallery/worker.py --mode hcb --out DIR ...
    python -m tapd.debug examples/gallery/worker.py --mode tap --out DIR ...  (a daemon
        and examples/gallery/subscriber.py at TAPD_ENDPOINT)

A process opens the accelerator once (~15 s on a TPU), so one process runs every
program of a mode. For each program: a first call (compiles; host functions take no
time), then the timed calls, interleaved: `--fast-repeats` with host functions that take
no time, `--slow-repeats` with each taking `--delay-ms`; the fastest of each is kept. Each timed
call is the program's `main()` (its jitted loop and the fetch of its results); what its
host functions still have to do is waited for after the clock stops. Writes
DIR/<program>.<mode>.json (times, host calls of the first slow call, or an error) and
DIR/<program>.<mode>.npz (the results of that call).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "programs")]

import harness  # noqa: E402  (after the path above)


class ProgramTimeout(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=("reference", "tapd", "hcb", "tap"))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--delay-ms", type=float, default=50.0)
    parser.add_argument("--fast-repeats", type=int, default=4)
    parser.add_argument("--slow-repeats", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a program")
    parser.add_argument("--delay-file", type=Path, help="tap mode: the subscriber's delay")
    parser.add_argument("programs", nargs="+")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = sys.stdout
    # The program's lines go through the recorder to this process's stderr (the log);
    # this worker's own lines go to its real stdout, never while a loop is timed.
    sys.stdout = harness.SlowStdout(sys.stderr)
    harness.wrap_debug_callback()
    if args.mode == "reference":
        harness.install_host_callback_shim()
    elif args.mode == "hcb":
        harness.wrap_tapd_id_tap()
    elif args.mode == "tap":
        harness.tap_prints()
    import jax

    log.write(f"worker {args.mode}: jax {jax.__version__} on {jax.devices()[0].platform}\n")
    log.flush()
    for name in args.programs:
        started = time.monotonic()
        report: dict[str, Any] = {"program": name, "mode": args.mode}
        signal.signal(signal.SIGALRM, _timed_out)
        signal.alarm(int(args.timeout))
        try:
            report.update(run_program(name, args))
        except BaseException as exc:  # a program's failure is its row, not the run's end
            report["error"] = "".join(traceback.format_exception_only(exc)).strip()
            report["traceback"] = traceback.format_exc()
            if isinstance(exc, KeyboardInterrupt):
                raise
        finally:
            signal.alarm(0)
        report["wall_s"] = time.monotonic() - started
        (args.out / f"{name}.{args.mode}.json").write_text(json.dumps(report, indent=1))
        log.write(f"  {name}: {report.get('error') or 'done'} ({report['wall_s']:.1f} s)\n")
        log.flush()


def _timed_out(signum: int, frame: Any) -> None:
    raise ProgramTimeout("the program ran past the worker's --timeout")


def run_program(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np

    module = importlib.import_module(name)
    recorder = harness.RECORDER

    def timed(delay: float) -> tuple[float, Any, list[str]]:
        set_delay(delay, args.delay_file)
        recorder.take()
        begin = time.perf_counter()
        result = jax.block_until_ready(module.main())
        seconds = time.perf_counter() - begin
        # A program whose main() does more than its loop (a bar's close) times the loop.
        seconds = getattr(module, "CALL_SECONDS", None) or seconds
        settle()
        return seconds, result, recorder.take() + subscriber_lines(args)

    first, _, first_calls = timed(0.0)
    # Interleaved, so that what else the machine does weighs on both alike; the extra
    # free calls (the reference's: its slow call takes seconds) come first.
    fast, slow = [], []
    for i in range(max(args.fast_repeats, args.slow_repeats)):
        if i >= args.fast_repeats - args.slow_repeats:
            slow.append(timed(args.delay_ms / 1000))
        if i < args.fast_repeats:
            fast.append(timed(0.0))
    set_delay(0.0, args.delay_file)
    _, result, calls = slow[0]
    leaves = jax.tree_util.tree_leaves(result)
    np.savez(args.out / f"{name}.{args.mode}.npz", *[np.asarray(leaf) for leaf in leaves])
    return {
        "first_s": first,
        "fast_s": min(t for t, _, _ in fast),
        "slow_s": min(t for t, _, _ in slow),
        "fast_all": [t for t, _, _ in fast],
        "slow_all": [t for t, _, _ in slow],
        "calls": calls,
        "calls_other_runs_same": all(sorted(c) == sorted(calls) for _, _, c in [*fast, *slow[1:]]),
        "first_calls": len(first_calls),
        "ordered": bool(getattr(module, "ORDERED", False)),
        "leaves": len(leaves),
    }


def settle() -> None:
    """Every host function of the call has run (tapd's, when tapd serves them)."""
    import jax

    jax.effects_barrier()  # (tapd's after install_debug: JAX's, then tapd.barrier_wait)
    if "tapd" in sys.modules and sys.modules["tapd"].__dict__.get("barrier_wait"):
        sys.modules["tapd"].barrier_wait(timeout=300)


def set_delay(delay: float, delay_file: Path | None) -> None:
    harness.RECORDER.delay = delay
    if delay_file is not None:  # the subscriber reads it before each line
        delay_file.write_text(str(delay))


def subscriber_lines(args: argparse.Namespace) -> list[str]:
    """Tap mode: the lines the subscriber printed for the call (its file, emptied)."""
    path = os.environ.get("GALLERY_SUBSCRIBER_LINES")
    if args.mode != "tap" or not path or not os.path.exists(path):
        return []
    with open(path, "r+") as file:
        lines = file.read().splitlines()
        file.seek(0)
        file.truncate()
    return ["print: " + line for line in lines]


if __name__ == "__main__":
    main()
