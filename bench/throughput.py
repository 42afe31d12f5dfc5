"""Section 2 of bench/run.py at two tapd revisions, alternating, into bench/THROUGHPUT.md.

    git worktree add --detach /tmp/tapd-before 2345605
    cp tapd/native/*.so /tmp/tapd-before/tapd/native/   # (the native code is the same)
    .venv/bin/python bench/throughput.py --before /tmp/tapd-before --rounds 3

Each round runs `bench/run.py --throughput-only` twice, once importing tapd (daemon,
subscriber and emitter alike) from the `--before` checkout through PYTHONPATH and once
from this one (or from the `--after` checkout: a commit's code alone, without changes
in progress beside it), the order flipped every round, so that both see the same noise. Every
figure is the median over the rounds of each run's own median; `÷ pyzmq` divides by
the raw pyzmq baseline measured inside the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from processes import BENCH_DIR
from report import code_revision, load_average, machine_description, median, number, table

# (what a row of bench/THROUGHPUT.md is, where its figures come from in a run's JSON)
ROWS = {
    "64 B x 10,000, per-tap handler (the sizes' row)": ("sizes", "64", 64),
    "64 B x 100,000, per-tap handler": ("handlers", "per-tap handler", 64),
    "64 B x 100,000, batch handler": ("handlers", "batch handler", 64),
    "64 KiB": ("sizes", str(64 * 1024), 64 * 1024),
    "1 MiB": ("sizes", str(1024 * 1024), 1024 * 1024),
}

FINDINGS = "## Findings"

# Copies of a tap's bytes per hop, user space (docs/PROTOCOL.md; tapd/daemon/runs.py,
# tapd/protocol/batch.py, tapd/channel.py): hop, before (2345605), after.
COPIES = [
    ["emitter -> ring", "1: the FFI handler's memcpy into the ring", "1 (unchanged)"],
    ["ring -> daemon", "0: records are views of the mapped ring", "0"],
    ["daemon, 64 B taps (ring runs)",
     "2: `bytes(span)`, then pyzmq's copy (spans under 64 KiB)",
     "1: pyzmq copies the ring view (spans under 256 KiB; longer: `bytes(span)`, uncopied)"],
    ["daemon, 64 KiB taps",
     "2: `shared += array`, `bytes(shared)`; sent uncopied (a GC-thread wake each)",
     "1: two to a run, the ring view copied by pyzmq"],
    ["daemon, 1 MiB taps", "0: the ring view, uncopied, in a `tap` message", "0 (unchanged)"],
    ["daemon -> subscriber", "2 in the kernel (socket write and read)", "2 (unchanged)"],
    ["subscriber -> handler", "0: views of the received frame", "0 (unchanged)"],
]  # fmt: skip


def run_once(checkout: Path | None, repeats: int, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if checkout is not None:
        env["PYTHONPATH"] = f"{checkout}:{checkout / 'client'}"
    argv = [sys.executable, str(BENCH_DIR / "run.py"), "--throughput-only", str(out),
            "--repeats", str(repeats)]  # fmt: skip
    subprocess.run(argv, env=env, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def figures(run: dict[str, Any], row: str) -> dict[str, float]:
    """taps/s, MB/s, ÷ raw pyzmq and the daemon's CPU µs/tap of one run, for `row`."""
    part, key, size = ROWS[row]
    entry = run[part][key]
    seconds = median(entry["tapd_s"])
    rate = entry["count"] / seconds
    zmq = run["sizes"][str(size)]  # the raw pyzmq baseline at this size, same run
    zmq_rate = zmq["count"] / median(zmq["zmq_s"])
    return {
        "taps_s": rate,
        "mb_s": rate * size / 1e6,
        "vs_zmq": rate / zmq_rate,
        "cpu_us": median(entry["cpu_s"]) / entry["count"] * 1e6,
    }


def render(
    runs: dict[str, list[dict[str, Any]]],
    machine: list[tuple[str, str]],
    command: str,
    findings: str,
) -> str:
    lines = ["# Socket-path throughput: before and after (issue 20, part 1)", ""]
    lines += ["Taken on a shared 2-core machine, under contention from other work: compare",
              "the two columns of one table (same rounds, alternating), not absolute figures.",
              ""]  # fmt: skip
    lines += ["## Machine", "", table(["", ""], [list(m) for m in machine]), ""]
    lines += ["## Reproduce", "", "```", command, "```", ""]
    rounds = len(runs["after"])
    lines += ["## Figures", "",
              f"Median over {rounds} alternating rounds of each run's median (each run: "
              "bench/run.py section 2), the rounds' lowest and highest in brackets. Daemon "
              "CPU: user + system from /proc/<pid>/stat around each timed run.", ""]  # fmt: skip
    for row in ROWS:
        got = {name: [figures(r, row) for r in rs] for name, rs in runs.items()}

        def cell(name: str, key: str, digits: int, got: dict[str, Any] = got) -> str:
            values = [f[key] for f in got[name]]
            low, high = min(values), max(values)
            spread = (
                f" ({number(low, digits)} to {number(high, digits)})" if len(values) > 1 else ""
            )
            return number(median(values), digits) + (spread if len(values) > 1 else "")

        body = [
            ["taps/s", cell("before", "taps_s", 0), cell("after", "taps_s", 0)],
            ["MB/s", cell("before", "mb_s", 1), cell("after", "mb_s", 1)],
            ["÷ raw pyzmq (same run)", cell("before", "vs_zmq", 3), cell("after", "vs_zmq", 3)],
            ["daemon CPU µs/tap", cell("before", "cpu_us", 2), cell("after", "cpu_us", 2)],
        ]
        lines += [f"### {row}", "", table(["", "before", "after"], body), ""]
    lines += ["## Copies of a tap's bytes, per hop (user space)", ""]
    copies_header = ["hop", "before issue 20 (2345605)", "since issue 20 (38903aa on)"]
    lines += [table(copies_header, COPIES), ""]
    return "\n".join(lines) + findings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the older tapd")
    parser.add_argument("--after", type=Path, help="checkout of the newer tapd (default: this)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="repeats inside each run")
    parser.add_argument("--output", type=Path, default=BENCH_DIR / "THROUGHPUT.md")
    args = parser.parse_args()
    machine = machine_description()  # (the load average at the start, with the rest)
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="tapdt-") as scratch:
        for number_ in range(args.rounds):
            order = ["before", "after"] if number_ % 2 == 0 else ["after", "before"]
            for name in order:
                checkout = args.before if name == "before" else args.after
                out = Path(scratch) / f"{name}-{number_}.json"
                runs[name].append(run_once(checkout, args.repeats, out))
                print(f"round {number_ + 1}/{args.rounds}: {name} done", flush=True)
    machine.append(("load average at end", load_average()))
    machine.append(("tapd before", code_revision(args.before)))
    machine.append(("tapd after", code_revision(args.after or BENCH_DIR.parent)))
    command = " ".join([".venv/bin/python bench/throughput.py", *sys.argv[1:]])
    # The findings (written by hand, below the figures) stay from one run to the next.
    old = args.output.read_text() if args.output.exists() else ""
    findings = old[old.index(FINDINGS) :] if FINDINGS in old else ""
    text = render(runs, machine, command, findings and "\n" + findings)
    args.output.write_text(text)
    (args.output.with_suffix(".json")).write_text(json.dumps(runs, indent=1))
    print(text)


if __name__ == "__main__":
    main()
