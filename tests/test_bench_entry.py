"""bench/ has one way in, `python -m bench SUITE` (bench/__main__.py): every script there is
a section of a suite or a helper that a section runs, and a section's report goes between
its markers on its platform's page, under the command that made it, the page's other
text kept. (The benchmarks themselves run in `python -m bench`, never in the suite:
speed is not a test.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# What the sections run besides themselves: imported, or started as processes of their own.
HELPERS = {
    "processes.py": "the child processes: a daemon, subscriber sinks, fan-in's ring writer "
    "and counter, their cleanup",
    "report.py": "the machine's description, Markdown tables, the GPU's and the TPU's pages",
    "throughput.py": "run.py's section 2, its pyzmq and multiprocessing.Queue baselines "
    "(and section throughput-ab)",
    "dormant.py": "run.py's section 4, one process a backend (and sections dormant, attach)",
    "multihost.py": "run.py's section 5, and the job's processes (and section slices)",
    "gpu_bench.py": "gpu-check's sections and its report",
    "gpu_baseline.cc": "gpu-check's C++ microbenchmark, and gpu_bench.py's bare-copy handler",
}
MOST_FILES = 15  # at bench/'s top, besides its pages (issue 64)
MOST_LINES = 600  # a module stays under it, as tapd's do (tests/test_layering.py)


def entry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_entry", BENCH / "__main__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_entry"] = module  # dataclasses looks its module up
    spec.loader.exec_module(module)
    return module


def test_every_script_in_bench_is_a_section_or_a_helper_a_section_runs() -> None:
    bench = entry()
    scripts = {s.script for s in bench.SECTIONS}
    assert {s.suite for s in bench.SECTIONS} == set(bench.PAGES) == {
        "cpu", "tpu", "slices", "fan-in", "gpu",
    }  # fmt: skip
    on_disk = {p.name for p in BENCH.iterdir() if p.is_file() and not p.name.endswith(".md")}
    assert on_disk == scripts | set(HELPERS) | {"__main__.py"}, "a script no suite runs"
    for helper in HELPERS:
        name = helper.removesuffix(".py")
        users = [
            p.name for p in BENCH.iterdir()
            if p.is_file() and p.name != helper and re.search(rf"\b{re.escape(name)}\b",
                                                              p.read_text(errors="replace"))
        ]  # fmt: skip
        assert users, f"{helper} is named by no other script of bench/"


def test_bench_stays_small_enough_to_read() -> None:
    """At most 15 files beside the pages, and every module under 600 lines (issue 64):
    what several scripts share lives in the helpers, not in files of its own."""
    files = [p for p in BENCH.iterdir() if p.is_file() and not p.name.endswith(".md")]
    assert len(files) <= MOST_FILES, sorted(p.name for p in files)
    long = {p.name: n for p in files if p.suffix == ".py"
            if (n := len(p.read_text().splitlines())) >= MOST_LINES}  # fmt: skip
    assert not long, f"modules of {MOST_LINES} lines or more: {long}"


def test_each_suite_writes_one_page_a_platform() -> None:
    bench = entry()
    pages = {p.name for p in BENCH.glob("*.md")}
    assert set(bench.PAGES.values()) == pages == {"RESULTS.md", "RESULTS-tpu.md", "RESULTS-gpu.md"}


def test_every_section_stands_on_its_page_under_the_command_that_makes_it() -> None:
    """So every figure of a results page can be made again from the one way in."""
    bench = entry()
    for section in bench.SECTIONS:
        if section.output_flag is None:  # gpu-check writes its whole page
            continue
        page = (BENCH / bench.PAGES[section.suite]).read_text()
        begin, end = bench.markers(section.name)
        assert page.count(begin) == 1 and page.count(end) == 1, section.name
        inside = page.split(begin, 1)[1].split(end, 1)[0]
        assert f"`{section.command()}" in inside[:600], f"{section.name}: no command at its head"


def test_a_sections_report_replaces_only_what_stands_between_its_markers() -> None:
    bench = entry()
    page = "notes before\n<!-- bench:shm -->\nold figures\n<!-- /bench:shm -->\nnotes after\n"
    section = next(s for s in bench.SECTIONS if s.name == "shm")
    report = "# Same-host subscribers\n\n## Reproduce\n\n```\nx\n```\n\n## Figures\n\n| a |\n"
    body = bench.section_body(section, report, quick=False)
    spliced = bench.splice(page, "shm", body)
    assert spliced.startswith("notes before\n<!-- bench:shm -->\n## 6. Same-host")
    assert spliced.endswith("<!-- /bench:shm -->\nnotes after\n")
    assert "`.venv/bin/python -m bench cpu --only shm`" in spliced
    assert "old figures" not in spliced and "Reproduce" not in spliced
    assert "#### Figures" in spliced  # below the section's own heading
    with pytest.raises(ValueError):
        bench.splice("no markers here", "shm", body)
