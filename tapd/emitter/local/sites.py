"""The local ring's tap functions and sites: the consumer name a computation gives each
function of this process, and each site's id in the ring, made at trace time; the
receiver looks records up here by them (tapd.emitter.local.runner)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax
import msgpack

from tapd.emitter.local.functions import LOCAL_PREFIX, MAX_QUALNAME, LocalFunction, describe
from tapd.native.sites import Site
from tapd.protocol.message import StaticEntry
from tapd.protocol.schema import check_batch_static


class LocalSites:
    """The functions and sites of one local ring. `prefix` starts each of its consumer
    names (`local/<host>:<pid>/<tag>/`); `identity` is what a site's taps say of this
    process (process, host, pid, emitter)."""

    def __init__(self, prefix: str, identity: dict[str, Any]) -> None:
        self.prefix = prefix
        self._identity = identity
        self._lock = threading.Lock()
        self.functions: dict[str, LocalFunction] = {}  # by consumer name
        self._names: dict[tuple[int, Any], tuple[Callable[..., Any], str]] = {}
        self._named: collections.Counter[str] = collections.Counter()
        self._site_keys: dict[tuple[str, bytes], int] = {}
        # By site id; only appended to (under the lock), so a reader may hold the list.
        self.entries: list[tuple[Site, StaticEntry]] = []
        self._consumer_ids: dict[str, int] = {}

    def consumer(self, function: Callable[..., Any], treedef: Any) -> str:
        """The consumer name of a site whose function runs here: the same for the same
        function and tree. The function is kept for the life of the process, as
        host_callback kept it."""
        key = (id(function), treedef)
        with self._lock:
            known = self._names.get(key)
            if known is not None:
                return known[1]
            shown = describe(function)[:MAX_QUALNAME]
            # (numbered among the functions of that name: the same in every run of a
            # program, whatever else it traced first; see entry_name)
            name = f"{self.prefix}{self._named[shown]}/{shown}"
            self._named[shown] += 1
            flat = treedef == jax.tree_util.tree_structure((0,) * treedef.num_leaves)
            leaf = treedef.num_nodes == 1 and treedef.num_leaves == 1
            self.functions[name] = LocalFunction(function, treedef, flat, describe(function), leaf)
            self._names[key] = (function, name)  # keeps the function, so its id stays unique
            return name

    def entry_name(self, consumer: str) -> str:
        """The name a computation's custom call gives a local consumer: `consumer`
        without this process's part (host, pid, a random tag), so that a program traced
        again in another process lowers to the same module, which JAX's persistent
        compilation cache then serves (the entry is put into this process's ring as it
        lowers; no other process resolves it: tapd.emitter.entries)."""
        assert self.owns(consumer)
        return LOCAL_PREFIX + consumer[len(self.prefix) :]

    def owns(self, consumer: str) -> bool:
        """Whether `consumer` names a function of this local ring."""
        return consumer.startswith(self.prefix)

    def register_site(self, consumer: str, fields: dict[str, Any], leaves: list[Any]) -> int:
        """The id of this tap site in the local ring (the same for the same site)."""
        entry = {"consumer": consumer, **fields, "leaves": leaves}
        key = (consumer, msgpack.packb(entry, use_bin_type=True))
        with self._lock:
            site_id = self._site_keys.get(key)
            if site_id is None:
                site = Site(entry, self._identity)
                entries = self.entries
                static = StaticEntry(
                    site.batch_static, check_batch_static(len(entries), site.batch_static)
                )
                site_id = self._site_keys[key] = len(entries)
                entries.append((site, static))
                self._consumer_ids.setdefault(consumer, len(self._consumer_ids))
            return site_id

    def consumer_id(self, consumer: str) -> int:
        with self._lock:
            return self._consumer_ids[consumer]

    def registered(self) -> list[tuple[Site, StaticEntry]]:
        """The sites registered so far, by id (the list itself: it only grows)."""
        with self._lock:
            return self.entries
