"""The benchmarks that run in processes of their own, as sections of bench/run.py's report.

shm.py (same-host subscribers reading the ring), fanin.py (one upstream taking many
forwarding daemons), dormant.py (what a tap costs when nobody listens), per_call.py
(what a tap costs per call of a jitted step), debug_cost.py (tapd.debug against
jax.debug) and coalesce.py (the daemon's coalescing wait) each start
their own daemons and JAX processes. run.py runs them one after the other, after its own
sections, so that RESULTS.md holds every figure of one run; each one's Markdown report
is taken in whole, its headings moved below the section's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from processes import BENCH_DIR

# (section title, script, its arguments for a full run, for --quick)
COMPANIONS = (
    (
        "6. Same-host subscribers: shared memory vs the socket vs raw pyzmq (1 MiB taps)",
        "shm.py",
        ["--count", "1000", "--rounds", "5"],
        ["--count", "100", "--rounds", "1"],
    ),
    (
        "7. Fan-in: what one upstream daemon takes from 4 and 32 forwarders, and churn",
        "fanin.py",
        ["--churn-seconds", "60"],
        ["--quick"],
    ),
    (
        "8. Dormant and sampled taps: the cost of a tap nobody takes",
        "dormant.py",
        [],
        ["--quick"],
    ),
    (
        "9. Per-call cost: one jitted step per Python step, tapped or not",
        "per_call.py",
        [],
        ["--quick"],
    ),
    (
        "10. tapd.debug.callback against jax.debug.callback",
        "debug_cost.py",
        [],
        ["--quick"],
    ),
    (
        "11. The daemon's coalescing wait, at a few thousand taps a second",
        "coalesce.py",
        [],
        ["--quick"],
    ),
)
TIMEOUT_S = 900.0


def run_companions(quick: bool) -> list[tuple[str, str]]:
    """Each companion's report as (title, Markdown), or what went wrong, in its place."""
    sections = []
    for title, script, full, short in COMPANIONS:
        print(title.split(":")[0], flush=True)
        with tempfile.TemporaryDirectory(prefix="tapdc-") as scratch:
            report = Path(scratch) / "report.md"
            command = [sys.executable, str(BENCH_DIR / script), *(short if quick else full)]
            try:
                done = subprocess.run(
                    [*command, "--output", str(report)],
                    capture_output=True,
                    text=True,
                    timeout=TIMEOUT_S,
                    check=False,
                )
                failed = None if done.returncode == 0 else done.stderr[-3000:]
            except subprocess.TimeoutExpired:
                failed = f"timed out after {TIMEOUT_S:.0f} s"
            shown = " ".join(["python", f"bench/{script}", *command[2:]])
            if failed is None and report.exists():
                body = f"`{shown}`\n\n" + _demoted(report.read_text())
            else:
                body = f"**Failed**, so no figures (`{shown}`):\n\n```\n{failed}\n```"
        sections.append((title, body))
    return sections


def _demoted(markdown: str) -> str:
    """The report without its title, its headings two levels down (under `## N.`)."""
    lines = markdown.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join("##" + line if line.startswith("#") else line for line in lines).strip()
