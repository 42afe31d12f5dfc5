"""Describing the machine and formatting results as Markdown tables (no measuring here)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path


def _field(path: str, key: str, separator: str) -> str:
    """The value of the first `key<separator>value` line of a text file, or 'unknown'."""
    try:
        with open(path) as lines:
            for line in lines:
                name, sep, value = line.partition(separator)
                if sep and name.strip() == key:
                    return value.strip().strip('"')
    except OSError:
        pass
    return "unknown"


def machine_description() -> list[tuple[str, str]]:
    """(what, value) pairs: CPU, cores, RAM, OS, versions, load, date."""
    import jax
    import jaxlib
    import numpy
    import zmq

    mem_kb = _field("/proc/meminfo", "MemTotal", ":").split()[0]
    ram = f"{int(mem_kb) / 2**20:.1f} GiB" if mem_kb.isdigit() else "unknown"
    os_name = _field("/etc/os-release", "PRETTY_NAME", "=")
    return [
        ("CPU", _field("/proc/cpuinfo", "model name", ":")),
        ("cores", f"{os.cpu_count()} (usable by this process: {len(os.sched_getaffinity(0))})"),
        ("RAM", ram),
        ("OS", f"{os_name}, kernel {platform.release()} ({platform.machine()})"),
        ("python", platform.python_version()),
        (
            "jax / jaxlib",
            f"{jax.__version__} / {jaxlib.__version__} (backend {jax.default_backend()})",
        ),
        ("pyzmq / libzmq", f"{zmq.__version__} / {zmq.zmq_version()}"),
        ("numpy", numpy.__version__),
        ("load average at start (1, 5, 15 min)", load_average()),
        ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")),
    ]


def load_average() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def code_revision(repo: Path) -> str:
    """`git describe --always --dirty`, and how many files of the package differ from it."""
    try:
        described = subprocess.run(
            ["git", "-C", str(repo), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()  # fmt: skip
        changed = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--", "tapd", "client"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.splitlines()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout?)"
    if changed:
        return f"{described} ({len(changed)} files under tapd/ and client/ changed or new)"
    return described


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def with_spread(values: Sequence[float], scale: float = 1.0, digits: int = 2) -> str:
    """`median (min-max)` of `values` * `scale`, for columns where the noise matters."""
    low, mid, high = min(values) * scale, median(values) * scale, max(values) * scale
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def number(value: float, digits: int = 2) -> str:
    """A compact number: thousands separators for big ones, `digits` decimals for small."""
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def size_name(size: int) -> str:
    """Bytes as `64 B`, `64 KiB`, `1 MiB`."""
    for unit, factor in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= factor:
            return f"{size // factor} {unit}"
    return f"{size} B"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table whose columns are padded to line up in a terminal too."""
    cells = [list(header), *[list(row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def publish(text: str, output: Path | None) -> None:
    """Print a report, and write it to `output` where one is given."""
    print("\n" + text)
    if output is not None:
        output.write_text(text)
        print(f"wrote {output}")
