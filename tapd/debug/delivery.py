"""The receiver side of `tapd.debug`: from a tap back to `jax.debug`'s calls.

A `tapd.debug.callback` or `tapd.debug.print` site taps its dynamic arguments (the
array leaves) once per execution; tapd's receiver thread in this process hands each tap
to a `Delivery`, which makes from it the calls `jax.debug` would have made:

- under `vmap` the tap carries the whole batch, and `("batch", dims)` among its
  transforms, where `jax.debug` unrolls the batch into one call per element. Delivery
  unrolls it the same way, in the same order: with nested `vmap`s the innermost
  mapped axis varies slowest, as JAX's batching rule unrolls it (each unrolled call of
  the inner rule is then unrolled by the outer one);
- a tap of a cotangent (`"transpose"`, a tap inside the linear part of a `grad`) is
  dropped: `jax.debug`'s transpose rule calls nothing;
- each leaf becomes a `jax.Array` on the first CPU device, as `jax.debug.callback`
  hands it (numpy arrays where this process has no CPU backend); for a call run
  eagerly, weakly typed where the value was (a Python scalar's) and a PRNG key its
  typed key again, as JAX hands those on (a staged call gets what the computation's
  buffers hold: no weak type, key data); the static arguments (strings, None, objects)
  go back in their places;
- the call runs with the CPU device as JAX's default device, as `jax.debug`'s does.

`PrintSite` formats as `jax.debug.print` does (its `_format_print_callback`): `fmt.format`
under the numpy print options of trace time, or the arguments joined after a format
without placeholders, written to `sys.stdout` (or handed to the `jax._src.debugging`
logger, for `jax.debug.log`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from tapd.emitter import jax_compat
from tapd.emitter.local.functions import CallsByRun, describe
from tapd.errors import BarrierTimeout

# jax.debug.print's logger (jax.debug.log hands its records to it).
_JAX_LOGGER = logging.getLogger("jax._src.debugging")


def merge(in_tree: Any, dynamic: Sequence[Any], static: dict[int, Any]) -> tuple[Any, Any]:
    """(args, kwargs) from the flat dynamic leaves and the static ones, by position (as
    `jax._src.debugging.merge_callback_args` does)."""
    leaves: list[Any] = []
    values = iter(dynamic)
    for index in range(len(static) + len(dynamic)):
        leaves.append(static[index] if index in static else next(values))
    args, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
    return args, kwargs


class CallbackSite:
    """One `tapd.debug.callback` site: the function and what is static about its call."""

    def __init__(self, callback: Callable[..., Any], in_tree: Any, static: dict[int, Any]):
        self.callback = callback
        self.in_tree = in_tree
        self.static = dict(static)
        self.name = describe(callback)
        # f(x, y), every argument an array, no keywords: most calls, which need no merge
        self.flat = not static and in_tree == jax.tree_util.tree_structure(
            ((0,) * in_tree.num_leaves, {})
        )

    def run(self, dynamic: Sequence[Any]) -> None:
        if self.flat:
            self.callback(*dynamic)
            return
        args, kwargs = merge(self.in_tree, dynamic, self.static)
        self.callback(*args, **kwargs)


class PrintSite:
    """One `tapd.debug.print` site: the format, the numpy print options of trace time,
    and the logging record of `jax.debug.log` (None: stdout)."""

    name = "jax.debug.print"

    def __init__(
        self,
        fmt: str,
        printoptions: dict[str, Any],
        has_placeholders: bool,
        record: logging.LogRecord | None,
        in_tree: Any,
        static: dict[int, Any],
    ) -> None:
        self.fmt = fmt
        self.printoptions = printoptions
        self.has_placeholders = has_placeholders
        self.record = record
        self.in_tree = in_tree
        self.static = dict(static)

    def run(self, dynamic: Sequence[Any]) -> None:
        args, kwargs = merge(self.in_tree, dynamic, self.static)
        if self.has_placeholders:
            with np.printoptions(**self.printoptions):
                text = self.fmt.format(*args, **kwargs)
        else:
            assert not kwargs, "Format without placeholders should not have kwargs."
            text = " ".join((self.fmt, *(str(arg) for arg in args)))
        if self.record is not None:
            record = copy.copy(self.record)
            record.msg = text
            _JAX_LOGGER.handle(record)
        else:
            sys.stdout.write(text + "\n")


Site = CallbackSite | PrintSite


@dataclasses.dataclass(frozen=True)
class LeafTypes:
    """What the tap does not carry of the leaves' types: which were typed PRNG keys (by
    index: their implementation) and which were weakly typed."""

    key_impls: dict[int, Any] = dataclasses.field(default_factory=dict)
    weak: frozenset[int] = frozenset()


class Delivery(CallsByRun):
    """The local tap function of one site: (value, transforms) -> the site's calls.
    Named after the callback, so that a failure at `barrier_wait` says which."""

    def __init__(self, site: Site, types: LeafTypes) -> None:
        self.site = site
        self.types = types
        self.__qualname__ = site.name

    def __call__(self, value: Any, transforms: Any, **_: Any) -> None:
        deliver(self.site, list(value), transforms, self.types)

    def calls(self, transforms: Any) -> contextlib.AbstractContextManager[Callable[[Any], None]]:
        """For a run of this site's taps with the same `transforms` (tapd's receiver
        runs a site's taps by runs): a function of one tap's value that makes its calls,
        with what the run's taps share looked up once (the receiver's cost per call of
        a `tapd.debug` site in a hot step, bench/RESULTS.md §10 (b))."""
        return calls(self.site, transforms, self.types)


def deliver(site: Site, leaves: list[Any], transforms: Any, types: LeafTypes) -> None:
    """Make the calls `jax.debug` makes for one tap of `site`."""
    with calls(site, transforms, types) as call:
        call(leaves)


@contextlib.contextmanager
def calls(site: Site, transforms: Any, types: LeafTypes) -> Iterator[Callable[[Any], None]]:
    """A function of a tap's leaves that makes `site`'s calls for it, for taps with
    these `transforms`; the calls run with the CPU device as JAX's default device."""
    batch_dims: list[Sequence[int | None]] = []
    for name, params in transforms:
        if name == "transpose":  # jax.debug's transpose rule calls nothing
            yield _no_calls
            return
        if name == "batch":
            batch_dims.append(params["batch_dims"])
    run, device = site.run, _cpu_device()
    if device is None:  # no CPU backend here: numpy arrays

        def call_numpy(leaves: Any) -> None:
            for element in unbatched([np.asarray(leaf) for leaf in leaves], batch_dims):
                run(element)

        yield call_numpy
        return
    put, weak, key_impls = jax_compat.cpu_putter(device), types.weak, types.key_impls
    put_like: Callable[[list[Any]], list[Any]] | None = None

    def call_plain(leaves: Any) -> None:  # no vmap, no typed key: most sites
        # A run's taps are of one site: the first one's leaves give every put's types.
        nonlocal put_like
        if put_like is None:
            put_like = jax_compat.cpu_putter_like(device, leaves, weak)
        run(put_like(leaves))

    def call(leaves: Any) -> None:
        for element in unbatched([np.asarray(leaf) for leaf in leaves], batch_dims):
            arrays = put(element, weak)
            for index, impl in key_impls.items():
                arrays[index] = jax.random.wrap_key_data(arrays[index], impl=impl)
            run(arrays)

    with jax.default_device(device):
        yield call if batch_dims or key_impls else call_plain


def _no_calls(leaves: Any) -> None:
    return None


def unbatched(leaves: list[Any], batch_dims: Sequence[Sequence[int | None]]) -> list[list[Any]]:
    """The per-element leaves of a batched tap, in the order `jax.debug` calls them.

    `batch_dims` lists the tap's `vmap`s innermost first; each one's dims index the
    value with the dims of the `vmap`s outside it removed. An unmapped leaf (None) is
    the same in every element."""
    if not batch_dims:
        return [leaves]
    *inner, outer = batch_dims
    size = next(
        (leaf.shape[dim] for leaf, dim in zip(leaves, outer, strict=True) if dim is not None), 1
    )
    per_index = [
        unbatched(
            [
                leaf if dim is None else np.take(leaf, index, axis=dim)
                for leaf, dim in zip(leaves, outer, strict=True)
            ],
            inner,
        )
        for index in range(size)
    ]
    if not per_index:
        return []
    # The inner vmaps' elements vary slowest, this (outer) one's index fastest.
    return [per_index[i][k] for k in range(len(per_index[0])) for i in range(size)]


@functools.cache
def _cpu_device() -> Any:
    """The first CPU device (where jax.debug puts a callback's arguments), or None."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


@dataclasses.dataclass
class EagerCall:
    """A call run eagerly (outside any jit): JAX has made it by the time it returns, and
    raises what the callback raised, so its caller waits for this."""

    site: Site
    types: LeafTypes
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise BarrierTimeout(
                f"{self.site.name} (called outside jit) was not run by tapd's receiver "
                f"within {timeout:g} s: a callback before it still runs, or the tapd "
                "daemon does not answer (`tapd status`)"
            )
        if self.error is not None:
            raise self.error


class EagerDeliveries:
    """The local tap function of every call run eagerly (outside jit, through `grad` or
    `vmap` too): the first leaf is a ticket naming the call, taken from here when it is
    delivered. One site (and one compiled tap) per number of leaves serves them all,
    where a site per call would compile a tap per call. What the callback raises goes
    to the caller waiting for it, as JAX raises it there."""

    __qualname__ = "tapd.debug call outside jit"

    def __init__(self) -> None:
        self._calls: dict[int, EagerCall] = {}
        self._next = 0
        self._lock = threading.Lock()

    def ticket(self, call: EagerCall) -> int:
        with self._lock:
            ticket = self._next
            self._next = (self._next + 1) % _TICKETS
            self._calls[ticket] = call
            return ticket

    def __call__(self, value: Any, transforms: Any, **_: Any) -> None:
        ticket, *leaves = value
        with self._lock:
            call = self._calls.pop(int(np.asarray(ticket)))
        # The ticket is the first leaf, unbatched: the value's batch dims without it.
        transforms = [
            (
                name,
                {**params, "batch_dims": params["batch_dims"][1:]} if name == "batch" else params,
            )
            for name, params in transforms
        ]
        try:
            deliver(call.site, leaves, transforms, call.types)
        except Exception as exc:
            _JAX_LOGGER.error("jax.debug.callback failed", exc_info=exc)  # as JAX logs it
            call.error = exc
        finally:
            call.done.set()


_TICKETS = 2**31  # tickets travel as int32
