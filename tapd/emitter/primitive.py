"""The tap as a JAX primitive: the identity on its leaves, with the tap as an effect.

`tap_p` takes the tapped leaves (then the step and the shard coordinates, when the site
has them) and returns the leaves unchanged, so a later use of a tapped value is a use of
the tap's output.

Every tap carries tapd's *unordered* effect (`TapEffect`), which is what keeps JAX from
dropping it: dead-code elimination, partial evaluation (`grad` of a `scan`, JAX #16637),
`checkpoint` and the loops' own rules treat it as effectful. JAX would also turn off its
C++ dispatch path for every computation with such an effect, at about 55 µs a call;
`jax_compat.dispatch_ignores` tells dispatch to ignore `TapEffect` (tapd's barrier does
its own waiting: `lifecycle.flush_devices`). Order comes from the lowering: the taps of
one block (a function body, a loop body, a branch) thread tapd's own token, inside the
XLA computation (`tapd.emitter.lowering`).

A *strict* tap (`ordered="strict"`; an `id_tap` where its computation spans several
devices, `tapd.emitter.host_callback`) carries JAX's ordered effect as well: JAX threads one
runtime token through every ordered effect of the process, through `scan`, `cond` and
`while` bodies and from one computation to the next, as host_callback's outfeed token
did, at JAX's per-call cost (the Python dispatch path and a token per call). (Inside
`pmap` and `shard_map` bodies each device threads its own token.)

Transformations follow host_callback's rules:
- `vmap` taps once per batched call and appends `("batch", {"batch_dims": ...})`;
- `jvp`/`grad` tap the primal values only; tangents pass through unchanged;
- a tap applied to a linear value (a tangent inside a `custom_jvp` rule) is transposed
  into a tap of the cotangent, with `"transpose"` appended to its transforms;
- `jax.checkpoint` does not tap a second time when it recomputes the forward pass.

Lowering happens per platform and backend (`tapd.emitter.lowering`): the native FFI
handler where it is registered, else a Python callback that writes the same ring record
with one call into the native library (or, with no ring, hands the tap to the sender).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
from jax._src import core, dispatch, effects
from jax._src.interpreters import ad, batching
from jax._src.interpreters import partial_eval as pe

from tapd.emitter import jax_compat, lifecycle
from tapd.errors import TapDefinitionError

# One transform entry: ("batch", (dims...)) or ("transpose", None).
Transform = tuple[str, tuple[int | None, ...] | None]


class _OneOfAKind(effects.Effect):
    """An effect whose instances are all equal: `jax.export` writes an effect by its class
    and makes it again with `Class()`, which must give an equal one."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))


class TapEffect(_OneOfAKind):
    """Every tap's: an effect JAX keeps, and its dispatch ignores (see above)."""

    __str__ = lambda _: "tapd.tap"  # noqa: E731


class OrderedTapEffect(_OneOfAKind):
    """A strict tap's: JAX threads its runtime token through it."""

    __str__ = lambda _: "tapd.tap(ordered)"  # noqa: E731


class ProgramOrder(_OneOfAKind):
    """The order of a computation's taps inside it (tapd.emitter.program_order): an
    ordered effect whose token is made inside the computation, which JAX threads through
    every loop carry, branch and call as it threads its own, and which the
    computation's dispatch never sees. Set on the taps only as the computation lowers
    (TapSiteParams.chained), after every transformation."""

    __str__ = lambda _: "tapd.program_order"  # noqa: E731


UNORDERED = TapEffect()
ORDERED = OrderedTapEffect()
PROGRAM_ORDER = ProgramOrder()

for _effect_type in (TapEffect, OrderedTapEffect, ProgramOrder):
    effects.lowerable_effects.add_type(_effect_type)
    effects.control_flow_allowed_effects.add_type(_effect_type)
    effects.custom_derivatives_allowed_effects.add_type(_effect_type)
    effects.remat_allowed_effects.add_type(_effect_type)
    # Kept on the known side of partial evaluation: `grad` of a `scan` must not drop a
    # tap whose operand does not depend on the carry (JAX #16637).
    effects.partial_eval_kept_effects.add_type(_effect_type)
effects.ordered_effects.add_type(OrderedTapEffect)
effects.shardable_ordered_effects.add_type(OrderedTapEffect)
effects.ordered_effects.add_type(ProgramOrder)
effects.shardable_ordered_effects.add_type(ProgramOrder)


# What `jax.effects_barrier()` adds to JAX's own: the emitter's (lifecycle's) waits.
jax_compat.dispatch_ignores(TapEffect, lifecycle.after_jax_barrier)


@dataclasses.dataclass(frozen=True)
class TapSiteParams:
    """What is static about one tap site; hashable, so it can be a primitive parameter.

    `fields` is the msgpack of the site's tree, static metadata and shard layout (the
    protocol's form); `transforms` grow as JAX transforms the tap."""

    consumer: str
    fields: bytes
    transforms: tuple[Transform, ...] = ()
    has_step: bool = False
    has_coords: bool = False
    ordered: bool = True
    strict: bool = False
    like_jax_debug: bool = False  # tapd.debug's (tapping.as_jax_debug)
    chained: bool = False  # threads PROGRAM_ORDER's token (set as it lowers: program_order)

    @property
    def effects(self) -> set[effects.Effect]:
        """The site's JAX effects (see the module docstring)."""
        if self.strict and self.ordered:
            return jax_compat.tap_effects(ORDERED, UNORDERED)
        if self.chained and self.ordered:
            return {PROGRAM_ORDER, UNORDERED}
        return {UNORDERED}

    def decoded_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = msgpack.unpackb(self.fields, raw=False)
        return fields

    def wire_transforms(self) -> list[list[Any]]:
        """Transforms as the protocol carries them: `[name, params]` pairs."""
        return [
            [name, {} if dims is None else {"batch_dims": list(dims)}]
            for name, dims in self.transforms
        ]

    def site_fields(self) -> dict[str, Any]:
        """The protocol's site fields: tree, meta, shard (if any) and transforms."""
        return {**self.decoded_fields(), "transforms": self.wire_transforms()}

    @property
    def every(self) -> int:
        """The site's own sampling (`tap(..., every=K)`): copy executions seq % K == 0."""
        return int(self.decoded_fields().get("every", 1))

    @property
    def always(self) -> bool:
        """Never made dormant nor thinned by the daemon (id_tap's; TAPD_DORMANT=0)."""
        return bool(self.decoded_fields().get("always", False))

    def leaf_count(self, operand_count: int) -> int:
        return operand_count - self.has_step - self.has_coords


def pack_fields(fields: dict[str, Any]) -> bytes:
    packed: bytes = msgpack.packb(fields, use_bin_type=True)
    return packed


tap_p = core.Primitive("tapd_tap")
tap_p.multiple_results = True
dispatch.prim_requires_devices_during_lowering.add(tap_p)
tap_p.def_impl(lambda *operands, site: dispatch.apply_primitive(tap_p, *operands, site=site))


def bind(leaves: Sequence[Any], step: Any, coords: Any, site: TapSiteParams) -> list[Any]:
    """Tap `leaves` (with the step and shard coordinates, if any); returns the leaves."""
    operands = [*leaves]
    if site.has_step:
        operands.append(step)
    if site.has_coords:
        operands.append(coords)
    return tap_p.bind(*operands, site=site)  # type: ignore[no-any-return]


def _split(operands: Sequence[Any], site: TapSiteParams) -> tuple[list[Any], list[Any]]:
    count = site.leaf_count(len(operands))
    return list(operands[:count]), list(operands[count:])


@tap_p.def_effectful_abstract_eval
def _abstract_eval(
    *avals: core.AbstractValue, site: TapSiteParams
) -> tuple[list[core.AbstractValue], set[effects.Effect]]:
    leaves, _ = _split(avals, site)
    return leaves, site.effects


def _partial_eval_custom(
    saveable: Any, unknowns_in: Sequence[bool], instantiated_in: Sequence[bool], eqn: Any
) -> Any:
    """Partial evaluation under `jax.checkpoint` (and the loops' own rules).

    A tap of known values runs once, on the known side, and its outputs are saved: what
    JAX does for any effectful equation (host_callback's taps ran twice there; tapping
    again would double-count steps). A tapd.debug site follows `jax.debug.callback`'s
    rule instead: staged again, to run when the values are recomputed, unless the
    policy saves it and some of its operands are not at hand. A tap of unknown values
    (a tangent's) is staged whole."""
    count = len(eqn.outvars)
    not_at_hand = [
        var
        for var, instantiated in zip(eqn.invars, instantiated_in, strict=True)
        if isinstance(var, core.Var) and not instantiated
    ]
    if any(unknowns_in):
        return None, eqn, [True] * count, [True] * count, not_at_hand
    site: TapSiteParams = eqn.params["site"]
    if site.like_jax_debug:
        saved = saveable(tap_p, *[var.aval for var in eqn.invars], **eqn.params)
        if not saved or all(instantiated_in):
            return eqn, eqn, [False] * count, [True] * count, not_at_hand
    return eqn, None, [False] * count, [False] * count, []


pe.partial_eval_jaxpr_custom_rules[tap_p] = _partial_eval_custom


def _jvp(
    primals: Sequence[Any], tangents: Sequence[Any], *, site: TapSiteParams
) -> tuple[list[Any], list[Any]]:
    # Tap the primal values only (host_callback did the same); tangents pass through.
    leaf_tangents, _ = _split(tangents, site)
    return tap_p.bind(*primals, site=site), leaf_tangents


ad.primitive_jvps[tap_p] = _jvp


def _transpose(cotangents: Sequence[Any], *operands: Any, site: TapSiteParams) -> list[Any]:
    """A tap of a linear value (a tangent) becomes a tap of its cotangent."""
    _, rest = _split(operands, site)
    if any(ad.is_undefined_primal(value) for value in rest):
        raise TapDefinitionError(f"tap {site.consumer!r}: its step must not be differentiated")
    # Zero cotangents become real zeros: the tap shows what host_callback showed.
    cts = [ad.instantiate_zeros(ct) for ct in cotangents]
    transposed = dataclasses.replace(site, transforms=(*site.transforms, ("transpose", None)))
    tapped = tap_p.bind(*cts, *rest, site=transposed)
    return [*tapped, *([None] * len(rest))]


ad.primitive_transposes[tap_p] = _transpose


def _batch(
    operands: Sequence[Any], dims: Sequence[int | None], *, site: TapSiteParams
) -> tuple[list[Any], list[int | None]]:
    leaves, _ = _split(operands, site)
    leaf_dims, rest_dims = _split(dims, site)
    if any(_mapped(dim) for dim in rest_dims):
        raise TapDefinitionError(
            f"tap {site.consumer!r}: its step (or shard coordinates) vary along a vmapped "
            "axis; tap the step as part of the value instead"
        )
    batch_dims = tuple(int(dim) if _mapped(dim) else None for dim in leaf_dims)
    fields = site.decoded_fields()
    if "shard" in fields:  # a batched leaf's block and global value gain the batch dim
        shard = fields["shard"]
        size = next(
            leaf.shape[dim] for leaf, dim in zip(leaves, batch_dims, strict=True) if dim is not None
        )
        shard["layout"] = [
            [[*shape[:dim], size, *shape[dim:]], [*dims_[:dim], [], *dims_[dim:]]]
            if dim is not None
            else [shape, dims_]
            for (shape, dims_), dim in zip(shard["layout"], batch_dims, strict=True)
        ]
    batched = dataclasses.replace(
        site, fields=pack_fields(fields), transforms=(*site.transforms, ("batch", batch_dims))
    )
    return tap_p.bind(*operands, site=batched), list(leaf_dims)


batching.primitive_batchers[tap_p] = _batch


def _mapped(dim: Any) -> bool:
    return dim is not None and not isinstance(dim, batching.NotMapped)


def leaf_descriptions(avals: Sequence[Any]) -> list[list[Any]]:
    """[dtype name, shape, nbytes] of each leaf, as the sites file records them."""
    from tapd.protocol.dtypes import dtype_name

    return [
        [
            dtype_name(np.dtype(aval.dtype)),
            list(aval.shape),
            int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize,
        ]
        for aval in avals
    ]


def register_lowering(rule: Any) -> None:
    jax_compat.register_lowering(tap_p, rule)


# ---- while loops whose condition taps, under vmap ------------------------------------


def _has_tap(closed_jaxpr: Any) -> bool:
    """Whether the jaxpr taps other than as an unordered jax.debug callback (which JAX
    evaluates twice an iteration in a batched condition, and tapd.debug with it)."""
    if not any(isinstance(e, (TapEffect, OrderedTapEffect)) for e in closed_jaxpr.effects):
        return False
    return _taps_as_host_callback(closed_jaxpr.jaxpr)


def _taps_as_host_callback(jaxpr: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is tap_p:
            site: TapSiteParams = eqn.params["site"]
            if not (site.like_jax_debug and not site.ordered):
                return True
    return any(_taps_as_host_callback(sub) for sub in core.subjaxprs(jaxpr))


def _install_while_batching() -> None:
    """Batch a `while_loop` whose condition taps as host_callback did: the condition is
    evaluated once per iteration, on the carry the iteration produced.

    JAX batches a loop with a batched predicate by evaluating the condition twice per
    iteration (once to decide whether to go on, once to select the lanes that go on),
    which taps twice; and its lowering of an ordered effect in a condition runs the body
    on every lane without selecting (wrong values). So, before batching, such a loop is
    rewritten into the equivalent loop that carries its predicate: `p = cond(c); while p:
    c = body(c); p = cond(c)`. Its condition only reads `p`; the taps are in the body."""
    from jax import lax
    from jax._src.lax.control_flow import loops

    original = batching.fancy_primitive_batchers[loops.while_p]

    def batch_while(
        axis_data: Any, args: Sequence[Any], dims: Sequence[Any], **params: Any
    ) -> tuple[Any, Any]:
        cond_jaxpr, body_jaxpr = params["cond_jaxpr"], params["body_jaxpr"]
        if not _has_tap(cond_jaxpr):
            result: tuple[Any, Any] = original(axis_data, args, dims, **params)
            return result
        cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
        cond = core.jaxpr_as_fun(cond_jaxpr)
        body = core.jaxpr_as_fun(body_jaxpr)

        def carrying_predicate(*operands: Any) -> list[Any]:
            cond_consts = operands[:cond_nconsts]
            body_consts = operands[cond_nconsts : cond_nconsts + body_nconsts]
            carry = tuple(operands[cond_nconsts + body_nconsts :])

            def step(state: tuple[Any, tuple[Any, ...]]) -> tuple[Any, tuple[Any, ...]]:
                new_carry = tuple(body(*body_consts, *state[1]))
                return cond(*cond_consts, *new_carry)[0], new_carry

            first = cond(*cond_consts, *carry)[0]
            return list(lax.while_loop(lambda state: state[0], step, (first, carry))[1])

        import jax

        outs = jax.vmap(
            carrying_predicate,
            in_axes=[None if not _mapped(dim) else dim for dim in dims],
            axis_size=axis_data.size,
            axis_name=axis_data.name,
            spmd_axis_name=axis_data.spmd_name,
        )(*args)
        return outs, [0] * len(outs)

    batching.fancy_primitive_batchers[loops.while_p] = batch_while


_install_while_batching()
