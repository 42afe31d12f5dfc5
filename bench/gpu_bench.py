"""tapd on an NVIDIA GPU, one section per process: `bench/gpu-check` runs each with its
own time limit (a section that fails or hangs leaves the others' figures), then
`report` turns what they wrote into bench/RESULTS-gpu.md and bench/RESULTS-gpu.json
(bench/report.py's `gpu_page`: the targets, and a table a section).

    python bench/gpu_bench.py SECTION --results DIR [--quick] [--smoke-on-cpu] [--label L]
    python bench/gpu_bench.py report --results DIR --md OUT.md --json OUT.json

Each section is its own JAX emitter on the first GPU, with its own daemon and
subscriber sinks (bench/processes.py), and writes DIR/SECTION[-LABEL].json. Every
figure is the median of interleaved repeats.

- cost: per-tap cost for 64 B, 1 MiB and 64 MiB in a jitted `fori_loop` whose body
  updates a float32 vector of that size: untapped; `tapd.tap` (the CUDA handler); the
  portable backend (a host callback writing the ring); a no-op `jax.debug.callback`; a
  bare `cudaMemcpyAsync` into pinned host memory (bench/gpu_baseline.cc built with
  -DTAPD_BENCH_BARE_COPY, an FFI handler that does only that). The ring is the one the
  first GPU run hung on: up to 1 GiB, half of /dev/shm, policy block, no subscriber for
  these taps.
- isolation: a ~0.5 ms step (eight 2048x2048 matmuls) untapped, tapped into a
  subscriber that sleeps 10 ms a tap, and with a no-op `jax.debug.callback` instead.
- throughput: taps/s and MB/s to a subscriber, from the first tap to `barrier_wait()`
  (run again with JAX_PLATFORMS=cpu, label "cpu", for the same daemon on that CPU).
- graphs: a body of six matmul+tanh steps untapped, tapped and with a no-op callback:
  what a tap costs the step where XLA captures command buffers (CUDA graphs), run with
  them on (label "on", XLA's default) and off (label "off",
  XLA_FLAGS=--xla_gpu_enable_command_buffer=).

On SIGTERM (the section's time limit) a section prints where it stood: its ring's
counters, the daemon's ring stats and the end of the daemon's log.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from processes import BENCH_DIR, Processes
from report import code_revision, gpu_page, machine_description, median, size_name
from throughput import matmul_loops, payload_loop  # (payload_loop: as run.py's section 2 taps)

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


def compile_bare_copy(directory: Path) -> Path:
    """Compile bench/gpu_baseline.cc's bare copy (-DTAPD_BENCH_BARE_COPY) as tapd's CUDA
    handler is compiled (no GPU needed), into `directory`, once."""
    include = build.ffi_include_dir()
    cuda = build.cuda_runtime()
    if include is None or cuda is None:
        raise RuntimeError("the baseline needs jaxlib's FFI headers and the CUDA runtime wheels")
    source = BENCH_DIR / "gpu_baseline.cc"

    def command(output: Path) -> list[str]:
        includes = ["-isystem", str(include)]
        for path in cuda.includes:
            includes += ["-isystem", str(path)]
        return [build.compiler(), *build.FLAGS, "-DTAPD_BENCH_BARE_COPY", "-shared",
                *includes, str(source), "-o", str(output),
                *build.cuda_link_args(cuda)]  # fmt: skip

    path = directory / "libbaseline.so"
    if not path.exists():  # (the cost sections of one run share it)
        build.compile_with(command, path)
    return path


def build_baseline(workdir: Path) -> ctypes.CDLL:
    """The bare copy, compiled (compile_bare_copy), loaded and registered with XLA."""
    path = compile_bare_copy(workdir)
    lib = ctypes.CDLL(str(path))
    lib.baseline_init.argtypes = [ctypes.c_uint64]
    if lib.baseline_init(256 * MiB) != 0:
        raise RuntimeError("cudaHostAlloc of the baseline's pinned buffer failed")
    capsule = jax.ffi.pycapsule(lib.BaselineCopy)
    jax.ffi.register_ffi_target(BASELINE_TARGET, capsule, platform="CUDA")
    return lib


# ---- 1. per-tap cost --------------------------------------------------------------------


@contextlib.contextmanager
def lowered_as(backend: Backend | None = None, **changes: Any) -> Any:
    """Taps lowered (compiled) inside this block take `backend`'s path, and the other
    settings `changes` give: how one process compares both paths (or a site that may be
    dormant beside TAPD_DORMANT=0's). A compiled loop keeps what it was lowered with."""
    settings = lifecycle._settings
    assert settings is not None, "tapd.configure() first"
    if backend is not None:
        changes["backend"] = backend
    lifecycle._settings = dataclasses.replace(settings, **changes)
    try:
        yield
    finally:
        lifecycle._settings = settings


def make_dormant(consumer: str) -> None:
    """Mark `consumer`'s sites dormant in the ring's site table, as the daemon does for a
    site nobody takes (issue 21): its taps then copy, and enqueue, nothing."""
    from tapd.protocol.ring_format import EVERY_DORMANT

    native = lifecycle.get_sender().native
    assert native is not None, "a dormant tap needs the ring (a local daemon)"
    for site in native.sites_of(consumer):
        native.ring.set_site_every(site, EVERY_DORMANT)


def cost_loop(size: int, steps: int, mode: str) -> Callable[[jax.Array], jax.Array]:
    def body(i: jax.Array, x: jax.Array) -> jax.Array:
        x = x * 0.999 + 0.001
        if mode in ("tap", "portable tap"):
            tapd.tap(x, f"gpu.cost.{size}")
        elif mode == "dormant tap":
            tapd.tap(x, f"gpu.cost.dormant.{size}")
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


def per_tap_cost(
    repeats: int, modes: list[str], ring_bytes: int, sizes: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for size, steps in COST_STEPS.items():
        if size not in sizes:
            continue
        steps = max(2, min(steps, int(ring_bytes * 0.8) // (size + 64)))  # the ring holds a run
        x = jnp.zeros(size // 4, jnp.float32)
        loops = {mode: cost_loop(size, steps, mode) for mode in ["none", *modes]}
        for mode, function in loops.items():  # compile and warm up
            if mode == "portable tap":
                context = lowered_as("portable")
            elif mode == "dormant tap":  # (gpu-check runs with TAPD_DORMANT=0)
                context = lowered_as(dormant=True)
            else:
                context = contextlib.nullcontext()
            with context:
                timed(function, x)
        tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
        if "dormant tap" in loops:
            make_dormant(f"gpu.cost.dormant.{size}")
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


# ---- 2. isolation -----------------------------------------------------------------------


def isolation(procs: Processes, steps: int, repeats: int, side: int = 2048) -> dict[str, Any]:
    sink = procs.start_sink("gpu.isolation", sleep_ms=10.0)
    x, variants = matmul_loops(steps, side, 6, 0.0001, "gpu.graphs")
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


# ---- the machine, and a section's run --------------------------------------------------


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


def ring_bytes_here() -> int:
    """The benchmark's ring: half of /dev/shm's free space, 16 MiB to 1 GiB."""
    free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").is_dir() else 2**30
    return max(16 * MiB, min(2**30, int(free * 0.5)) // 4096 * 4096)


def environment(ring_bytes: int) -> dict[str, Any]:
    rows = [*machine_description(), *gpu_description(),
            ("code", code_revision(BENCH_DIR.parent)),
            ("ring", f"{ring_bytes // MiB} MiB, policy block")]  # fmt: skip
    rows.append(("tapd backend", tapd.backend()))
    rows += [(f"tapd {name}", value) for name, value in library.status().items()]
    registration = library.cuda_ring_registration()
    if registration is not None:
        rows.append(("ring registration with CUDA", f"{registration['bytes'] // MiB} MiB pinned, "
                     f"{'mapped' if registration['mapped'] else 'not mapped'}, "
                     f"{registration['seconds']:.2f} s"))  # fmt: skip
    return {
        "rows": rows,
        "machine": _machine_line(rows),
        "revision": code_revision(BENCH_DIR.parent),
    }


def _machine_line(rows: list[tuple[str, str]]) -> str:
    found = dict(rows)
    return "; ".join(found[k] for k in ("GPU (nvidia-smi)", "CPU", "cores") if k in found)


def _explain_before(limit: float, procs: Processes) -> None:
    """Shortly before the section's time limit: where the ring and the daemon stood,
    then exit. From a thread, so that it runs even while the main thread is stuck in
    XLA (a tap waiting for ring space holds it there); SIGTERM dumps the tracebacks."""
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

    def explain() -> None:
        print(f"\n== gpu_bench: {limit:.0f} s limit nearly reached; where it stood:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        sender = lifecycle._sender
        if sender is not None and sender.native is not None:
            ring = sender.native.ring
            # (why the daemon holds it: a writer waiting for space says so, above)
            print(f"emitter ring: {ring.counters()}")
        with contextlib.suppress(Exception):
            print(f"daemon rings: {procs.daemon_stats().get('rings')}")
        print("daemon log (end):\n" + procs.daemon_log_text()[-4000:], flush=True)
        procs.stop_all()
        os._exit(124)

    if limit > 0:
        timer = threading.Timer(max(1.0, limit - 8), explain)
        timer.daemon = True
        timer.start()


def run_section(section: str, args: argparse.Namespace) -> int:
    repeats = 2 if args.quick else 5
    if args.smoke_on_cpu:
        COST_STEPS.update({64: 50, MiB: 10, 64 * MiB: 2})
        THROUGHPUT_COUNTS.update({64: 200, MiB: 10, 64 * MiB: 2})
    elif jax.default_backend() != "gpu" and args.label != "cpu":
        print(f"gpu_bench: JAX's default backend is {jax.default_backend()}, not gpu")
        return 2
    ring_bytes = ring_bytes_here()
    workdir = Path(tempfile.mkdtemp(prefix="tapd-gpu-", dir="/tmp"))
    workdir.chmod(0o700)
    procs = Processes(workdir)
    _explain_before(args.limit, procs)
    name = section + (f"-{args.label}" if args.label else "")
    out = Path(args.results) / f"{name}.json"
    result: dict[str, Any] = {"section": section, "label": args.label,
                              "smoke": args.smoke_on_cpu}  # fmt: skip
    try:
        procs.start_daemon()
        tapd.configure(endpoint=procs.endpoint, backend="native", policy="block",
                       buffer_bytes=ring_bytes)  # fmt: skip
        result["backend"] = tapd.backend()
        if section == "cost":
            modes = ["tap", "dormant tap", "portable tap", "callback"]
            try:
                if args.smoke_on_cpu:
                    raise RuntimeError("not on CPU")
                build_baseline(Path(args.results))
                modes.append("bare copy")
            except Exception as exc:
                result["bare_copy_error"] = str(exc)
            log("per-tap cost")
            result["modes"] = modes
            sizes = (
                [int(size) for size in args.sizes.split(",")] if args.sizes else list(COST_STEPS)
            )
            result["rows"] = per_tap_cost(repeats, modes, ring_bytes, sizes)
        elif section == "isolation":
            result.update(isolation(procs, 100, repeats, 128 if args.smoke_on_cpu else 2048))
        elif section == "throughput":
            result["rows"] = throughput(procs, max(2, repeats // 2), ring_bytes)
        elif section == "graphs":
            result.update(graphs(50 if args.smoke_on_cpu else 200, repeats,
                                 64 if args.smoke_on_cpu else 1024))  # fmt: skip
        else:
            raise ValueError(f"unknown section {section!r}")
        result["environment"] = environment(ring_bytes)
        result["stats"] = tapd.stats()
        status = 0
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], file=sys.stderr)
        status = 1
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {out}")
    return status


# ---- the command-buffer figure ------------------------------------------------------------


def graphs(steps: int, repeats: int, side: int) -> dict[str, Any]:
    """µs per step of six matmul+tanh steps (at least six fusions), untapped, tapped and
    with a no-op callback, under this process's XLA_FLAGS (command buffers on or off)."""
    weights = jnp.full((side, side), 0.0001, jnp.float32)

    def make(mode: str) -> Callable[[jax.Array], jax.Array]:
        def body(i: jax.Array, x: jax.Array) -> jax.Array:
            for _ in range(6):
                x = jnp.tanh(x @ weights)
            if mode == "tap":
                tapd.tap(x[0, :4], "gpu.graphs")
            elif mode == "callback":
                jax.debug.callback(lambda v: None, x[0, :4])
            return x

        return jax.jit(lambda x: lax.fori_loop(0, steps, body, x))

    x = jnp.ones((side, side), jnp.float32)
    variants = {mode: make(mode) for mode in ("none", "tap", "callback")}
    for function in variants.values():
        timed(function, x)
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    samples: dict[str, list[float]] = {mode: [] for mode in variants}
    for _ in range(repeats):
        for mode, function in variants.items():
            samples[mode].append(timed(function, x) / steps * 1e6)
    tapd.barrier_wait(timeout=BARRIER_TIMEOUT)
    us = {mode: median(v) for mode, v in samples.items()}
    flags = os.environ.get("XLA_FLAGS", "")
    result = {"steps": steps, "side": side, "us_per_step": us, "xla_flags": flags,
              "command_buffers": "--xla_gpu_enable_command_buffer=" not in flags}  # fmt: skip
    log(f"graphs: {result}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "section", choices=["cost", "isolation", "throughput", "graphs", "bare-copy", "report"]
    )
    parser.add_argument("--results", required=True, help="directory of the sections' JSON")
    parser.add_argument("--label", default="", help="names this run's JSON (SECTION-LABEL)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--sizes", default="", help="cost: the tap sizes (bytes, comma-separated)")
    parser.add_argument("--limit", type=float, default=0,
                        help="seconds this section may take (gpu-check's limit for it): "
                        "shortly before, it says where it stood and exits 124")  # fmt: skip
    parser.add_argument("--smoke-on-cpu", action="store_true",
                        help="run the section's code on CPU (no bare copy): checks the "
                        "script where there is no GPU; its figures mean nothing")  # fmt: skip
    parser.add_argument("--md", help="report: the Markdown to write")
    parser.add_argument("--json", help="report: the JSON of the figures to write")
    parser.add_argument("--log", help="report: the raw log's path, named in the report")
    args = parser.parse_args()
    if args.section == "bare-copy":
        log(f"compiled {compile_bare_copy(Path(args.results))}")
        return 0
    if args.section == "report":
        if not (args.md and args.json):
            parser.error("report needs --md and --json")
        gpu_page(Path(args.results), Path(args.md), Path(args.json), args.log)
        return 0
    return run_section(args.section, args)


if __name__ == "__main__":
    sys.exit(main())
