"""One walk for the rewrites tapd makes to a computation as it lowers: each equation
offered to a subclass (`eqn`), and the jaxprs an equation holds in its parameters (a
`Jaxpr`, a `ClosedJaxpr`, tuples, lists and named tuples of them) rewritten in turn.
`tapd.emitter.program_order` marks ordered taps with it, `tapd.emitter.gathered.slices`
gathers shard_map bodies."""

from __future__ import annotations

from typing import Any

from jax._src import core


class JaxprRewrite:
    """Each jaxpr rewritten once, however many equations hold it (a nested `jit` called
    twice stays one function in the module); what nothing changed is returned as it
    came, the same object."""

    def __init__(self) -> None:
        self._done: dict[int, tuple[Any, Any]] = {}  # id(jaxpr) -> (jaxpr, its rewrite)

    def eqn(self, eqn: Any) -> Any:
        """`eqn` rewritten (itself if unchanged); by default, its jaxprs' (`params`)."""
        params = self.params(eqn)
        return eqn if params is None else eqn.replace(params=params)

    def rebuilt(self, jaxpr: Any, eqns: list[Any]) -> Any:
        """`jaxpr` with `eqns`, some of them rewritten."""
        return jaxpr.replace(eqns=eqns)

    def jaxpr(self, jaxpr: Any) -> Any:
        """`jaxpr` (a core.Jaxpr) rewritten; `jaxpr` itself if nothing in it changed."""
        known = self._done.get(id(jaxpr))
        if known is not None:
            return known[1]
        eqns = [self.eqn(eqn) for eqn in jaxpr.eqns]
        changed = any(new is not old for new, old in zip(eqns, jaxpr.eqns, strict=True))
        result = self.rebuilt(jaxpr, eqns) if changed else jaxpr
        self._done[id(jaxpr)] = (jaxpr, result)  # (keeps jaxpr alive: its id stays its own)
        return result

    def params(self, eqn: Any) -> dict[str, Any] | None:
        """`eqn`'s parameters with the jaxprs in them rewritten; None if none changed."""
        params = {name: self.value(value) for name, value in eqn.params.items()}
        if all(params[name] is value for name, value in eqn.params.items()):
            return None
        return params

    def value(self, value: Any) -> Any:
        """A parameter of an equation, with the jaxprs in it rewritten."""
        if isinstance(value, core.Jaxpr):
            return self.jaxpr(value)
        closed_type = getattr(core, "ClosedJaxpr", None)
        if closed_type is not None and isinstance(value, closed_type):
            rewritten = self.jaxpr(value.jaxpr)
            return value if rewritten is value.jaxpr else value.replace(jaxpr=rewritten)
        if isinstance(value, (tuple, list)):
            items = [self.value(item) for item in value]
            if all(new is old for new, old in zip(items, value, strict=True)):
                return value
            if hasattr(value, "_make"):  # a named tuple (custom_linear_solve's jaxprs)
                return value._make(items)
            return type(value)(items)
        return value
