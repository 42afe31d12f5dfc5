"""The gathered path over several devices: each device of a `shard_map` or `pmap` body
gathers its own taps (issue 50).

A computation over several devices (a `shard_map`, or a `pmap`, which JAX runs as a
`jit` of a `shard_map`) runs its body on every device at once. Each device's taps are
that device's: they go into the device's own log and buffers, carried through the
body's loops and branches exactly as one device's are (`rewrite.Rewriter`), and
leave in few transfers. Where the computation's taps lie in one body spanning its
devices (`ends_packed`), each device's buffers leave as its shard of one more output
of the computation (tapd.emitter.taps_as_outputs), and the wake flags come in with the
call: a call whose taps fit runs no host callback. Elsewhere a body ends with a flush,
one host callback that every device runs on its own log (`flush`, `host.PerDevice`);
a flush also runs where the log fills. Records are those of the per-tap path: device,
shard coordinates, step and seq; each device's taps in program order, each site's in
step order. (Taps in many bodies over one mesh: tapd.emitter.gathered.threaded.)

The rewrite happens as the computation lowers (`gathered_bodies`, from
`gathered.maybe_gathered`), on the jaxpr JAX lowers: each `shard_map` whose body taps
gets a body that gathers, traced in the body's own context (its mesh axes manual), so
that collectives and axis indices inside it trace as they did. Only whole
computations are gathered: where a tap lies outside any `shard_map` body (a sharded
`jit`'s own taps, or taps around the `shard_map`), or a body holds what the rewrite
does not enter, the computation keeps the per-tap path, and its taps one order.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from jax._src import core
from jax.sharding import PartitionSpec

from tapd.emitter.gathered.rewrite import (
    NotGatherable,
    site_operands,
    taps_within,
    taps_within_eqn,
)
from tapd.emitter.jaxpr_walk import JaxprRewrite
from tapd.emitter.primitive import TapSiteParams, tap_p
from tapd.emitter.sharding import REPLICATED

ClosedJaxpr = Any


# gather_body(body, its sites and their operands' avals, the manual axes its buffers
# vary along, whether it ends packed): the body gathered, a jaxpr without constants, and
# its buffers' plan (a flush.FlushPlan). A body that ends packed takes the wake flags
# first and returns its packed buffers last, with no flush at its end.
GatherBody = Callable[[Any, dict[TapSiteParams, list[Any]], tuple[str, ...], bool], Any]


def gathered_bodies(closed: ClosedJaxpr, gather_body: GatherBody) -> ClosedJaxpr | None:
    """`closed` with each tapping `shard_map` body gathered by `gather_body`; None where a tap
    lies outside every such body, or no body taps. Raises NotGatherable where a body
    cannot be gathered."""
    jaxpr = closed if isinstance(closed, core.Jaxpr) else closed.jaxpr
    if _taps_outside_bodies(jaxpr):
        return None
    rewritten = _Bodies(gather_body).jaxpr(jaxpr)
    if rewritten is jaxpr:
        return None
    return rewritten if isinstance(closed, core.Jaxpr) else closed.replace(jaxpr=rewritten)


@dataclasses.dataclass(frozen=True)
class EndsPacked:
    """A computation whose one tapping `shard_map` leaves each device's packed buffers
    as its shard of one more output (`ends_packed`)."""

    jaxpr: Any  # a core.Jaxpr: the wake flags first, the packed buffers last
    plan: Any  # each device's buffers (a flush.FlushPlan)


def ends_packed(
    closed: ClosedJaxpr,
    gather_body: GatherBody,
    devices: int,
    with_flags: Callable[[Any], Any],
) -> EndsPacked | None:
    """`closed` with its one tapping `shard_map` body gathered so that it takes the wake
    flags (replicated: every device the same) and returns its packed buffers as one more
    output, each device's its shard of it (tiled over every mesh axis), which the
    computation returns last: no flush at the body's end, no host callback at all where
    the taps fit. The shard_map may lie in nested `jit`s (a `jit` of a `pmap`), each of
    which then passes the flags in and the buffers out. None where that does not apply:
    taps outside a body, several tapping equations, a body in a loop or a branch, a
    shard_map not manual over its whole mesh or whose mesh is not the computation's
    `devices`. `with_flags(debug_info)`: the debug info of a jaxpr given the flags first
    and the buffers last."""
    jaxpr = closed if isinstance(closed, core.Jaxpr) else closed.jaxpr
    if _taps_outside_bodies(jaxpr):
        return None
    return _ending_packed(jaxpr, gather_body, devices, with_flags)


def _ending_packed(
    jaxpr: Any, gather_body: GatherBody, devices: int, with_flags: Callable[[Any], Any]
) -> EndsPacked | None:
    tapping = [i for i, eqn in enumerate(jaxpr.eqns) if taps_within_eqn(eqn)]
    if len(tapping) != 1:
        return None
    (where,) = tapping
    eqn = jaxpr.eqns[where]
    if eqn.primitive.name == "shard_map":
        changed = _shard_map_ending_packed(eqn, gather_body, devices)
    elif eqn.primitive.name in ("jit", "pjit"):
        changed = _jit_ending_packed(eqn, gather_body, devices, with_flags)
    else:
        return None
    if changed is None:
        return None
    new_eqn, plan = changed
    flags, packed = new_eqn.invars[0], new_eqn.outvars[-1]
    result = jaxpr.replace(
        invars=[flags, *jaxpr.invars],
        outvars=[*jaxpr.outvars, packed],
        eqns=[*jaxpr.eqns[:where], new_eqn, *jaxpr.eqns[where + 1 :]],
        debug_info=with_flags(jaxpr.debug_info),
    )
    return EndsPacked(result, plan)


def _shard_map_ending_packed(
    eqn: Any, gather_body: GatherBody, devices: int
) -> tuple[Any, Any] | None:
    mesh = eqn.params.get("mesh")
    axes = manual_axes(eqn.params)
    if mesh is None or axes is None:
        return None
    names = tuple(mesh.axis_names)
    if set(axes) != set(names) or int(mesh.size) != devices:
        return None
    body = eqn.params["jaxpr"]
    found: dict[TapSiteParams, list[Any]] = {}
    site_operands(body, found)
    varying = tuple(sorted(axes)) if eqn.params.get("check_vma", False) else ()
    with _inside(eqn.params):
        gathered, plan = gather_body(body, found, varying, True)
    flags_in, packed_out = gathered.invars[0], gathered.outvars[-1]
    flags = core.Var(core.ShapedArray(flags_in.aval.shape, flags_in.aval.dtype))
    (size,) = packed_out.aval.shape
    packed = core.Var(core.ShapedArray((size * devices,), packed_out.aval.dtype))
    params = {
        **eqn.params,
        "jaxpr": gathered,
        "in_specs": (REPLICATED, *eqn.params["in_specs"]),
        "out_specs": (*eqn.params["out_specs"], tiled(names)),
    }
    new_eqn = eqn.replace(
        invars=[flags, *eqn.invars], outvars=[*eqn.outvars, packed], params=params
    )
    return new_eqn, plan


def _jit_ending_packed(
    eqn: Any, gather_body: GatherBody, devices: int, with_flags: Callable[[Any], Any]
) -> tuple[Any, Any] | None:
    """A nested `jit` passing the flags in and the buffers out of the one it holds."""
    from jax._src import sharding_impls

    unspecified = getattr(sharding_impls, "UNSPECIFIED")  # noqa: B009 (not exported)
    params = eqn.params
    held = params["jaxpr"]
    inner = held if isinstance(held, core.Jaxpr) else held.jaxpr
    changed = _ending_packed(inner, gather_body, devices, with_flags)
    if changed is None:
        return None
    rewritten = changed.jaxpr if isinstance(held, core.Jaxpr) else held.replace(jaxpr=changed.jaxpr)
    flags, packed = changed.jaxpr.invars[0], changed.jaxpr.outvars[-1]
    outer_flags, outer_packed = core.Var(flags.aval), core.Var(packed.aval)
    new_params = {
        **params,
        "jaxpr": rewritten,
        "in_shardings": (unspecified, *params["in_shardings"]),
        "out_shardings": (*params["out_shardings"], unspecified),
        "in_layouts": (None, *params["in_layouts"]),
        "out_layouts": (*params["out_layouts"], None),
        "donated_invars": (False, *params["donated_invars"]),
    }
    new_eqn = eqn.replace(
        invars=[outer_flags, *eqn.invars],
        outvars=[*eqn.outvars, outer_packed],
        params=new_params,
    )
    return new_eqn, changed.plan


def tiled(names: tuple[str, ...]) -> PartitionSpec:
    """Dimension 0 tiled over every axis of the mesh, in its order: each device's part."""
    return PartitionSpec(names)  # type: ignore[no-untyped-call]


def _taps_outside_bodies(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_p:
            return True
        if eqn.primitive.name == "shard_map":
            continue
        if any(_taps_outside_bodies(sub) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


class _Bodies(JaxprRewrite):
    def __init__(self, gather_body: GatherBody):
        super().__init__()
        self.gather_body = gather_body

    def eqn(self, eqn: Any) -> Any:
        if eqn.primitive.name != "shard_map":
            return super().eqn(eqn)
        body = eqn.params["jaxpr"]
        if not taps_within(body):
            return eqn
        found: dict[TapSiteParams, list[Any]] = {}
        site_operands(body, found)
        checked = bool(eqn.params.get("check_vma", False))
        axes = tuple(sorted(manual_axes(eqn.params))) if checked else ()
        with _inside(eqn.params):
            gathered, _ = self.gather_body(body, found, axes, False)
        return eqn.replace(params={**eqn.params, "jaxpr": gathered})


def manual_axes(params: dict[str, Any]) -> Any:
    return params.get("newly_manual_axes", params.get("manual_axes"))


@contextlib.contextmanager
def _inside(params: dict[str, Any]) -> Iterator[None]:
    """The context JAX traces a shard_map body in: its mesh axes manual (so that
    `axis_index`, collectives and varying values trace as they did)."""
    from jax._src import config
    from jax._src import shard_map as shard_map_lib
    from jax._src.mesh import use_abstract_mesh

    extend = getattr(shard_map_lib, "_extend_axis_env", None)
    as_manual = getattr(shard_map_lib, "_as_manual_mesh", None)
    check_vma = getattr(config, "_check_vma", None)
    axes = manual_axes(params)
    if extend is None or as_manual is None or check_vma is None or axes is None:
        raise NotGatherable("this JAX traces shard_map bodies otherwise")
    mesh = params["mesh"]
    with (
        extend(mesh, axes),
        use_abstract_mesh(as_manual(mesh, axes)),
        check_vma(bool(params.get("check_vma", False))),
    ):
        yield
