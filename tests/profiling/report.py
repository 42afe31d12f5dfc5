"""The tables of scripts/suite-profile, from what plugin.py and sitecustomize.py wrote:
where the suite's CPU goes, by test module and by kind of process, and how busy the
cores were through the run (a test's CPU spread evenly over its wall time).

    python tests/profiling/report.py DIR [--top N]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
from pathlib import Path
from typing import Any


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def process_kind(record: dict[str, Any]) -> str:
    """`tapd start`, `emitter_app.py [jax]`, `-c [jax]` (a pytest-xdist worker, or a
    program given inline)."""
    argv = record["argv"] or ["?"]
    name = os.path.basename(argv[0])
    if name == "__main__.py" and len(argv) > 1:  # python -m tapd <command>
        name = f"{Path(argv[0]).parent.name} {argv[1]}"
    return name + (" [jax]" if record["jax"] else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    tests = [r for path in sorted(args.directory.glob("*.tests")) for r in _lines(path)]
    exits = args.directory / "processes"
    processes = _lines(exits) if exits.exists() else []
    if not tests:
        raise SystemExit(f"no test records in {args.directory}")
    start, end = min(r["start"] for r in tests), max(r["end"] for r in tests)
    total = sum(r["cpu"] for r in tests)
    print(f"{len(tests)} tests, {end - start:.0f} s from the first test's start to the last's end, "
          f"{total:.0f} s of CPU ({total / (end - start):.0%} of one core on average)")  # fmt: skip

    by_module: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in tests:
        row = by_module[r["test"].split("::")[0]]
        row[0] += 1
        row[1] += r["cpu"]
        row[2] += r["end"] - r["start"]
    print(f"\nCPU s   wall s  tests  module (top {args.top})")
    modules = sorted(by_module.items(), key=lambda kv: -kv[1][1])
    for module, (count, cpu, wall) in modules[: args.top]:
        print(f"{cpu:6.1f} {wall:7.1f} {count:6d}  {module}")

    if processes:
        by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
        for r in processes:
            row = by_kind[process_kind(r)]
            row[0] += 1
            row[1] += r["cpu"]
        cpu_all = sum(row[1] for row in by_kind.values())
        print(f"\n{len(processes)} processes that exited, {cpu_all:.0f} s of CPU")
        print("CPU s  count  s each  kind")
        for kind, (count, cpu) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[: args.top]:
            print(f"{cpu:6.1f} {count:6d} {cpu / count:6.2f}  {kind}")

    bucket = 20.0
    busy = [0.0] * (int((end - start) // bucket) + 1)
    for r in tests:
        a, b = r["start"] - start, r["end"] - start
        for i in range(int(a // bucket), int(b // bucket) + 1):
            overlap = min(b, (i + 1) * bucket) - max(a, i * bucket)
            busy[i] += r["cpu"] * max(overlap, 0.0) / max(b - a, 1e-9)
    print(f"\ncores busy, each {bucket:.0f} s of the run (1.0 = one core):")
    print(" ".join(f"{b / bucket:.1f}" for b in busy))


if __name__ == "__main__":
    main()
