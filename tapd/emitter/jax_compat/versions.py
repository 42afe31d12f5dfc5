"""tapd's JAX range, and the check that the JAX internals tapd calls fit this jax.

tapd asks for `SUPPORTED` (jax>=0.8.0, no upper bound: pip must not refuse tapd beside
a jax released after it). CI tests both ends of `TESTED` (.ci/run): the floor on Python
3.11, the newest jax pip gives on Python 3.12. Below the floor `import tapd` warns once
and taps fail at trace time, with the same words. Past the newest tested minor
`import tapd` warns once, naming the tested range, and taps run where the seams fit:
the first tap traced checks that every call tapd makes through
tapd.emitter.jax_compat.calls and .dispatch still binds to this jax's signature
(`SEAMS`), and one that does not fails it with a TapDefinitionError naming the seam;
tapd's native handler is registered only where this jaxlib's XLA FFI API accepts it
(tapd/native/library.py). Importing this module does not import JAX.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from tapd.errors import TapDefinitionError

# 0.8.0 is where JAX removed host_callback (keep it in step with pyproject.toml's [jax]);
# TESTED_THROUGH is the newest minor CI has run: raise it when CI passes on a newer one.
FLOOR = (0, 8, 0)
TESTED_THROUGH = (0, 12)
SUPPORTED = "jax>=0.8.0"
TESTED = "jax 0.8.0 to 0.12"


def _parse(version: str) -> tuple[int, ...]:
    """(0, 12, 0, 1) for "0.12.0.1", (0, 9, 0) for "0.9.0.dev20250101"."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in numbers.group(0).split(".")) if numbers else ()


def cpu_partition_id_in_branches() -> bool:
    """Whether this JAX's CPU compiler resolves a partition id read inside a branch of a
    loop (a device's flush in a `cond`, tapd.emitter.gathered.slices): jax 0.8.0's aborts
    the process ("LLVM ERROR: Program used external function
    '__xla_cpu_runtime_PartitionId' which could not be resolved"); 0.10.2 and 0.12.1
    resolve it; 0.9 was not tried, so it is taken as 0.8."""
    version = installed_jax()
    return version is not None and _parse(version) >= (0, 10)


def installed_jax() -> str | None:
    """The jax version of this process (without importing JAX), or None if none."""
    module = sys.modules.get("jax")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    # jax/version.py's `_version`: read, not imported (importlib.metadata alone would
    # triple the time `import tapd` takes).
    try:
        spec = importlib.util.find_spec("jax")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        try:
            with open(os.path.join(location, "version.py"), errors="replace") as file:
                text = file.read()
        except OSError:
            continue
        found = re.search(r"^_version\s*(?::\s*str\s*)?=\s*[\"']([^\"']+)[\"']", text, re.M)
        if found:
            return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("jax")
    except metadata.PackageNotFoundError:
        return None


_PAST_TESTED = f"{TESTED_THROUGH[0]}.{TESTED_THROUGH[1] + 1}"
_TESTED_PIN = f"'jax<{_PAST_TESTED}' 'jaxlib<{_PAST_TESTED}'"  # for the messages


def unsupported_reason(version: str | None = None) -> str | None:
    """One line saying why taps cannot run with this jax (it is below the floor), or
    None (also if there is no jax: subscriber-only machines need none)."""
    version = version if version is not None else installed_jax()
    if version is None or _parse(version) >= FLOOR:
        return None
    return (
        f"tapd supports {SUPPORTED}, and this is jax {version}: taps will fail until "
        f"you install a jax in that range (pip install '{SUPPORTED}' "
        f"'jaxlib{SUPPORTED.removeprefix('jax')}')"
    )


def untested_reason(version: str | None = None) -> str | None:
    """One line saying that this jax is newer than any CI has run, or None."""
    version = version if version is not None else installed_jax()
    if version is None or tuple(_parse(version)[:2]) <= TESTED_THROUGH:
        return None
    return (
        f"tapd is tested with {TESTED}, and this is jax {version}: taps run where the JAX "
        f"internals tapd calls still fit, and a tap that needs one that does not fails "
        f"when traced, naming it (pip install {_TESTED_PIN} for a tested one)"
    )


def warn_if_unsupported() -> None:
    """At `import tapd`: one warning line (logging's, which Python shows on stderr when
    nothing configured logging) if the installed jax is below the floor or newer than
    the tested range."""
    reason = unsupported_reason() or untested_reason()
    if reason is not None:
        import logging  # (only then: `import tapd` stays quick)

        logging.getLogger("tapd").warning("%s", reason)


# ---- the seams' own check ------------------------------------------------------------


class Seam(NamedTuple):
    """A JAX internal whose signature changed between versions: where JAX has it, and
    the call tapd makes with this jax (positional arguments, keywords), chosen from its
    parameters as the function below that wraps it chooses."""

    module: str
    attribute: str
    call: Callable[[Mapping[str, Any]], tuple[int, tuple[str, ...]]]


SEAMS = {  # keep in step with the calls of .calls and .dispatch
    "mlir.register_lowering": Seam(
        "jax._src.interpreters.mlir",
        "register_lowering",
        lambda parameters: (2, ("cacheable",) if "cacheable" in parameters else ()),
    ),
    "callback.emit_python_callback": Seam(
        "jax._src.callback",
        "emit_python_callback",
        lambda parameters: (
            6,
            ("has_side_effect", "sharding", *(["returns_token"] * ("returns_token" in parameters))),
        ),
    ),
    "callback._callback_op_sharding": Seam(
        "jax._src.callback", "_callback_op_sharding", lambda parameters: (3, ())
    ),
    "mlir.set_sharding": Seam(
        "jax._src.interpreters.mlir",
        "set_sharding",
        lambda parameters: (3 if len(parameters) >= 3 else 2, ()),
    ),
    # (these two: tapd needs the keywords named, whatever else the call takes)
    "pxla.ExecuteReplicated": Seam(
        "jax._src.interpreters.pxla",
        "ExecuteReplicated",
        lambda parameters: (0, _naming(parameters, "unordered_effects", "ordered_effects")),
    ),
    "mlir.lower_jaxpr_to_module": Seam(
        "jax._src.interpreters.mlir",
        "lower_jaxpr_to_module",
        lambda parameters: (0, _naming(parameters, "platforms")),
    ),
}


def _naming(parameters: Mapping[str, Any], *needed: str) -> tuple[str, ...]:
    """Every parameter by keyword, if `needed` are among them; else just `needed` (which
    then do not bind)."""
    return tuple(parameters) if set(needed) <= set(parameters) else needed


def seam_misfit(seams: Mapping[str, Seam] = SEAMS) -> str | None:
    """One line naming the first seam that this jax no longer has, or whose call would
    not bind to its signature; None when they all fit."""
    import importlib
    import inspect

    for name, seam in seams.items():
        try:
            function = getattr(importlib.import_module(seam.module), seam.attribute)
            signature = inspect.signature(function)
            positional, keywords = seam.call(signature.parameters)
            signature.bind(*[None] * positional, **dict.fromkeys(keywords))
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            return (
                f"tapd cannot tap with jax {installed_jax()}: JAX's internal {name} "
                f"({seam.module}.{seam.attribute}) does not fit the call tapd makes ({exc}); "
                f"tapd is tested with {TESTED} (pip install {_TESTED_PIN})"
            )
    return None


@functools.cache
def _checked() -> str | None:
    return unsupported_reason() or seam_misfit()


def require_supported() -> None:
    """At trace time, before tapd touches JAX internals: TapDefinitionError below the
    floor, or naming a seam that does not fit this jax (never a TypeError from inside
    JAX)."""
    reason = _checked()
    if reason is not None:
        raise TapDefinitionError(reason)
