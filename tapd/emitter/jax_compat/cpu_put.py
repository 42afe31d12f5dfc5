"""numpy leaves made CPU `jax.Array`s as `jax.debug.callback` hands its arguments, with
jaxlib's put under `pxla.batched_device_put` (0.8.0 to 0.12) where this JAX has it, and
`jax.device_put` where its internals differ (tapd.debug.delivery). Importing this module
does not import JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def cpu_putter(device: Any) -> Callable[[list[Any], frozenset[int]], list[Any]]:
    """A function of (leaves, weak) that makes `leaves` (numpy arrays) committed
    jax.Arrays on CPU `device`, those at the indices `weak` weakly typed, as
    `jax.debug.callback` hands its arguments. Made once for a run of calls.

    `jax.device_put` costs ~27-45 µs a leaf here, most of it Python around one C++
    call; that call (~3 µs, twice that beside a dispatching thread) is what a
    `tapd.debug` call per step pays on the receiver thread, beside the step, under one
    GIL. Where this JAX's internals differ: `jax.device_put`, then the weak type where
    it can be given."""
    try:
        put = _device_putter()
        sharding = _single_device_sharding(device)
    except Exception:
        return functools.partial(_put_by_jax, device)
    devices = [device]

    def put_leaves(leaves: list[Any], weak: frozenset[int]) -> list[Any]:
        try:
            return [
                put(_aval(leaf.shape, leaf.dtype, index in weak), sharding, [leaf], devices, True)
                for index, leaf in enumerate(leaves)
            ]
        except Exception:
            return _put_by_jax(device, leaves, weak)

    return put_leaves


def cpu_putter_like(
    device: Any, like: list[Any], weak: frozenset[int]
) -> Callable[[list[Any]], list[Any]]:
    """`cpu_putter(device)` for leaves of the shapes and dtypes of `like` (numpy arrays),
    as every tap of a run of one site has them: their avals made once, and no Python
    between a leaf and its put but a list's (~1 µs a call of a one-leaf site: a fifth of
    the receiver's work for a `tapd.debug.callback`, bench/RESULTS.md §10 (b)). The put
    does not check the leaves against the avals: they must be of `like`'s types."""
    import numpy as np

    if not all(type(leaf) is np.ndarray for leaf in like):
        general = cpu_putter(device)
        return lambda leaves: general([np.asarray(leaf) for leaf in leaves], weak)
    try:
        put = _device_putter()
        sharding = _single_device_sharding(device)
        avals = [_aval(leaf.shape, leaf.dtype, index in weak) for index, leaf in enumerate(like)]
    except Exception:
        return lambda leaves: _put_by_jax(device, leaves, weak)
    devices = [device]
    if len(avals) == 1:
        (aval,) = avals

        def put_one(leaves: list[Any]) -> list[Any]:
            try:
                return [put(aval, sharding, leaves, devices, True)]
            except Exception:
                return _put_by_jax(device, leaves, weak)

        return put_one

    def put_each(leaves: list[Any]) -> list[Any]:
        try:
            return [
                put(aval, sharding, [leaf], devices, True)
                for aval, leaf in zip(avals, leaves, strict=True)
            ]
        except Exception:
            return _put_by_jax(device, leaves, weak)

    return put_each


def _put_by_jax(device: Any, leaves: list[Any], weak: frozenset[int]) -> list[Any]:
    import jax

    arrays = list(jax.device_put(leaves, device))
    for index in weak:
        arrays[index] = _weakly_typed(arrays[index])
    return arrays


@functools.cache
def _device_putter() -> Callable[..., Any]:
    """jaxlib's call under `pxla.batched_device_put` (0.8.0 to 0.12): (aval, sharding,
    shards, devices, committed). The Python around it only looks for jax.Arrays among
    the shards, and ours are numpy arrays (~0.8 µs a leaf saved)."""
    from jaxlib import xla_client

    put: Callable[..., Any] = xla_client.batched_device_put
    return put


@functools.cache
def _single_device_sharding(device: Any) -> Any:
    from tapd.emitter.jax_compat.calls import single_device_sharding

    return single_device_sharding(device)


@functools.lru_cache(maxsize=1024)
def _aval(shape: tuple[int, ...], dtype: Any, weak_type: bool) -> Any:
    from jax._src import core

    return core.ShapedArray(shape, dtype, weak_type=weak_type)


def _weakly_typed(array: Any) -> Any:
    """`array` as the weakly typed jax.Array JAX gives for a Python scalar (the same
    buffer); `array` itself if this JAX's internals differ."""
    try:
        from jax._src import array as jax_array
        from jax._src import core

        aval = core.ShapedArray(array.shape, array.dtype, weak_type=True)
        return jax_array.ArrayImpl(aval, array.sharding, array._arrays, committed=array._committed)
    except Exception:
        return array
