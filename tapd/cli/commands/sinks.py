"""`tapd sink TOOL`: taps into a tool users look at (TensorBoard, MLflow, W&B)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from tapd.cli.commands.subscribers import run_subscriber
from tapd.cli.exit_codes import ExitCode
from tapd.cli.options import add_endpoint, add_group

logger = logging.getLogger("tapd.cli")


def register(commands: Any) -> None:
    sink = commands.add_parser(
        "sink",
        help="send taps to a tool users look at: `tapd sink tensorboard --logdir DIR`, "
        "`tapd sink mlflow`, `tapd sink wandb`",
        description="Write taps named NAME (default all) to a tool: a one-element value as a "
        "scalar at meta.step (else the tap's seq), an array as a histogram, an image tapped "
        "with image=True as an image; a pytree's leaves named by their path (grads/w).",
    )
    tools = sink.add_subparsers(dest="sink", required=True, metavar="TOOL")
    tensorboard = tools.add_parser(
        "tensorboard",
        help="scalars, histograms and images into TensorBoard event files "
        "(pip install 'tapd[tensorboard]')",
    )
    tensorboard.add_argument("--logdir", type=Path, required=True)
    mlflow = tools.add_parser(
        "mlflow",
        help="metrics into an MLflow run; an array as tag/mean, /min, /max, /norm; images "
        "with log_image (pip install 'tapd[mlflow]')",
    )
    mlflow.add_argument(
        "--tracking-uri", help="default: MLFLOW_TRACKING_URI, else the file store ./mlruns"
    )
    mlflow.add_argument("--experiment", help="by name, made if missing (default: Default)")
    mlflow.add_argument("--run-name")
    wandb = tools.add_parser(
        "wandb",
        help="scalars, histograms and images into a W&B run, x-axis tapd/step; WANDB_MODE="
        "offline needs no network (pip install 'tapd[wandb]')",
    )
    wandb.add_argument("--project", help="default: tapd")
    wandb.add_argument("--run-name")
    for tool in (tensorboard, mlflow, wandb):
        tool.add_argument("names", metavar="NAME", nargs="*", default=["*"])
        tool.add_argument(
            "--process-in-tag",
            action="store_true",
            help="start each tag with the emitting process (p0/loss): for multi-process jobs",
        )
        tool.add_argument(
            "--assemble",
            action="store_true",
            help="put a sharded tap's shards together (tapd_client.Assembler, by name and "
            "step) and write the global value, instead of one tag per shard (name/shard0)",
        )
        add_endpoint(tool, several=True)
        add_group(tool)
        tool.set_defaults(run=cmd_sink)


def cmd_sink(args: argparse.Namespace) -> int:
    from tapd_client import Subscriber
    from tapd_client.sinks import SINKS, make_sink

    kind = SINKS[args.sink]
    options = {name: getattr(args, name) for name in kind.options if getattr(args, name)}
    try:
        handler = make_sink(
            args.sink,
            getattr(args, kind.target),
            **options,
            process_in_tag=args.process_in_tag,
            assemble=args.assemble,
        )
    except (ImportError, ValueError) as exc:
        logger.error("%s", exc)
        return ExitCode.FAILURE
    subscriber = Subscriber(args.endpoint, group=args.group)
    for name in args.names:
        subscriber.add_handler(name, handler)
    try:
        return run_subscriber(subscriber)
    finally:
        handler.close()
        print(f"wrote {handler.written} points to {handler.where}", flush=True)
