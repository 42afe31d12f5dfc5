"""A computation over several devices whose taps lie in many `shard_map` bodies, gathered
across them: each device's buffers carried from body to body (issue 50).

Two shapes of program tap in many small bodies rather than one: a `jit` over a mesh of
Explicit axes, where each tap of a sharded value is a `shard_map` of its own
(tapd.emitter.tapping) so that each shard is tapped where it lives, and a `shard_map`
called in a loop. Gathered body by body (tapd.emitter.gathered.slices), each body
would end with its own flush: one host callback a tap on each device, as before.

Here the whole computation is rewritten once (`Threaded`, a `rewrite.Rewriter`), and
the buffers go into each tapping body and come out of it: each site's buffer is one
global array, tiled over every mesh axis along its first dimension, so that each device
holds its own `[capacity, *block]` rows, written only inside the bodies, where the
device's block is. The log, its length and each site's rows are the same on every
device (a body taps unconditionally, or where a condition every device shares holds:
JAX's check of varying values, `check_vma`, proves it, as the body returns them
replicated), so they stay replicated, and the loops and branches around the bodies test
them as on one device. A flush, outside a body, runs in a `shard_map` of its own: each
device sends its log (host.PerDevice). The end is each device's packed buffers as its
shard of the computation's output (taps_as_outputs), as for one body
(slices.ends_packed).

Applies where every tapping `shard_map` is over one mesh, manual over all its axes,
of the computation's devices, with `check_vma`; else `None` (slices' way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax._src import core
from jax.sharding import NamedSharding

from tapd.emitter.gathered.flush import FlushPlan
from tapd.emitter.gathered.rewrite import Gathered, NotGatherable, Rewriter, taps_within
from tapd.emitter.gathered.slices import manual_axes, tiled
from tapd.emitter.primitive import tap_p
from tapd.emitter.sharding import REPLICATED


def common_mesh(jaxpr: core.Jaxpr, devices: int) -> Any:
    """The one mesh of every tapping `shard_map` in `jaxpr`, where each is manual over
    all its axes with `check_vma` and spans the computation's `devices`; else None."""
    meshes: list[Any] = []
    if not _tapping_shard_maps(jaxpr, meshes):
        return None
    if not meshes or any(mesh != meshes[0] for mesh in meshes):
        return None
    mesh = meshes[0]
    return mesh if int(mesh.size) == devices else None


def _tapping_shard_maps(jaxpr: core.Jaxpr, meshes: list[Any]) -> bool:
    """Whether every tap of `jaxpr` lies in a shard_map this rewrite takes (their meshes
    added to `meshes`)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_p:
            return False
        if eqn.primitive.name == "shard_map":
            body = eqn.params["jaxpr"]
            if not taps_within(body):
                continue
            mesh, axes = eqn.params.get("mesh"), manual_axes(eqn.params)
            if mesh is None or axes is None or set(axes) != set(mesh.axis_names):
                return False
            if not eqn.params.get("check_vma", False) or _holds_shard_map(body):
                return False
            meshes.append(mesh)
            continue
        for sub in core.jaxprs_in_params(eqn.params):
            if not _tapping_shard_maps(sub, meshes):
                return False
    return True


def _holds_shard_map(jaxpr: core.Jaxpr) -> bool:
    return any(
        eqn.primitive.name == "shard_map"
        or any(map(_holds_shard_map, core.jaxprs_in_params(eqn.params)))
        for eqn in jaxpr.eqns
    )


class Threaded(Rewriter):
    """The rewrite of a computation whose taps lie in `shard_map` bodies over `mesh`
    (see the module docstring): outside the bodies the state is global, inside each
    device's."""

    def __init__(self, plan: FlushPlan, mesh: Any) -> None:
        super().__init__(plan)
        self.mesh = mesh
        self.names = tuple(mesh.axis_names)
        self._inside = 0  # bodies around what is being traced

    def empty(self, flags: Any = None) -> Gathered:
        """Fresh buffers, each global: every device's rows, one after another."""
        state = super().empty(flags)
        devices = int(self.mesh.size)
        buffers = tuple(
            tuple(
                lax.full((devices * buffer.shape[0], *buffer.shape[1:]), 0, buffer.dtype)
                for buffer in site
            )
            for site in state.buffers
        )
        return state._replace(buffers=self._placed(buffers))

    def _placed(self, buffers: Any) -> Any:
        """Over a mesh of Explicit axes a value's sharding is part of its type: the
        buffers are made as the bodies return them (each device its rows), so that a
        body takes them as they are and a loop carries one type."""
        explicit = getattr(jax.sharding.AxisType, "Explicit", None)
        if explicit is None or explicit not in tuple(getattr(self.mesh, "axis_types", ())):
            return buffers
        placed = NamedSharding(self.mesh, tiled(self.names))
        reshard: Any = jax.sharding.reshard
        return jax.tree.map(lambda buffer: reshard(buffer, placed), buffers)

    def _specs(self, state: Gathered) -> Gathered:
        """How `state` enters a body: each device its own rows of the buffers; the
        rest, the same on every device."""
        rows = tiled(self.names)
        return state._replace(
            count=REPLICATED,
            log=REPLICATED,
            order=REPLICATED,
            rows=REPLICATED,
            buffers=tuple(tuple(rows for _ in site) for site in state.buffers),
            awake=REPLICATED,
            skipped=REPLICATED,
            seen=REPLICATED,
            phase=REPLICATED,
            interval=REPLICATED,
            polls=REPLICATED,
        )

    def _each_device(
        self, function: Callable[..., Any], args: tuple[Any, ...], in_specs: Any, out_specs: Any
    ) -> Any:
        """`function(*args)` on each device, in a `shard_map` over the mesh."""

        def body(*inner: Any) -> Any:
            self._inside += 1
            try:
                return function(*inner)
            finally:
                self._inside -= 1

        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=set(self.names),
            check_vma=True,
        )
        return mapped(*args)

    def run_shard_map(
        self, eqn: core.JaxprEqn, invals: list[Any], state: Gathered, checked: bool
    ) -> tuple[list[Any], Gathered]:
        if self._inside or eqn.params["mesh"] != self.mesh:
            raise NotGatherable("a shard_map in another, or over another mesh")
        body = eqn.params["jaxpr"]
        specs = self._specs(state)

        def on_device(st: Gathered, *args: Any) -> tuple[tuple[Any, ...], Gathered]:
            outs, st = self.run(body, (), list(args), st, checked)
            return tuple(outs), st

        in_specs = (specs, *eqn.params["in_specs"])
        out_specs = (tuple(eqn.params["out_specs"]), specs)
        outs, state = self._each_device(on_device, (state, *invals), in_specs, out_specs)
        return list(outs), state

    def flushed(self, state: Gathered, steps: Any = 0, *, answer: bool = False) -> Gathered:
        """A flush outside the bodies: each device flushes its own log, in a shard_map."""
        if self._inside:
            return super().flushed(state, steps, answer=answer)
        specs = self._specs(state)
        flush_here = super().flushed
        result: Gathered = self._each_device(lambda st: flush_here(st), (state,), (specs,), specs)
        return result

    def packed(self, state: Gathered) -> Any:
        """Each device's packed buffers, its shard of one global array."""
        pack_here = super().packed
        return self._each_device(pack_here, (state,), (self._specs(state),), tiled(self.names))
