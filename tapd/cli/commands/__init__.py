"""The `tapd` commands, one module per family. Each `register(commands)` adds its
subparsers (in the order `tapd --help` lists them), and each names the function that
runs it (`args.run`)."""

from __future__ import annotations

from tapd.cli.commands import daemon, maintenance, observe, recordings, sinks, subscribers

FAMILIES = (daemon, observe, subscribers, recordings, sinks, maintenance)
