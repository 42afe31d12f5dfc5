"""Tapped computations that travel: what a process that loads one needs (tapd.deserialize).

A `jax.export` artifact of a tapped function holds tapd's custom calls, each naming its
site by its entry (tapd.emitter.entries), and tapd's effects by their class names. The
process that loads it must have, before JAX deserializes and compiles it: the effect
classes registered (importing tapd.emitter.primitive), tapd's FFI handler registered
with XLA, and the site resolver set in the ring library (both register_ffi_target),
which registers the sites in the ring that tapd.emitter.lifecycle makes.
"""

from __future__ import annotations

import logging
from typing import Any

# (primitive registers the effects; lifecycle hands the resolver this process's ring)
from tapd.emitter import lifecycle, native_backend, primitive  # noqa: F401
from tapd.errors import TapDefinitionError
from tapd.native import library

logger = logging.getLogger("tapd.emitter")


def register() -> bool:
    """Register tapd's part (see above); whether the native handler is there. Done by
    `import tapd` when JAX's serialization module is imported (tapd.export_hook)."""
    registered = native_backend.register_ffi_target()
    if not registered:
        logger.warning(
            "tapd: a tapped computation exported elsewhere cannot run here: tapd's native "
            "handler is unavailable: %s",
            library.handler_reason("cpu"),
        )
    return registered


def deserialize(serialized: bytes | bytearray) -> Any:
    """`jax.export.deserialize(serialized)`, with tapd's part registered first."""
    from jax import export

    if not register():
        raise TapDefinitionError(
            "a tapped computation exported elsewhere needs tapd's native handler here, "
            f"which is unavailable: {library.handler_reason('cpu')}"
        )
    return export.deserialize(bytearray(serialized))
