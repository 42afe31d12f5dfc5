"""Every JAX version difference tapd deals with, in one place: this folder.

tapd lowers its tap with JAX internals (`jax._src`), whose signatures change between
releases. Each call whose signature changed within tapd's range goes through a function
here, which tells the versions apart by the signature itself (`inspect`), not by a
version number. The rest of tapd reaches them through this face, `jax_compat.NAME`:

- versions.py: tapd's JAX range (`SUPPORTED`, `TESTED`), the warnings at `import tapd`,
  and the check that every internal tapd calls fits this jax (`SEAMS`,
  `require_supported`);
- calls.py: the calls whose signatures changed (`register_lowering`,
  `emit_python_callback`, `set_sharding`, `single_device_sharding`, ...), the
  workaround for one JAX bug (`tap_effects`: an executable compiled ahead of time takes
  a C++ fast path that drops an ordered effect's token, docs/UPSTREAM.md), `jax.export`'s
  stable targets (`export_targets_stable`: tapd's two custom calls, whose attributes are
  a versioned format, docs/PROTOCOL.md), and what JAX is doing now (tracing, inside a
  host callback, under which meshes);
- dispatch.py: the two internals wrapped rather than called, for the default tap to keep
  JAX's C++ dispatch path (issue 26): `pxla.ExecuteReplicated.__init__`
  (`dispatch_ignores`) and `mlir.lower_jaxpr_to_module` (`wrap_module_lowering`: tapd
  orders the lowered module's taps, tapd/emitter/order.py);
- cpu_put.py: numpy leaves made CPU jax.Arrays as `jax.debug.callback` hands them.

One difference is in C++ instead: jaxlib 0.8 passes an ordered tap's token result to
the FFI handler, where 0.10 does not, so the handlers bind `RemainingRets()`
(tapd/native/ffi_cpu.cc, ffi_cuda.cc). Importing this package does not import JAX.
"""

from __future__ import annotations

from tapd.emitter.jax_compat.calls import (
    ambient_meshes,
    callback_op_sharding,
    emit_python_callback,
    emit_python_callback_with_result,
    export_targets_stable,
    in_host_callback,
    lowering_for_export,
    outside_any_mesh,
    register_lowering,
    set_sharding,
    single_device_sharding,
    tap_effects,
    tracing,
)
from tapd.emitter.jax_compat.cpu_put import cpu_putter, cpu_putter_like
from tapd.emitter.jax_compat.dispatch import (
    dispatch_ignores,
    ignored_by_dispatch,
    jax_effects_barrier,
    served_without_tokens,
    wrap_module_lowering,
)
from tapd.emitter.jax_compat.versions import (
    FLOOR,
    SEAMS,
    SUPPORTED,
    TESTED,
    TESTED_THROUGH,
    Seam,
    cpu_partition_id_in_branches,
    installed_jax,
    require_supported,
    seam_misfit,
    unsupported_reason,
    untested_reason,
    warn_if_unsupported,
)

__all__ = [
    "FLOOR",
    "SEAMS",
    "SUPPORTED",
    "TESTED",
    "TESTED_THROUGH",
    "Seam",
    "ambient_meshes",
    "callback_op_sharding",
    "cpu_partition_id_in_branches",
    "cpu_putter",
    "cpu_putter_like",
    "dispatch_ignores",
    "emit_python_callback",
    "emit_python_callback_with_result",
    "export_targets_stable",
    "ignored_by_dispatch",
    "in_host_callback",
    "installed_jax",
    "jax_effects_barrier",
    "lowering_for_export",
    "outside_any_mesh",
    "register_lowering",
    "require_supported",
    "seam_misfit",
    "served_without_tokens",
    "set_sharding",
    "single_device_sharding",
    "tap_effects",
    "tracing",
    "unsupported_reason",
    "untested_reason",
    "warn_if_unsupported",
    "wrap_module_lowering",
]
