"""The gathered path over several devices: each device of a `shard_map` or `pmap` body
gathers its own taps (issue 50).

A computation over several devices (a `shard_map`, or a `pmap`, which JAX runs as a
`jit` of a `shard_map`) runs its body on every device at once. Each device's taps are
that device's: they go into the device's own log and buffers, carried through the
body's loops and branches exactly as one device's are (`rewrite.Rewriter`), and
leave in few transfers: a flush when the log fills, and one at the end of the body. A
flush is one host callback that every device runs on its own log
(`flush`, `host.PerDevice`), so a call of a 400-step loop with a tap a
step makes one host callback a device where it made 400. Records are those of the
per-tap path: device, shard coordinates, step and seq; each device's taps in program
order, each site's in step order.

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
from collections.abc import Callable, Iterator
from typing import Any

from jax._src import core

from tapd.emitter.gathered.rewrite import NotGatherable, site_operands, taps_within
from tapd.emitter.jaxpr_walk import JaxprRewrite
from tapd.emitter.primitive import TapSiteParams, tap_p

ClosedJaxpr = Any


# gather_body(body, its sites and their operands' avals, the manual axes its buffers
# vary along): the body gathered, a jaxpr without constants.
GatherBody = Callable[[Any, dict[TapSiteParams, list[Any]], tuple[str, ...]], Any]


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
        axes = tuple(sorted(_manual_axes(eqn.params))) if checked else ()
        with _inside(eqn.params):
            gathered = self.gather_body(body, found, axes)
        return eqn.replace(params={**eqn.params, "jaxpr": gathered})


def _manual_axes(params: dict[str, Any]) -> Any:
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
    axes = _manual_axes(params)
    if extend is None or as_manual is None or check_vma is None or axes is None:
        raise NotGatherable("this JAX traces shard_map bodies otherwise")
    mesh = params["mesh"]
    with (
        extend(mesh, axes),
        use_abstract_mesh(as_manual(mesh, axes)),
        check_vma(bool(params.get("check_vma", False))),
    ):
        yield
