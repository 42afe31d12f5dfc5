"""What a handler learns about each tap besides its value."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class TapMeta:
    consumer: str  # the tap's name: "loss", or "module:qualname"
    seq: int  # per (emitter, device, consumer), from 0, in program order
    step: int | None  # the step= given at the tap site
    device: int | None  # device id where the backend knows it
    process: int  # jax.process_index() of the emitting process
    host: str
    pid: int
    emitter: str  # "host:pid"
    transforms: tuple[tuple[str, dict[str, Any]], ...]  # e.g. (("batch", {"batch_dims": [0]}),)
    time: float  # unix seconds when the tap ran
    meta: dict[str, Any]  # static metadata given at the tap site

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> TapMeta:
        return cls(
            consumer=header["consumer"],
            seq=header["seq"],
            step=header["step"],
            device=header["device"],
            process=header["process"],
            host=header["host"],
            pid=header["pid"],
            emitter=str(header.get("emitter", f"{header['host']}:{header['pid']}")),
            transforms=tuple((str(t[0]), dict(t[1])) for t in header["transforms"]),
            time=header["time"] / 1e9,
            meta=dict(header["meta"]),
        )
