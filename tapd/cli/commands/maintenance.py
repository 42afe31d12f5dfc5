"""`tapd keygen`, `tapd doctor`, `tapd clean` and `tapd demo`: this machine, its keys and
its leftovers, and a first run."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from tapd.cli.exit_codes import ExitCode
from tapd.cli.options import add_endpoint, endpoint
from tapd.errors import TapdError

logger = logging.getLogger("tapd.cli")


def register(commands: Any) -> None:
    keygen = commands.add_parser(
        "keygen", help="write a CurveZMQ key pair: NAME.key (public), NAME.key_secret"
    )
    keygen.add_argument("name", metavar="NAME")
    keygen.add_argument("--dir", type=Path, default=Path("."), help="where (default .)")
    keygen.set_defaults(run=cmd_keygen)

    doctor = commands.add_parser(
        "doctor", help="what this machine offers tapd: backends, native library, daemon"
    )
    add_endpoint(doctor)
    doctor.set_defaults(run=cmd_doctor)

    clean = commands.add_parser(
        "clean",
        help="remove shared-memory rings left by killed jobs",
        description="Remove the rings in /dev/shm whose runtime directory is gone and "
        "that no live process writes or reads (a job killed with its daemon leaves its "
        "rings, 256 MB each by default). A daemon does this at start too.",
    )
    clean.add_argument("--dry-run", action="store_true", help="only say what would go")
    clean.set_defaults(run=cmd_clean)

    demo = commands.add_parser(
        "demo", help="daemon + subscriber + a small JAX training loop with taps, then a summary"
    )
    demo.add_argument("--steps", type=int, default=20)
    demo.set_defaults(run=cmd_demo)


def cmd_keygen(args: argparse.Namespace) -> int:
    from tapd.security import keygen

    public, secret = keygen(args.dir, args.name)
    print(f"public key (give it to peers): {public}\nkey pair (keep it secret): {secret}")
    return ExitCode.OK


def cmd_doctor(args: argparse.Namespace) -> int:
    import importlib.metadata
    import platform

    from tapd.clients import control
    from tapd.native import library
    from tapd.runtime import ring_dir_for, runtime_dir

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    address = endpoint(args)
    library.load()  # builds or finds it now, so that the rows below say why not
    rows = [
        ("tapd", version("tapd")),
        ("python", platform.python_version()),
        ("jax / jaxlib", f"{version('jax')} / {version('jaxlib')}"),
        ("pyzmq", version("pyzmq")),
        ("runtime dir", str(runtime_dir())),
        ("endpoint", address),
        ("rings", str(ring_dir_for(address) or "none (not an ipc:// endpoint)")),
    ]
    rows += list(library.status().items())
    try:
        stats = control.stats(address, timeout=1.0)
        daemon = f"running ({len(stats['subscribers'])} subscribers, {len(stats['rings'])} rings)"
    except TimeoutError:
        daemon = "not answering (start one with `tapd start`)"
    rows.append(("daemon", daemon))
    rows += [(f"taps on {platform}", path) for platform, path in _tap_paths(address)]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return ExitCode.OK


def _tap_paths(address: str) -> list[tuple[str, str]]:
    """Which path a tap takes on each JAX platform here, and why (`tapd doctor`)."""
    from tapd.native import library
    from tapd.runtime import ring_dir_for

    if library.load() is None:
        sender = f"portable, sender thread (no ring: {library.unavailable_reason()})"
        return [(platform, sender) for platform in ("CPU", "GPU", "TPU")]
    if ring_dir_for(address) is None:
        sender = "portable, sender thread (the endpoint is not a local ipc:// socket)"
        return [(platform, sender) for platform in ("CPU", "GPU", "TPU")]
    paths = []
    for platform, handler in (("CPU", "cpu"), ("GPU", "cuda")):
        if library.has_handler(handler):
            paths.append((platform, "native (tapd's FFI handler writes the ring)"))
        else:
            why = library.handler_reason(handler)
            paths.append((platform, f"portable, host callback into the ring (no handler: {why})"))
    paths.append(("TPU", "portable, host callback into the ring (TPU has no user FFI handlers)"))
    return paths


def cmd_clean(args: argparse.Namespace) -> int:
    from tapd.daemon.ring_watch import sweep_stale_rings

    removed = sweep_stale_rings(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for directory, held in removed:
        print(f"{verb} {directory} ({held / 2**20:.1f} MiB)")
    total = sum(held for _, held in removed) / 2**20
    if removed:
        print(f"{verb} {len(removed)} ring directories, {total:.1f} MiB")
    else:
        print("no stale rings")
    return ExitCode.OK


def cmd_demo(args: argparse.Namespace) -> int:
    from tapd.demo.orchestrate import run_demo

    try:
        return run_demo(steps=args.steps)
    except TapdError as exc:
        logger.error("demo failed: %s", exc)
        return ExitCode.FAILURE
