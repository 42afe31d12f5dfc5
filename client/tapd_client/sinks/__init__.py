"""Handlers that send taps to the tools users already look at: TensorBoard, MLflow and
Weights & Biases. Each imports its tool's library only when made, so `tapd_client`
stays light: `pip install 'tapd[tensorboard]'` (or `[mlflow]`, `[wandb]`).

    from tapd_client import Subscriber
    from tapd_client.sinks.tensorboard import TensorBoardSink

    sub = Subscriber()
    sub.add_handler("*", TensorBoardSink("runs/exp1"))

What a tap becomes is the same for every tool (sinks/_points.py); each tool's module
says how it writes it. `tapd sink TOOL` and `tapd subscribe --sink SPEC` make sinks here,
by name, from a spec:

    TOOL[:TARGET][,OPTION[=VALUE]...]

TARGET is the tool's destination: tensorboard's logdir (required), mlflow's tracking
URI, wandb's project. OPTIONs are `process_in_tag` and `assemble` (flags), and
`experiment=`, `run_name=` (mlflow), `run_name=` (wandb). Only the first `:` splits, so
`mlflow:http://host:5000,experiment=exp1` works.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from tapd_client.sinks.base import Sink, Tee

__all__ = ["SINKS", "Sink", "SinkKind", "Tee", "make_sink", "parse_spec"]


@dataclasses.dataclass(frozen=True)
class SinkKind:
    module: str
    name: str  # the class in `module`
    target: str  # the keyword TARGET fills
    target_required: bool
    options: tuple[str, ...]  # keywords taking a string


SINKS = {
    "tensorboard": SinkKind("tapd_client.sinks.tensorboard", "TensorBoardSink", "logdir", True, ()),
    "mlflow": SinkKind(
        "tapd_client.sinks.mlflow", "MlflowSink", "tracking_uri", False, ("experiment", "run_name")
    ),
    "wandb": SinkKind("tapd_client.sinks.wandb", "WandbSink", "project", False, ("run_name",)),
}
FLAGS = ("process_in_tag", "assemble")


def _kind(tool: str) -> SinkKind:
    try:
        return SINKS[tool]
    except KeyError:
        raise ValueError(f"no sink {tool!r}: there are {', '.join(sorted(SINKS))}") from None


def make_sink(tool: str, target: str | None = None, **options: Any) -> Sink:
    """The sink of `tool` writing to `target`, with the keywords its class takes. Raises
    ImportError (naming the extra to install) where the tool's library is missing."""
    kind = _kind(tool)
    if target is None and kind.target_required:
        raise ValueError(f"the {tool} sink needs a {kind.target}: {tool}:{kind.target.upper()}")
    unknown = set(options) - set(kind.options) - set(FLAGS)
    if unknown:
        raise ValueError(
            f"the {tool} sink has no option {', '.join(sorted(unknown))}; it takes "
            f"{', '.join(kind.options + FLAGS)}"
        )
    cls = getattr(importlib.import_module(kind.module), kind.name)
    if target is not None:
        options[kind.target] = target
    sink: Sink = cls(**options)
    return sink


def parse_spec(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """`TOOL[:TARGET][,OPTION[=VALUE]...]` as (tool, target, options), checked against the
    tool's options (ValueError naming what is wrong), without importing the tool."""
    head, *rest = spec.split(",")
    tool, colon, target = head.partition(":")
    kind = _kind(tool)
    if colon and not target:
        raise ValueError(f"sink spec {spec!r}: empty {kind.target} after {tool}:")
    if not colon and kind.target_required:
        raise ValueError(
            f"sink spec {spec!r}: the {tool} sink needs a {kind.target}: "
            f"{tool}:{kind.target.upper()}"
        )
    options: dict[str, Any] = {}
    for item in rest:
        key, equals, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key in FLAGS:
            if equals and value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"sink spec {spec!r}: {key}={value!r} is not true or false")
            options[key] = not equals or value.lower() in ("true", "1")
        elif key in kind.options:
            if not equals or not value:
                raise ValueError(f"sink spec {spec!r}: {key} needs a value ({key}=...)")
            options[key] = value
        else:
            raise ValueError(
                f"sink spec {spec!r}: the {tool} sink has no option {key!r}; it "
                f"takes {', '.join(kind.options + FLAGS)}"
            )
    return tool, target or None, options
