"""Tap functions that run in the emitting process, fed by the daemon: fallbacks.

host_callback ran every tap function in the JAX process, and most code relies on it:
`id_tap(lambda a, t: pbar.update(1), x)` drives a tqdm bar, a closure calls `wandb.log`,
a bound method updates its object. Such a function cannot move to another process, so
tapd runs it here. Two kinds of consumer do:

- **local**: a lambda, closure, bound method, callable object, a function of `__main__`,
  or a `functools.partial` whose arguments cannot travel as metadata. Its taps never
  leave the process: they go to its local ring, drained by its own receiver thread,
  with no daemon (tapd/emitter/local/path.py; `lifecycle.local_consumer` names the
  site). Only where tapd's native library does not load is there no local ring: then
  the daemon feeds them back to the receiver here, under the consumer name
  `local/<host>:<pid>/<token>/<n>/<qualname>` whose prefix it subscribed to first.
- **fallback**: an importable function `mymodule:f` (or a partial of one whose keywords
  msgpack can carry). A subscriber process (`tapd subscribe mymodule`) takes its taps
  when there is one; otherwise the daemon hands them to this process's receiver, which
  runs the function here, as host_callback would have (docs/PROTOCOL.md, "hello": the
  daemon routes to a fallback only the taps of its own emitter that no other subscriber
  takes; a `*` watcher such as `tapd tail '*'` or a forwarder takes nobody's place).
  The fallback is subscribed, and confirmed, before the id_tap that needs it returns.
  `TAPD_LOCAL_FALLBACK=0` turns fallbacks off: importable functions then run only where
  a subscriber takes them (e.g. on another host, behind a forwarding daemon).

This receiver (a `tapd_client.Subscriber` on one thread; `lifecycle.fallback_receiver`
makes this process's) connects to the emitter's daemon when the first id_tap that needs
it is traced, and waits for the daemon to confirm (at most `TAPD_CONNECT_TIMEOUT`
seconds, default 10): without a daemon such a function cannot run, and that id_tap
raises `TapDefinitionError` saying so. At exit the
receiver stays up while the emitter drains, then says goodbye. The step never waits for
it, the taps of this process reach it in program order, `barrier_wait` waits for it, and
what it raises makes `barrier_wait` raise `CallbackException`.

Functions here get numpy arrays, and `device=` as a `jax.Device`, as host_callback gave
them. They must not call JAX on the arrays (use numpy): under the `block` policy a
computation may be waiting on the receiver.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

import jax

from tapd.emitter.local import threads
from tapd.emitter.local.functions import MAX_QUALNAME, Named, describe, rebuild
from tapd.errors import DaemonUnreachable, TapDefinitionError
from tapd.settings import CONNECT_TIMEOUT, LOCAL_FALLBACK
from tapd_client.meta import TapMeta
from tapd_client.subscriber import Subscriber
from tapd_client.tap_functions import resolve, tap_function_keywords

logger = logging.getLogger("tapd.emitter")

_HEARTBEAT = 0.2  # s; the receiver also looks for new subscriptions this often / 2


def fallback_enabled() -> bool:
    """Whether importable tap functions that no subscriber takes run here
    (`TAPD_LOCAL_FALLBACK`, default on)."""
    return bool(LOCAL_FALLBACK.value())


def connect_timeout() -> float:
    """How long a receiver waits for the daemon to confirm it (`TAPD_CONNECT_TIMEOUT`)."""
    return float(CONNECT_TIMEOUT.value())


@dataclasses.dataclass(frozen=True)
class _LocalSite:
    function: Callable[..., Any]
    treedef: Any  # jax.tree_util.PyTreeDef of the tapped value
    flat: bool  # a tuple of leaves, which the wire's tuple already is (no rebuild)


@dataclasses.dataclass
class _Request:
    """A fallback consumer the receiver thread is to subscribe to."""

    consumer: str
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: BaseException | None = None


class FallbackReceiver:
    """This process's receiver of the taps a daemon feeds it: one `Subscriber`, run by
    one thread."""

    def __init__(self, endpoint: str, emitter: str, timeout: float) -> None:
        self.emitter = emitter  # "host:pid": how the daemon names this process's emitter
        self.prefix = f"local/{emitter}/{secrets.token_hex(4)}/"
        self.timeout = timeout
        self._subscriber = Subscriber(
            endpoint,
            name=f"tapd receiver of {emitter}",
            heartbeat=_HEARTBEAT,
            fallback_for=emitter,
        )
        self._subscriber.add_handler(self.prefix + "*", Named(self._run_local, "tap function"))
        self._sites: dict[str, _LocalSite] = {}
        self._names: dict[tuple[int, Any], tuple[Callable[..., Any], str]] = {}
        self._numbers = itertools.count()
        self._fallbacks: set[str] = set()
        self._pending: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._devices = {
            int(d.local_hardware_id): d
            for d in jax.local_devices()
            if d.local_hardware_id is not None
        }
        self._last_exception: BaseException | None = None
        self._closing = False
        self._connected = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="tapd-receiver", daemon=True)
        threads.add(self._thread)

    # ---- called by id_tap, at trace time ---------------------------------------------

    def start(self) -> None:
        """Connect; return once the daemon has confirmed the subscription."""
        self._thread.start()
        self._connected.wait(self.timeout + 5)
        if isinstance(self._failure, DaemonUnreachable):  # none, and none was started
            raise TapDefinitionError(
                f"tapd runs this process's own tap functions on a receiver that a daemon "
                f"feeds: {self._failure}"
            ) from self._failure
        if self._failure is not None or not self._connected.is_set():
            # A connect that answers later must not leave a subscribed receiver behind,
            # one that no exit drain closes: the thread stops as soon as it connects.
            self._closing = True
            self._subscriber.stop()
            raise TapDefinitionError(
                f"tapd runs this process's own tap functions (lambdas, closures, bound "
                f"methods, and importable functions no subscriber takes) on a receiver "
                f"that the daemon at {self._subscriber.endpoint} feeds, and that daemon did "
                f"not answer within {self.timeout:g} s: start it with `tapd start "
                f"--detach` ({self._failure or 'no answer'})"
            )

    def local(self, function: Callable[..., Any], treedef: Any) -> str:
        """The consumer name of a tap site whose function runs here; the same name for
        the same function and tree."""
        key = (id(function), treedef)
        with self._lock:
            known = self._names.get(key)
            if known is not None:
                return known[1]
            shown = describe(function)[:MAX_QUALNAME]
            name = f"{self.prefix}{next(self._numbers)}/{shown}"
            flat = treedef == jax.tree_util.tree_structure((0,) * treedef.num_leaves)
            self._sites[name] = _LocalSite(function, treedef, flat)
            self._names[key] = (function, name)  # keeps the function, so its id stays unique
            return name

    def fallback(self, consumer: str) -> None:
        """Subscribe as the fallback of importable consumer `consumer`; return once the
        daemon has confirmed it."""
        if threading.current_thread() is self._thread:
            raise TapDefinitionError(f"id_tap({consumer}) traced inside a tap function")
        with self._lock:
            if consumer in self._fallbacks:
                return
            request = self._pending.get(consumer)
            if request is None:
                request = self._pending[consumer] = _Request(consumer)
        if not request.done.wait(self.timeout + 5) or request.error is not None:
            raise TapDefinitionError(
                f"could not subscribe this process as the fallback of tap function "
                f"{consumer!r} at the daemon {self._subscriber.endpoint}: "
                f"{request.error or 'no answer'}"
            )

    def take_exception(self) -> BaseException | None:
        """The last exception a tap function raised here since the last call."""
        with self._lock:
            exc, self._last_exception = self._last_exception, None
            return exc

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, which acknowledges what it handled and says goodbye."""
        self._closing = True
        self._subscriber.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the receiver thread ---------------------------------------------------------

    def _serve(self) -> None:
        subscriber = self._subscriber
        try:
            subscriber.connect(self.timeout)
        except Exception as exc:
            self._failure = exc
            self._connected.set()
            subscriber.close()
            return
        self._connected.set()
        try:
            while not self._closing:  # (closing already: `start` gave up waiting)
                subscriber.run(until=lambda: self._closing or bool(self._pending))
                self._subscribe_pending()
        except Exception:
            logger.exception(
                "tapd receiver thread failed; this process's tap functions no longer run"
            )
        finally:
            subscriber.close()

    def _subscribe_pending(self) -> None:
        with self._lock:
            requests = list(self._pending.values())
        for request in requests:
            try:
                if request.consumer not in self._subscriber.consumers:
                    handler = Named(self._run_fallback, request.consumer)
                    self._subscriber.subscribe(
                        request.consumer, handler, fallback=True, timeout=self.timeout
                    )
            except Exception as exc:
                request.error = exc
            with self._lock:
                self._pending.pop(request.consumer, None)
                if request.error is None:
                    self._fallbacks.add(request.consumer)
            request.done.set()

    def _run_local(self, value: Any, meta: TapMeta) -> None:
        site = self._sites[meta.consumer]
        arg = value if site.flat and type(value) is tuple else rebuild(site.treedef, value)
        self._call(site.function, arg, meta)

    def _run_fallback(self, value: Any, meta: TapMeta) -> None:
        self._call(resolve(meta.consumer), value, meta)

    def _call(self, function: Callable[..., Any], arg: Any, meta: TapMeta) -> None:
        device = self._devices.get(meta.device) if meta.device is not None else None
        try:
            function(arg, meta.transforms, **tap_function_keywords(meta, device))
        except Exception as exc:
            with self._lock:
                self._last_exception = exc
            raise
