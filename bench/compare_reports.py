"""Compare the ratios of two bench/run.py reports, side by side (a change against a base).

    .venv/bin/python bench/compare_reports.py BASE.md HEAD.md [BASE2.md HEAD2.md ...]

Absolute figures move with the machine's load; the ratios a report takes within one run
(tapd ÷ pyzmq, tapped ÷ untapped, ...) move much less. This prints, for sections 1, 2
and 4, every such ratio column of every row: each base's value, each head's, and
head ÷ base of their medians. Give the reports in pairs run back to back.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

SECTIONS = ("1", "2", "4")
RATIO_COLUMN = re.compile(r"÷|vs untapped")
NUMBER = re.compile(r"^x?([0-9][0-9,]*\.?[0-9]*)")


def ratio_cells(report: str) -> dict[tuple[str, str, str], float]:
    """(section, row key, column) -> value, for the ratio columns of each table."""
    cells: dict[tuple[str, str, str], float] = {}
    section = None
    header: list[str] | None = None
    for line in report.splitlines():
        if line.startswith("## "):
            section = line[3:].split(".")[0]
            header = None
            continue
        if section not in SECTIONS or not line.startswith("|"):
            header = None if not line.startswith("|") else header
            continue
        row = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = row
            continue
        if set(line) <= set("|-: "):
            continue
        key = " ".join(row[:2])  # (the variant or backend, and its size or count)
        for cell, column in zip(row, header, strict=False):
            match = NUMBER.match(cell)
            if RATIO_COLUMN.search(column) and match:
                cells[(section, key, column)] = float(match.group(1).replace(",", ""))
    return cells


def main(paths: list[str]) -> None:
    if len(paths) < 2 or len(paths) % 2:
        sys.exit(__doc__)
    reports = [ratio_cells(Path(p).read_text()) for p in paths]
    bases, heads = reports[0::2], reports[1::2]
    print("| § | row | ratio | base | head | head ÷ base |")
    print("|---|---|---|---|---|---|")
    for cell in bases[0]:
        base = [r[cell] for r in bases if cell in r]
        head = [r[cell] for r in heads if cell in r]
        if not head:
            continue
        change = statistics.median(head) / statistics.median(base) if statistics.median(base) else 0
        shown = [" ".join(f"{v:g}" for v in values) for values in (base, head)]
        print(f"| {cell[0]} | {cell[1]} | {cell[2]} | {shown[0]} | {shown[1]} | {change:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
