"""Describing the machine and formatting results as Markdown tables (no measuring here);
and the accelerator suites' pages, from what their measuring processes wrote: the GPU's
(bench/gpu-check, through `gpu_bench.py report`) and the TPU's (bench/tpu.py).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20


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


def bytes_of(name: str) -> int:
    """A size's name ("64B", "1KiB", "4MiB") in bytes."""
    for suffix, unit in (("KiB", 2**10), ("MiB", 2**20), ("B", 1)):
        if name.endswith(suffix):
            return int(name[: -len(suffix)]) * unit
    raise ValueError(f"a size is 64B, 1KiB or 4MiB, not {name!r}")


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


# ---- the GPU's page (bench/gpu-check: `gpu_bench.py report`) --------------------------


# The sections' result files, in the order the report looks for the environment in.
GPU_SECTIONS = ("cost-64", "cost-1MiB", "cost-64MiB", "isolation", "throughput", "graphs-on")


def _environment(results: Path) -> dict[str, Any] | None:
    """The machine and tapd's state, as the first section that finished saw them."""
    for name in GPU_SECTIONS:
        found = _load(results, name)
        if found is not None and "environment" in found:
            environment: dict[str, Any] = found["environment"]
            return environment
    return None


def _load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return loaded


def _costs(results: Path) -> dict[str, Any]:
    """The cost sections' rows together (one section per size, so that one that hangs
    leaves the others), with the first one's modes; errors kept by label."""
    merged: dict[str, Any] = {"rows": [], "modes": None, "errors": {}, "bare_copy_error": None}
    for path in sorted(results.glob("cost*.json")):
        found = _load(results, path.stem) or {}
        merged["rows"] += found.get("rows", [])
        merged["modes"] = merged["modes"] or found.get("modes")
        merged["bare_copy_error"] = merged["bare_copy_error"] or found.get("bare_copy_error")
        if "error" in found:
            merged["errors"][path.stem] = found["error"]
    merged["rows"].sort(key=lambda row: row["bytes"])
    return merged


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b is not None and b > 0 else None


def gpu_figures(results: Path) -> dict[str, Any]:
    """The targets of issue 17 as ratios (None where not measured), and where from."""
    cost = _costs(results)
    rows = {row["bytes"]: row["added_us"] for row in cost.get("rows", [])}

    def added(size: int, mode: str) -> float | None:
        value = rows.get(size, {}).get(mode)
        return float(value) if value is not None else None

    iso = _load(results, "isolation") or {}
    gpu = {r["bytes"]: r for r in (_load(results, "throughput") or {}).get("rows", [])}
    cpu = {r["bytes"]: r for r in (_load(results, "throughput-cpu") or {}).get("rows", [])}
    environment = _environment(results) or {}
    return {
        "tap_64B_per_bare_copy": _ratio(added(64, "tap"), added(64, "bare copy")),
        "tap_1MiB_per_bare_copy": _ratio(added(MiB, "tap"), added(MiB, "bare copy")),
        "tap_64MiB_per_bare_copy": _ratio(added(64 * MiB, "tap"), added(64 * MiB, "bare copy")),
        "portable_64B_per_callback": _ratio(added(64, "portable tap"), added(64, "callback")),
        # issue 21: a dormant tap enqueues no transfer (µs per step, not a ratio)
        "dormant_1MiB_added_us": added(MiB, "dormant tap"),
        "isolation_tapped_per_untapped": iso.get("vs_untapped"),
        "throughput_1MiB_gpu_per_cpu": _ratio(
            gpu.get(MiB, {}).get("mb_per_s"), cpu.get(MiB, {}).get("mb_per_s")
        ),
        "revision": environment.get("revision") or code_revision(REPO),
        "machine": environment.get("machine", "unknown"),
    }


GPU_TARGETS = {
    "tap_64B_per_bare_copy": ("≤", 1.2), "tap_1MiB_per_bare_copy": ("≤", 1.2),
    "tap_64MiB_per_bare_copy": ("≤", 1.2), "portable_64B_per_callback": ("≤", 0.3),
    "isolation_tapped_per_untapped": ("≤", 1.1), "throughput_1MiB_gpu_per_cpu": ("≥", 0.8),
    "dormant_1MiB_added_us": ("≤", 1.0),
}  # fmt: skip


def gpu_page(results: Path, md: Path, out_json: Path, log_name: str | None) -> None:
    """bench/RESULTS-gpu.md and its JSON, from the JSON gpu-check's sections wrote."""
    found = gpu_figures(results)
    out_json.write_text(json.dumps(found, indent=1) + "\n")
    lines = ["# tapd on a GPU", "",
             "Written by `.venv/bin/python -m bench gpu` (`bench/gpu-check`, then "
             "`bench/gpu_bench.py report`) from one run; raw log: "
             f"`{log_name or 'bench/gpu-logs/'}`. Ratios compare figures of this run only; "
             "`bench/RESULTS-gpu.json` has the same ratios.", ""]  # fmt: skip
    target_rows = []
    for key, (sense, goal) in GPU_TARGETS.items():
        value = found[key]
        met = (
            "not measured"
            if value is None
            else ("met" if (value <= goal if sense == "≤" else value >= goal) else "missed")
        )
        target_rows.append(
            [key, "n/a" if value is None else f"{value:.3f}", f"{sense} {goal}", met]
        )
    if any((found_ := _load(results, n)) and found_.get("smoke") for n in ("cost-64", "isolation")):
        lines += ["**A smoke run on a CPU (`--smoke`): it checks the script; its figures "
                  "mean nothing.**", ""]  # fmt: skip
    lines += [table(["figure", "value", "goal", ""], target_rows), ""]
    environment = _environment(results)
    if environment:
        lines += [table(["what", "value"], [[k, str(v)] for k, v in environment["rows"]]), ""]
    lines += _baseline_section(results) + _tests_section(results) + _cost_section(results)
    lines += _isolation_section(results) + _throughput_section(results)
    lines += _graphs_section(results)
    md.write_text("\n".join(lines) + "\n")
    print(f"[{time.strftime('%H:%M:%S')}] wrote {md} and {out_json}", flush=True)


def _failed(name: str, found: dict[str, Any] | None) -> list[str]:
    if found is None:
        return ["Not measured: the step did not finish (see the raw log).", ""]
    if "error" in found:
        return ["The step failed:", "", "```", found["error"].strip()[-3000:], "```", ""]
    return []


def _baseline_section(results: Path) -> list[str]:
    lines = ["## 1. Commit variants without JAX (bench/gpu_baseline.cc)", "",
             "A 1 MiB memset, a 64 B copy into mapped pinned memory, then the commit, per "
             "iteration.", ""]  # fmt: skip
    found = _load(results, "baseline")
    if found is None or not found.get("variants"):
        return [*lines, *(_failed("baseline", found) or ["No figures.", ""])]
    rows = [[v["variant"], str(v["iterations"]), number(v["gpu_us_per_iter"]),
             number(v["wall_us_per_iter"]), str(v["commits_seen"]), str(v["out_of_order"]),
             str(v["data_after_flag"]), v.get("note", "")] for v in found["variants"]]  # fmt: skip
    return [*lines, table(["commit", "iterations", "GPU µs/iter", "wall µs/iter", "seen",
                           "out of order", "data after flag", "note"], rows), ""]  # fmt: skip


def _tests_section(results: Path) -> list[str]:
    found = _load(results, "tests") or {}
    return ["## 2. tests/gpu", "", f"{found.get('summary', 'not run')}", ""]


def _cost_section(results: Path) -> list[str]:
    found = _costs(results)
    lines = ["## 3. Per-tap cost", ""]
    for label, error in found["errors"].items():
        lines += [f"`{label}` failed:", "", "```", error.strip()[-3000:], "```", ""]
    if not found["rows"]:
        return [*lines, "Not measured: no cost section finished (see the raw log).", ""]
    if found.get("bare_copy_error"):
        lines += [f"The bare copy could not be built: `{found['bare_copy_error']}`", ""]
    return [
        *lines,
        "Added µs per step over the untapped loop; sizes not listed did not "
        "finish (see the raw log).",
        "",
        cost_table(found["rows"], found["modes"]),
        "",
    ]


def _isolation_section(results: Path) -> list[str]:
    iso = _load(results, "isolation")
    lines = ["## 4. Isolation (a subscriber sleeping 10 ms per tap)", ""]
    if iso is None or "vs_untapped" not in iso:
        return [*lines, *_failed("isolation", iso)]
    return [*lines, table(
        ["steps", "untapped µs/step", "tapped µs/step", "callback µs/step",
         "tapped ÷ untapped (goal ≤ 1.1)", "tapped ÷ callback", "barrier after (s)", "handled"],
        [[str(iso["steps"]), number(iso["untapped_us"]), number(iso["tapped_us"]),
          number(iso["callback_us"]), f"{iso['vs_untapped']:.3f}", f"{iso['vs_callback']:.3f}",
          f"{iso['barrier_s']:.2f}", str(iso["handled"])]],
    ), ""]  # fmt: skip


def _throughput_section(results: Path) -> list[str]:
    lines = ["## 5. Throughput to a subscriber (GPU, and this machine's CPU)", ""]
    rows = []
    for label, name in (("GPU", "throughput"), ("CPU", "throughput-cpu")):
        found = _load(results, name)
        if found is None or "rows" not in found:
            lines += [f"{label}:", "", *_failed(name, found)]
            continue
        rows += [[label, size_name(r["bytes"]), str(r["count"]), number(r["taps_per_s"], 0),
                  number(r["mb_per_s"], 1), f"{r['handled']} / {r['expected']}"]
                 for r in found["rows"]]  # fmt: skip
    if rows:
        lines += [
            table(["on", "payload", "taps", "taps/s", "MB/s", "handled / expected"], rows),
            "",
        ]
    return lines


def _graphs_section(results: Path) -> list[str]:
    lines = ["## 6. Command buffers (CUDA graphs): six matmul+tanh steps a loop step", ""]
    rows = []
    for label in ("on", "off"):
        found = _load(results, f"graphs-{label}")
        if found is None or "us_per_step" not in found:
            lines += [f"Command buffers {label}:", "", *_failed(label, found)]
            continue
        us = found["us_per_step"]
        rows.append(
            [
                label,
                number(us["none"]),
                number(us["tap"]),
                number(us["callback"]),
                number(us["tap"] - us["none"]),
                number(us["callback"] - us["none"]),
            ]
        )
    if rows:
        header = ["command buffers", "untapped µs/step", "tapped µs/step", "callback µs/step",
                  "tap adds µs", "callback adds µs"]  # fmt: skip
        lines += [table(header, rows), ""]
    return lines


def cost_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    header = ["payload", "steps", "untapped µs/step",
              *[f"{mode} adds µs" for mode in modes]]  # fmt: skip
    ratios = [(a, b, title) for a, b, title in (
        ("tap", "callback", "tap ÷ callback"),
        ("tap", "bare copy", "tap ÷ bare copy (goal ≤ 1.2)"),
        ("portable tap", "callback", "portable ÷ callback (goal ≤ 0.3 at 64 B)"),
    ) if a in modes and b in modes]  # fmt: skip
    header += [title for _, _, title in ratios]
    lines = []
    for row in rows:
        added = row["added_us"]
        line = [size_name(row["bytes"]), str(row["steps"]), number(row["untapped_us"]),
                *[number(added[mode]) for mode in modes]]  # fmt: skip
        for a, b, _ in ratios:
            line.append(f"{added[a] / added[b]:.2f}" if added[b] > 0 else "n/a")
        lines.append(line)
    return table(header, lines)


# ---- the TPU's page (bench/tpu.py) -----------------------------------------------------------


def _added(us: dict[str, float], prefix: str, kind: str) -> float:
    return us[f"{prefix} {kind}"] - us[f"{prefix} none"]


def tpu_page(
    results: dict[str, dict[str, Any]], delivered: dict[str, int], quick: bool, steps: int
) -> str:
    """bench/tpu.py's report (section tpu), from its children's results."""
    first = next(iter(results.values()))
    lines = [
        "# What a tap costs on a TPU (bench/tpu.py)",
        "",
        f"Machine: {first['device']}, JAX {first['jax']}, Python {platform.python_version()}, "
        f"host {platform.machine()} ({os.cpu_count()} CPUs). {'Quick run. ' if quick else ''}"
        f"Loops: {steps} steps a call, µs a step; calls: µs a call; medians of interleaved "
        "rounds, each setting in one process of its own. In brackets: the host callbacks "
        "of tapd's that one call runs (tapd.stats()).",
        "",
        "| variant | " + " | ".join(f"TAPD_GATHER={g}" for g in results) + " |",
        "|---|" + "---|" * len(results),
    ]
    for name in first["us"]:
        cells = " | ".join(
            f"{r['us'][name]:.1f} ({r.get('callbacks', {}).get(name, '-')})"
            for r in results.values()
        )
        lines.append(f"| {name} | {cells} |")

    lines += ["", "Ratios (added cost over the untapped variant, each within its own process):", ""]
    lines.append("| figure | " + " | ".join(f"TAPD_GATHER={g}" for g in results) + " | target |")
    lines.append("|---|" + "---|" * (len(results) + 1))
    figures = [
        ("loop, 64 B: tapd.tap ÷ jax.debug.callback", "loop64", "tap", "jax", "≤ 0.02"),
        ("loop, dormant 64 B ÷ jax.debug.callback", "loop64", "dormant", "jax", "≤ 0.005"),
        ("loop, 1 MiB: tapd.tap ÷ scan outputs", "loop1M", "tap", "outputs", "≤ 1.5"),
        ("loop, tapd.debug.callback ÷ jax.debug.callback", "loop64", "tapd.debug", "jax", "≤ 0.02"),
        ("while, 64 B: tapd.tap ÷ jax.debug.callback", "while64", "tap", "jax", "(≤ 0.02)"),
        ("shard_map loop, 64 B: tapd.tap ÷ jax.debug.callback", "smap64", "tap", "jax", "≤ 0.02"),
        ("shard_map loop, dormant ÷ jax.debug.callback", "smap64", "dormant", "jax", "≤ 0.005"),
        ("shard_map loop, id_tap ÷ jax.debug.callback", "smap64", "id_tap", "jax", ""),
        ("pmap loop, 64 B: tapd.tap ÷ jax.debug.callback", "pmap64", "tap", "jax", "≤ 0.02"),
        ("pmap loop, dormant ÷ jax.debug.callback", "pmap64", "dormant", "jax", "≤ 0.005"),
        ("pmap loop, id_tap ÷ jax.debug.callback", "pmap64", "id_tap", "jax", ""),
        (
            "shard_map a step, 64 B: tapd.tap ÷ jax.debug.callback",
            "smaploop64",
            "tap",
            "jax",
            "≤ 0.02",
        ),
        (
            "shard_map a step, dormant ÷ jax.debug.callback",
            "smaploop64",
            "dormant",
            "jax",
            "≤ 0.005",
        ),
        ("call: tapd.tap ÷ jax.debug.callback", "call", "tap", "jax", "≤ 0.25"),
        ("call: id_tap closure ÷ jax.debug.callback", "call", "id_tap", "jax", "≤ 0.25"),
        ("call: dormant ÷ jax.debug.callback", "call", "dormant", "jax", ""),
        ("call: an untaken callback ÷ jax.debug.callback", "call", "untaken", "jax", ""),
    ]
    for text, prefix, kind, against, target in figures:
        cells = " | ".join(
            f"{_added(r['us'], prefix, kind) / _added(r['us'], prefix, against):.4f}"
            for r in results.values()
        )
        lines.append(f"| {text} | {cells} | {target} |")
    made = {g: r["made"] for g, r in results.items()}
    lines += ["", f"Woken taps made: {made}; the subscriber received: {delivered}.", ""]
    return "\n".join(lines)


def tpu_live_page(result: dict[str, Any], delivered: int, quick: bool) -> str:
    """`bench/tpu.py live`'s report (section tpu-live), from its child's result."""
    us = result["us_a_call"]
    lines = [
        "# Big taps and long loops on a TPU (bench/tpu.py live)",
        "",
        f"Machine: {result['device']}, JAX {result['jax']}, host {platform.machine()}, "
        f"Python {platform.python_version()}{' (quick)' if quick else ''}, "
        f"TAPD_GATHER_BYTES {result.get('gather_bytes')}.",
        "",
        "## Big taps: µs a step added over the untapped loop, ÷ the floor's added",
        "",
        "| cell | untapped | tap | dormant | floor | tap ÷ floor | dormant ÷ floor |",
        "|---|---|---|---|---|---|---|",
    ]
    cells = sorted({name.rsplit(" ", 1)[0] for name in us}, key=_cell_order)
    for cell in cells:
        if f"{cell} tap" not in us:
            continue
        steps = int(cell.split(" x")[1])
        a_step = {k: us[f"{cell} {k}"] / steps for k in ("none", "tap", "dormant", "floor")}
        floor = a_step["floor"] - a_step["none"]
        tap, dormant = a_step["tap"] - a_step["none"], a_step["dormant"] - a_step["none"]
        lines.append(
            f"| {cell} | {a_step['none']:.2f} | {a_step['tap']:.2f} | {a_step['dormant']:.2f} "
            f"| {a_step['floor']:.2f} | {tap / floor:.2f} | {dormant / floor:.3f} |"
        )
    sampled = [name for name in us if name.endswith(" every100")]
    for name in sampled:
        cell = name.rsplit(" ", 1)[0]
        added = us[name] - us[f"{cell} none"]
        floor = us[f"{cell} floor10"]
        lines += [
            "",
            f"`every=100`, {cell}: {added:.0f} µs a call added; the floor of the 10 taps "
            f"kept (a 10-step `scan`'s outputs fetched): {floor:.0f} µs; ratio "
            f"{added / floor:.2f}.",
        ]
    lines += [
        "",
        "## Long loops: when taps arrive (seconds; the second call of each)",
        "",
        "| loop | form | call | taps | first | largest gap |",
        "|---|---|---|---|---|---|",
    ]
    for name, entry in result["live"].items():
        label, kind = name.split(" ")
        call = entry["calls"][-1]
        first = "-" if call["first"] is None else f"{call['first']:.3f}"
        gap = "-" if call["largest_gap"] is None else f"{call['largest_gap']:.3f}"
        lines.append(
            f"| {entry['steps']} steps of {label} | {kind} | {call['seconds']:.3f} | "
            f"{call['taps']} | {first} | {gap} |"
        )
    live = result["live"]
    if "1.4ms tap" in live and "1.4ms jax" in live:
        base = live["1.4ms none"]["calls"][-1]["seconds"]
        tap = live["1.4ms tap"]["calls"][-1]["seconds"] - base
        jax_added = live["1.4ms jax"]["calls"][-1]["seconds"] - base
        lines += [
            "",
            f"The 1.4 ms loop's added cost ÷ `jax.debug.callback`'s: {tap / jax_added:.3f}.",
        ]
    lines += [
        "",
        f"Woken taps made: {result['made']['big']}; the subscriber received: {delivered}.",
        f"Dormant calls served by twins in the timed rounds: {result.get('twin_calls', 0)} "
        "(tapd/emitter/dormant_twin.py; each dormant step called until its twin serves it "
        "first, where one comes).",
        "",
    ]
    return "\n".join(lines)


def _cell_order(cell: str) -> tuple[int, int]:
    size, steps = cell.split(" x")
    return bytes_of(size), int(steps)
