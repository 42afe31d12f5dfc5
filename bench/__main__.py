"""tapd's benchmarks, one way in: `python -m bench SUITE`, from the repository's root.

    .venv/bin/python -m bench cpu              # every CPU section, into bench/RESULTS.md
    .venv/bin/python -m bench cpu --only shm   # one section of it
    .venv/bin/python -m bench cpu --quick      # a smoke run: small counts, printed, no page
    .venv/bin/python -m bench --list           # the suites, their sections and commands

Suites, and the page each writes its sections of (one page a platform):

    cpu      bench/RESULTS.md      the step, throughput, latency, per-tap and per-call cost,
                                   multi-host, shared memory, dormant taps, tapd.debug, ...
    fan-in   bench/RESULTS.md      what one upstream daemon takes from many forwarders
    slices   bench/RESULTS.md      taps over several devices (forced CPU devices)
    tpu      bench/RESULTS-tpu.md  on a TPU host: per step, per call, big taps, long loops
    gpu      bench/RESULTS-gpu.md  on an NVIDIA GPU host: bench/gpu-check, the whole page

Each section is one script of bench/ (a script that makes several sections takes the one
to make as its first argument: `per_call.py coalesce`), run in a process of its own (they
start their own daemons, subscribers and JAX processes) with its report written to a
scratch file. Its
report then replaces what stands between the section's two markers on its page,
`<!-- bench:NAME -->` and `<!-- /bench:NAME -->`, under the command that made it; what a
page holds outside the markers (notes, earlier runs kept for their history) stays. A
section that fails leaves its page's section as it was, and the run's exit status says
so. Sections marked "on demand" run only when named with `--only`, with their own
arguments after `--` (the A/B comparison of two tapd revisions needs `--before DIR`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
ENTRY = ".venv/bin/python -m bench"
PAGES = {
    "cpu": "RESULTS.md",
    "fan-in": "RESULTS.md",
    "slices": "RESULTS.md",
    "tpu": "RESULTS-tpu.md",
    "gpu": "RESULTS-gpu.md",
}
TIMEOUT_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Section:
    """One script's report, as one section of its suite's page."""

    name: str  # `--only NAME`, and the page's markers
    suite: str
    title: str  # its heading on the page; "" where the report brings its own "## " headings
    script: str  # a file of bench/
    full: tuple[str, ...] = ()  # its arguments for a full run
    quick: tuple[str, ...] = ("--quick",)  # for `--quick`
    output_flag: str | None = "--output"  # None: the script writes its page itself
    on_demand: bool = False

    def command(self) -> str:
        return f"{ENTRY} {self.suite} --only {self.name}"

    def script_command(self, quick: bool) -> str:
        runner = "python " if self.script.endswith(".py") else ""
        return " ".join([f"{runner}bench/{self.script}", *(self.quick if quick else self.full)])


SECTIONS = (
    Section("core", "cpu", "", "run.py", quick=("--quick",)),
    Section(
        "shm",
        "cpu",
        "6. Same-host subscribers: shared memory vs the socket vs raw pyzmq (1 MiB taps)",
        "durability.py",
        full=("shm", "--count", "1000", "--rounds", "5"),
        quick=("shm", "--count", "100", "--rounds", "1"),
    ),
    Section(
        "fan-in",
        "fan-in",
        "7. Fan-in: what one upstream daemon takes from 4 and 32 forwarders, and churn",
        "fanin.py",
        full=("--churn-seconds", "60"),
    ),
    Section(
        "dormant",
        "cpu",
        "8. Dormant and sampled taps: the cost of a tap nobody takes",
        "dormant.py",
    ),
    Section(
        "per-call",
        "cpu",
        "9. Per-call cost: one jitted step per Python step, tapped or not",
        "per_call.py",
    ),
    Section("debug", "cpu", "10. tapd.debug.callback against jax.debug.callback", "debug_cost.py"),
    Section(
        "coalesce",
        "cpu",
        "11. The daemon's coalescing wait, at a few thousand taps a second",
        "per_call.py",
        full=("coalesce",),
        quick=("coalesce", "--quick"),
    ),
    Section(
        "exported",
        "cpu",
        "12. Exported and cached tapped computations (issue 34)",
        "per_call.py",
        full=("exported",),
        quick=("exported", "--quick"),
    ),
    Section(
        "slices",
        "slices",
        "13. Taps over several devices: per tap against gathered (issue 50)",
        "multihost.py",
        full=("slices",),
        quick=("slices", "--devices", "4"),
        output_flag="--out",
    ),
    Section(
        "attach",
        "cpu",
        "14. Attach latency: a subscriber joining a running job whose tap site is dormant",
        "dormant.py",
        full=("attach",),
        quick=("attach", "--quick"),
    ),
    Section(
        "record",
        "cpu",
        "15. tapd record: throughput beside the plain subscriber",
        "durability.py",
        full=("record",),
        quick=("record", "--quick"),
    ),
    Section(
        "spool",
        "cpu",
        "16. The spool policy: step time and throughput with a slow subscriber",
        "durability.py",
        full=("spool",),
        quick=("spool", "--quick"),
    ),
    Section(
        "throughput-ab",
        "cpu",
        "17. Socket-path throughput at two tapd revisions, alternating",
        "throughput.py",
        quick=("--rounds", "1"),
        on_demand=True,
    ),
    Section("tpu", "tpu", "", "tpu.py", output_flag="--out"),
    Section("tpu-live", "tpu", "", "tpu.py", ("live",), ("live", "--quick"), output_flag="--out"),
    Section("gpu", "gpu", "", "gpu-check", output_flag=None),
)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def splice(page: str, name: str, body: str) -> str:
    """`page` with what stands between section `name`'s markers replaced by `body`."""
    begin, end = markers(name)
    if page.count(begin) != 1 or page.count(end) != 1:
        raise ValueError(f"the page needs {begin} and {end} once each")
    head, rest = page.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.strip()}\n{end}{tail}"


def section_body(section: Section, report: str, quick: bool) -> str:
    """The section as its page shows it: its heading, the command that made it, the
    report without its own title and "Reproduce" lines (the command says it), its
    headings moved below the section's where the section has one."""
    lines = report.strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    kept: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith("## "):
            skipping = line.strip() == "## Reproduce"
        if not skipping and not line.startswith("Reproduce: `"):
            kept.append(line)
    if section.title:
        kept = ["##" + line if line.startswith("#") else line for line in kept]
    command = f"`{section.command()}{' --quick' if quick else ''}`"
    ran = f" (`{section.script_command(quick)}`)"
    head = [f"## {section.title}", ""] if section.title else []
    return "\n".join([*head, command + ran, "", "\n".join(kept).strip()])


def run_section(section: Section, quick: bool, extra: list[str]) -> str | None:
    """Run the section's script; its report, or None where it failed (said on stderr)."""
    script = BENCH_DIR / section.script
    prefix = [sys.executable] if section.script.endswith(".py") else []
    argv = [*prefix, str(script), *(section.quick if quick else section.full), *extra]
    print(f"== {section.suite} / {section.name}: {' '.join(argv[len(prefix) :])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tapd-bench-") as scratch:
        report = Path(scratch) / "report.md"
        if section.output_flag is not None:
            argv += [section.output_flag, str(report)]
        try:
            done = subprocess.run(argv, cwd=ROOT, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            print(f"== {section.name}: timed out after {TIMEOUT_S:.0f} s", file=sys.stderr)
            return None
        if done.returncode != 0:
            print(f"== {section.name}: exit status {done.returncode}", file=sys.stderr)
            return None
        if section.output_flag is None:
            return ""  # the script wrote its page itself
        if not report.exists():
            print(f"== {section.name}: wrote no report", file=sys.stderr)
            return None
        return report.read_text()


def chosen(suite: str, only: list[str]) -> list[Section]:
    sections = [s for s in SECTIONS if s.suite == suite]
    if not only:
        return [s for s in sections if not s.on_demand]
    names = {s.name for s in sections}
    unknown = sorted(set(only) - names)
    if unknown:
        raise SystemExit(f"suite {suite} has no section {unknown}; it has {sorted(names)}")
    return [s for s in sections if s.name in only]


def list_suites() -> None:
    for suite, page in PAGES.items():
        print(f"{suite}  (bench/{page})")
        for s in SECTIONS:
            if s.suite == suite:
                when = "  [on demand]" if s.on_demand else ""
                print(f"  {s.name:<14} {s.command()}  ->  {s.script_command(False)}{when}")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in args_in:
        at = args_in.index("--")
        args_in, extra = args_in[:at], args_in[at + 1 :]
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("suite", nargs="?", choices=sorted(PAGES))
    parser.add_argument("--only", action="append", default=[], metavar="SECTION",
                        help="run this section only (repeatable); --list names them")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: small counts; prints, writes no page")  # fmt: skip
    parser.add_argument("--page", type=Path,
                        help="write into this page instead of the suite's bench/ page")  # fmt: skip
    parser.add_argument("--list", action="store_true", help="the suites and their sections")
    args = parser.parse_args(args_in)
    if args.list or args.suite is None:
        list_suites()
        return 0
    sections = chosen(args.suite, args.only)
    page = args.page or BENCH_DIR / PAGES[args.suite]
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    failed = []
    for section in sections:
        report = run_section(section, args.quick, extra)
        if report is None:
            failed.append(section.name)
            continue
        if section.output_flag is None:
            continue
        body = section_body(section, report, args.quick)
        if args.quick and args.page is None:
            print("\n" + body + "\n")
            continue
        page.write_text(splice(page.read_text(), section.name, body))
        print(f"== {section.name}: written into {page}", flush=True)
    if failed:
        print(f"sections that failed (their page sections unchanged): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
