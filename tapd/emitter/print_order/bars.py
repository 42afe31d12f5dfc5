"""A progress bar closes after the callbacks that update it, as it did with JAX's.

A program opens a bar, runs a jitted loop whose steps update it from a callback
(`jax.debug.callback(bar.update, ...)`, an `id_tap` of `bar.update` or of a closure),
and closes the bar as soon as the call returns. JAX runs those callbacks inside the
computation and, on the CPU, returns from the call once they have run: the bar closes
full. tapd runs them later, on its receiver thread, so that the step never waits for
them; the call returns at once, and a bar closed then closes before its updates (tqdm
draws its last line at 0 and then misdraws them; rich's last frame lacks them).

So the close of the common bars first waits for the callbacks already dispatched
(`settle`, tapd.emitter.lifecycle's: the computations dispatched so far have run, and
the receiver has run their taps), as a print to stdout waits for them
(tapd.emitter.print_order.stdout). The call itself still returns at once; the close
waits, as the call did with JAX. Patched once tapd's in-process callbacks are in use
(`attach`, when the local ring is made), each only once its module is imported (a
finder on `sys.meta_path`; tapd imports none of them):

- tqdm: `tqdm.std.tqdm.close` and the `close` of each subclass that has its own
  (tqdm.auto, .notebook, .rich, .gui, a subclass of the program's), which `__exit__`
  calls: jax-tqdm's bars and NumPyro's and Diffrax's are tqdm's;
- rich: `rich.progress.Progress.stop` (its `__exit__`, `rich.progress.track`);
- fastprogress: `ProgressBar.on_iter_end`, the end of its bars, and subclasses' own;
- BlackJAX: the exit of `with blackjax.progress_bar():`, where its `ProgressState`
  becomes `closed` (its thread draws the bar from what the callbacks recorded until
  then, and takes no update after it).

A close never waits on tapd's receiver thread (a callback that closes its bar, as
jax-tqdm's last update does: it would wait for itself), inside one of JAX's own host
callbacks (Diffrax's and NumPyro's close: the computation waits for it), while JAX
traces, in a `__del__` (the collector runs it anywhere), at interpreter exit (the exit
drain runs what is left) or while a KeyboardInterrupt unwinds. It waits for as long as
the receiver makes progress: once no callback has run for `TAPD_CELL_TIMEOUT` seconds
(10), the bar closes, with a warning that says so, and the rest of its updates come
after. A bar that no callback updates waits only for the computations in flight.

`after_callbacks(function)` (`tapd.after_callbacks`) gives the same wait to any other
function: `MyBar.close = tapd.after_callbacks(MyBar.close)`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple, TypeVar

from tapd.emitter.jax_compat import in_host_callback
from tapd.emitter.local.threads import on_receiver_thread

logger = logging.getLogger("tapd.emitter")

F = TypeVar("F", bound=Callable[..., Any])


class _Waits(NamedTuple):
    """What a close waits with, as `attach` was given them."""

    stalled_after: float  # TAPD_CELL_TIMEOUT
    settle: Callable[[float], bool | None]  # True: all ran; False: stalled; None: nothing


_waits: list[_Waits] = []  # (one, once attached)
_lock = threading.Lock()
_inside = threading.local()  # `active`: in a function that waited (its super() calls don't)


def attach(stalled_after: float, settle: Callable[[float], bool | None]) -> None:
    """From now on, the close of the bars in `_TARGETS` waits with `settle(stalled_after)`:
    patched now where imported, else when they are. Once a process."""
    with _lock:
        if _waits:
            return
        _waits.append(_Waits(stalled_after, settle))
        for name in _TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                _patch(name, module)
        sys.meta_path.insert(0, _PatchOnImport())


def after_callbacks(function: F) -> F:
    """`function`, which first waits for the callbacks already dispatched to have run
    (while tapd's in-process callbacks are in use; see the module's docstring for where
    it does not wait, and for how long it does)."""
    if getattr(function, "tapd_after_callbacks", False):
        return function

    # Held by the closure: at interpreter teardown a module's globals may already be None
    # when a bar left in a module global is collected and closes.
    inside, waits, frame_of, settle = _inside, _waits, sys._getframe, settle_here

    @functools.wraps(function)
    def waits_first(*args: Any, **kwargs: Any) -> Any:
        if getattr(inside, "active", False):  # (a subclass's close calling its base's)
            return function(*args, **kwargs)
        if waits and frame_of(1).f_code.co_name != "__del__":
            settle(f"{function.__module__}.{function.__qualname__}")
        inside.active = True
        try:
            return function(*args, **kwargs)
        finally:
            inside.active = False

    waits_first.tapd_after_callbacks = True  # type: ignore[attr-defined]
    return waits_first  # type: ignore[return-value]


def settle_here(what: str) -> None:
    """Wait for the callbacks already dispatched, before `what` (a bar's close), where
    this thread may; say so if they stalled."""
    if not _waits or on_receiver_thread() or sys.is_finalizing():
        return
    if isinstance(sys.exc_info()[1], KeyboardInterrupt) or in_host_callback():
        return
    stalled_after, settle = _waits[0]
    try:
        done = settle(stalled_after)
    except Exception:  # a close must not fail for tapd's sake: say it, and go on
        logger.exception("tapd: waiting for the callbacks before %s failed", what)
        return
    if done is False:
        logger.warning(
            "tapd: %s waited for the in-process callbacks already dispatched (a progress "
            "bar's updates), but none ran for %g s (TAPD_CELL_TIMEOUT): it goes on "
            "without them, and the rest run after it",
            what,
            stalled_after,
        )


def _wait_in_class(cls: type, name: str) -> None:
    """`cls.name`, and the `name` of each subclass that defines its own, now and later,
    wait first (`after_callbacks`)."""
    for each in _with_subclasses(cls):
        own = each.__dict__.get(name)
        if callable(own) and not isinstance(own, (staticmethod, classmethod)):
            setattr(each, name, after_callbacks(own))
    before = cls.__dict__.get("__init_subclass__")
    if getattr(before, "tapd_after_callbacks", False):
        return

    base: Any = cls

    def __init_subclass__(subclass: Any, /, **kwargs: Any) -> None:
        if isinstance(before, classmethod):
            before.__func__(subclass, **kwargs)
        else:  # (the next class's in the subclass's order, as if cls had none)
            super(base, subclass).__init_subclass__(**kwargs)
        own = subclass.__dict__.get(name)
        if callable(own) and not isinstance(own, (staticmethod, classmethod)):
            setattr(subclass, name, after_callbacks(own))

    __init_subclass__.tapd_after_callbacks = True  # type: ignore[attr-defined]
    setattr(cls, "__init_subclass__", classmethod(__init_subclass__))  # noqa: B010


def _with_subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        each = todo.pop()
        if each not in found:
            found.append(each)
            todo.extend(each.__subclasses__())
    return found


def _wait_before_closed(cls: type, name: str) -> None:
    """Setting `name` of a `cls` (a flag that says the bar takes no more updates) to a
    true value first waits (`settle_here`). A property on the class, over the instances'
    own attribute: instances made before it was patched wait too."""
    if getattr(cls.__dict__.get(name), "tapd_after_callbacks", False):
        return
    what = f"{cls.__module__}.{cls.__qualname__}.{name} = True"

    def get(instance: Any) -> Any:
        try:
            return instance.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    def set_(instance: Any, value: Any) -> None:
        if value and not instance.__dict__.get(name):
            settle_here(what)
        instance.__dict__[name] = value

    setattr(cls, name, _WaitingFlag(get, set_, doc=f"{name}: set after the callbacks ran"))


class _WaitingFlag(property):
    tapd_after_callbacks = True


# What waits, by the module that defines it. (The libraries that build their bars on
# these need nothing of their own: jax-tqdm, NumPyro, Diffrax's TqdmProgressMeter.)
_TARGETS: dict[str, Callable[[ModuleType], None]] = {
    "tqdm.std": lambda module: _wait_in_class(module.tqdm, "close"),
    "rich.progress": lambda module: _wait_in_class(module.Progress, "stop"),
    "fastprogress.fastprogress": lambda module: _wait_in_class(module.ProgressBar, "on_iter_end"),
    "blackjax.progress_bar": lambda module: _wait_before_closed(module.ProgressState, "closed"),
}


def _patch(name: str, module: ModuleType) -> None:
    try:
        _TARGETS[name](module)
    except Exception:  # (another release, other names: that bar keeps its close)
        logger.warning(
            "tapd: could not make %s's progress bars wait for the callbacks before they "
            "close; call jax.effects_barrier() before closing one",
            name,
            exc_info=True,
        )


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module of `_TARGETS`, the spec the other finders give,
    whose loader patches the module once it has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, fullname)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """A loader that runs the module as `loader` does, then patches it; the rest of
    what is asked of it (resources, source) is `loader`'s."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(self._name, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
