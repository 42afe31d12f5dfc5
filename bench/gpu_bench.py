"""tapd on an NVIDIA GPU: per-tap cost, isolation, throughput. Writes bench/RESULTS-gpu.md.

    python bench/gpu_bench.py [--out bench/RESULTS-gpu.md] [--quick]

Run by bench/gpu-check (which installs jax[cuda12], builds tapd's CUDA handler and runs
tests/gpu first). This process is the JAX emitter, on the first GPU; it starts its own
daemon and subscriber sinks (bench/processes.py). Every figure is the median of
interleaved repeats.

1. Per-tap cost for 64 B, 1 MiB and 64 MiB: a jitted `fori_loop` whose body updates a
   float32 vector of that size on the GPU, untapped; with `tapd.tap` (the CUDA handler);
   with `tapd.tap` lowered as the portable backend (a host callback writing the ring,
   what a GPU without the handler gets); with a no-op `jax.debug.callback`; and with a
   bare `cudaMemcpyAsync` of the vector into pinned host memory (bench/gpu_baseline.cc,
   an FFI handler that does only that). The added µs per step is each one's cost.
   Goals: tapd ≤ 1.2 times the bare copy; portable ≤ 1.1 times the callback at 64 B.
2. Isolation: a ~0.5 ms step (eight 2048² matmuls) untapped, tapped into a subscriber
   that sleeps 10 ms a tap, and with a no-op `jax.debug.callback` in the tap's place.
   Goal: tapped ≤ 1.1 times the callback variant.
3. Throughput to a subscriber: taps/s and MB/s from the first tap to `barrier_wait()`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from processes import BENCH_DIR, Processes
from report import code_revision, machine_description, median, number, size_name, table

import tapd
from tapd.emitter import lifecycle
from tapd.emitter.settings import Backend
from tapd.native import build, library

MiB = 2**20
COST_STEPS = {64: 2000, MiB: 200, 64 * MiB: 8}  # bytes -> steps per timed run
THROUGHPUT_COUNTS = {64: 20000, MiB: 500, 64 * MiB: 16}
BASELINE_TARGET = "tapd_bench_bare_copy"
BARRIER_TIMEOUT = 600.0


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---- the bare-copy baseline -------------------------------------------------------------


def build_baseline(workdir: Path) -> ctypes.CDLL:
    """Compile bench/gpu_baseline.cc as tapd's CUDA handler is compiled, register it."""
    include = build.ffi_include_dir()
    cuda = build.cuda_runtime()
    if include is None or cuda is None:
        raise RuntimeError("the baseline needs jaxlib's FFI headers and the CUDA runtime wheels")
    source = BENCH_DIR / "gpu_baseline.cc"

    def command(output: Path) -> list[str]:
        includes = ["-isystem", str(include)]
        for path in cuda.includes:
            includes += ["-isystem", str(path)]
        return [build.compiler(), *build.FLAGS, "-shared", *includes, str(source),
                "-o", str(output), *build.cuda_link_args(cuda)]  # fmt: skip

    path = build.compile_with(command, workdir / "libbaseline.so")
    lib = ctypes.CDLL(str(path))
    lib.baseline_init.argtypes = [ctypes.c_uint64]
    if lib.baseline_init(256 * MiB) != 0:
        raise RuntimeError("cudaHostAlloc of the baseline's pinned buffer failed")
    capsule = jax.ffi.pycapsule(lib.BaselineCopy)
    jax.ffi.register_ffi_target(BASELINE_TARGET, capsule, platform="CUDA")
    return lib


# ---- 1. per-tap cost --------------------------------------------------------------------


@contextlib.contextmanager
def lowered_as(backend: Backend) -> Any:
    """Taps lowered (compiled) inside this block take `backend`'s path: how one process
    compares both. A compiled loop keeps the path it was lowered with."""
    settings = lifecycle._settings
    assert settings is not None, "tapd.configure() first"
    lifecycle._settings = dataclasses.replace(settings, backend=backend)
    try:
        yield
    finally:
        lifecycle._settings = settings


def cost_loop(size: int, steps: int, mode: str) -> Callable[[jax.Array], jax.Array]:
    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        x = x * 0.999 + 0.001
        if mode in ("tap", "portable tap"):
            tapd.tap(x, f"gpu.cost.{size}")
        elif mode == "callback":
            jax.debug.callback(lambda v: None, x)
        elif mode == "bare copy":
            jax.ffi.ffi_call(BASELINE_TARGET, (), has_side_effect=True)(x)
        return x

    return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))


def timed(function: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    started = time.perf_counter()
    function(x).block_until_ready()
    jax.effects_barrier()
    return time.perf_counter() - started


def per_tap_cost(repeats: int, modes: list[str], ring_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for size, steps in COST_STEPS.items():
        steps = max(2, min(steps, int(ring_bytes * 0.8) // (size + 64)))  # the ring holds a run
        x = jnp.zeros(size // 4, jnp.float32)
        loops = {mode: cost_loop(size, steps, mode) for mode in ["none", *modes]}
        for mode, function in loops.items():  # compile and warm up
            portable = mode == "portable tap"
            with lowered_as("portable") if portable else contextlib.nullcontext():
                timed(function, x)
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
        samples: dict[str, list[float]] = {mode: [] for mode in loops}
        for _ in range(repeats):
            for mode, function in loops.items():  # interleaved: shared noise
                samples[mode].append(timed(function, x) / steps * 1e6)
                if mode in ("tap", "portable tap"):
                    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)  # an empty ring each run
        base = median(samples["none"])
        added = {mode: median(v) - base for mode, v in samples.items() if mode != "none"}
        rows.append({"bytes": size, "steps": steps, "untapped_us": base, "added_us": added})
        log(f"cost {size_name(size)}: untapped {base:.1f} µs/step, added {added}")
    return rows


def cost_table(rows: list[dict[str, Any]], modes: list[str]) -> str:
    header = ["payload", "steps", "untapped µs/step",
              *[f"{mode} adds µs" for mode in modes]]  # fmt: skip
    ratios = [(a, b, title) for a, b, title in (
        ("tap", "callback", "tap ÷ callback"),
        ("tap", "bare copy", "tap ÷ bare copy (goal ≤ 1.2)"),
        ("portable tap", "callback", "portable ÷ callback (goal ≤ 1.1 at 64 B)"),
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


# ---- 2. isolation -----------------------------------------------------------------------


def isolation(procs: Processes, steps: int, repeats: int, side: int = 2048) -> dict[str, Any]:
    sink = procs.start_sink("gpu.isolation", sleep_ms=10.0)
    weights = jnp.full((side, side), 0.0001, jnp.float32)

    def make(mode: str) -> Callable[[jax.Array], jax.Array]:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            for _ in range(8):
                x = jnp.tanh(x @ weights)
            if mode == "tap":
                tapd.tap(x[0, :4], "gpu.isolation", step=i)
            elif mode == "callback":
                jax.debug.callback(lambda v: None, x[0, :4])
            return x

        return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    x = jnp.ones((side, side), jnp.float32)
    variants = {mode: make(mode) for mode in ("none", "tap", "callback")}
    for function in variants.values():
        timed(function, x)
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    seconds: dict[str, list[float]] = {mode: [] for mode in variants}
    vs_untapped, vs_callback = [], []
    for _ in range(repeats):
        run = {mode: timed(function, x) for mode, function in variants.items()}
        for mode, value in run.items():
            seconds[mode].append(value)
        vs_untapped.append(run["tap"] / run["none"])
        vs_callback.append(run["tap"] / run["callback"])
    started = time.perf_counter()
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    barrier_s = time.perf_counter() - started
    procs.stop(sink.process)
    result = {
        "steps": steps, "untapped_us": median(seconds["none"]) / steps * 1e6,
        "tapped_us": median(seconds["tap"]) / steps * 1e6,
        "callback_us": median(seconds["callback"]) / steps * 1e6,
        "vs_untapped": median(vs_untapped), "vs_callback": median(vs_callback),
        "barrier_s": barrier_s, "handled": sink.results()["processed"],
    }  # fmt: skip
    log(f"isolation: {result}")
    return result


# ---- 3. throughput ----------------------------------------------------------------------


def throughput(procs: Processes, repeats: int, ring_bytes: int) -> list[dict[str, Any]]:
    rows = []
    for size, count in THROUGHPUT_COUNTS.items():
        consumer = f"gpu.throughput.{size}"
        sink = procs.start_sink(consumer)
        loop = payload_loop(consumer)
        x = jnp.arange(size // 4, dtype=jnp.float32)
        loop(x, 2)
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            loop(x, count)
            tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
            samples.append(time.perf_counter() - started)
        procs.stop(sink.process)
        seconds = median(samples)
        row = {"bytes": size, "count": count, "seconds": seconds,
               "taps_per_s": count / seconds, "mb_per_s": count * size / seconds / 1e6,
               "handled": sink.results()["processed"],
               "expected": repeats * count + 2}  # fmt: skip
        rows.append(row)
        log(f"throughput {size_name(size)}: {row}")
    return rows


def payload_loop(name: str) -> Callable[[jax.Array, int], jax.Array]:
    """jit(x, n -> fori_loop of n steps each tapping `x` as `name`), as bench/run.py."""

    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        tapd.tap(x, name, step=i)
        return x

    return jax.jit(lambda x, n: lax.fori_loop(0, n, body, x))


# ---- the report -------------------------------------------------------------------------


def gpu_description() -> list[tuple[str, str]]:
    rows = []
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,"
             "pcie.link.width.max", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout.strip().splitlines()  # fmt: skip
        rows.append(("GPU (nvidia-smi)", "; ".join(smi)))
    except (OSError, subprocess.SubprocessError):
        rows.append(("GPU (nvidia-smi)", "unknown"))
    devices = jax.devices()
    rows.append(("JAX devices", f"{len(devices)} x {devices[0].device_kind}"))
    rows.append(("CUDA runtime (tapd's handler)", str(_cuda_runtime_version())))
    return rows


def _cuda_runtime_version() -> int | None:
    function = library.handler("cuda")
    if function is None:
        return None
    cuda = build.cuda_runtime()
    if cuda is None:
        return None
    runtime = ctypes.CDLL(str(cuda.library))
    version = ctypes.c_int()
    runtime.cudaRuntimeGetVersion(ctypes.byref(version))
    return version.value


def write_report(out: Path, sections: list[str], header: list[tuple[str, str]]) -> None:
    lines = [
        "# tapd on a GPU",
        "",
        "Written by `bench/gpu-check` (`bench/gpu_bench.py`); the figures are medians of "
        "interleaved repeats in one run. Compare ratios within this run.",
        "",
        table(["what", "value"], [[k, v] for k, v in header]),
        "",
        *sections,
    ]
    out.write_text("\n".join(lines) + "\n")
    log(f"wrote {out}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(BENCH_DIR / "RESULTS-gpu.md"))
    parser.add_argument("--quick", action="store_true", help="fewer repeats (a smoke run)")
    parser.add_argument("--tests-status", default="not run", help="what tests/gpu said")
    parser.add_argument("--smoke-on-cpu", action="store_true",
                        help="run this script's code on CPU (no bare copy): checks the "
                        "script where there is no GPU; its figures mean nothing")  # fmt: skip
    args = parser.parse_args()
    repeats = 2 if args.quick else 5
    if args.smoke_on_cpu:
        COST_STEPS.update({64: 50, MiB: 10, 64 * MiB: 2})
        THROUGHPUT_COUNTS.update({64: 200, MiB: 10, 64 * MiB: 2})
    elif jax.default_backend() != "gpu":
        print(f"gpu_bench: JAX's default backend is {jax.default_backend()}, not gpu")
        return 2
    free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 2**30
    ring_bytes = max(16 * MiB, min(2**30, int(free * 0.5)) // 4096 * 4096)
    workdir = Path(tempfile.mkdtemp(prefix="tapd-gpu-", dir="/tmp"))
    workdir.chmod(0o700)
    procs = Processes(workdir)
    sections: list[str] = []
    header = [*machine_description(), *gpu_description(),
              ("code", code_revision(BENCH_DIR.parent)),
              ("tests/gpu", args.tests_status),
              ("ring", f"{ring_bytes // MiB} MiB, policy block")]  # fmt: skip
    try:
        procs.start_daemon()
        tapd.configure(endpoint=procs.endpoint, backend="native", policy="block",
                       buffer_bytes=ring_bytes)  # fmt: skip
        backend = tapd.backend()
        header.append(("tapd backend on the GPU", backend))
        header += [(f"tapd {name}", value) for name, value in library.status().items()]
        if backend != "native":
            sections += [
                f"**The taps below did not go through tapd's CUDA handler** (backend "
                f"{backend}): their figures are not the handler's.",
                "",
            ]
        modes = ["tap", "portable tap", "callback"]
        try:
            if args.smoke_on_cpu:
                raise RuntimeError("not on CPU")
            build_baseline(workdir)
            modes.append("bare copy")
        except Exception as exc:
            sections += [f"The bare-copy baseline could not be built: `{exc}`", ""]
        log("1. per-tap cost")
        rows = per_tap_cost(repeats, modes, ring_bytes)
        sections += ["## 1. Per-tap cost", "",
                     "Added µs per step over the untapped loop (median of "
                     f"{repeats} interleaved runs).", "", cost_table(rows, modes), ""]  # fmt: skip
        log("2. isolation")
        iso = isolation(procs, 100, repeats, 128 if args.smoke_on_cpu else 2048)
        sections += ["## 2. Isolation (a subscriber sleeping 10 ms per tap)", "", table(
            ["steps", "untapped µs/step", "tapped µs/step", "callback µs/step",
             "tapped ÷ untapped", "tapped ÷ callback (goal ≤ 1.1)", "barrier after (s)",
             "handled"],
            [[str(iso["steps"]), number(iso["untapped_us"]), number(iso["tapped_us"]),
              number(iso["callback_us"]), f"{iso['vs_untapped']:.3f}",
              f"{iso['vs_callback']:.3f}", f"{iso['barrier_s']:.2f}", str(iso["handled"])]],
        ), ""]  # fmt: skip
        log("3. throughput")
        tp = throughput(procs, max(2, repeats // 2), ring_bytes)
        sections += ["## 3. Throughput to a subscriber", "", table(
            ["payload", "taps", "taps/s", "MB/s", "handled / expected"],
            [[size_name(r["bytes"]), str(r["count"]), number(r["taps_per_s"], 0),
              number(r["mb_per_s"], 1), f"{r['handled']} / {r['expected']}"] for r in tp],
        ), ""]  # fmt: skip
        stats = tapd.stats()
        sections += ["## tapd's counters at the end", "", f"`{stats}`", ""]
        status = 0
    except Exception:
        sections += ["## The run failed", "", "```", traceback.format_exc(), "```", ""]
        status = 1
    finally:
        procs.stop_all()
        write_report(Path(args.out), sections, header)
        shutil.rmtree(workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
