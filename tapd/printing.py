"""The tap function behind `tapd.id_print`, printing as host_callback's `id_print` did.

It runs in the emitting process when no subscriber takes `tapd.printing:print_tap`
(and always when `id_print` was given an `output_stream`), or in a subscriber process:
`tapd subscribe tapd.printing`. No JAX here.

The format is host_callback's: the keyword arguments first, sorted by name, on one line
(`what: a * 2`, with `transforms: [...]` and `device: ...` among them when there are
any), then the value: arrays as `numpy.array2string` writes them, tuples as `( a b )`,
lists as `[ a b ]` and dicts as `{ k=v }`, on one line when they fit in 80 columns and
broken over indented lines when they do not.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Protocol

import numpy as np

_WIDTH = 80
_lock = threading.Lock()  # one printed tap's lines stay together


class _Stream(Protocol):
    def write(self, text: str, /) -> Any: ...


def print_tap(
    arg: Any,
    transforms: Any,
    *,
    device: Any = None,
    output_stream: _Stream | None = None,
    threshold: int | None = None,
    **kwargs: Any,
) -> None:
    """Print `arg` as host_callback's `id_print` did; `threshold` goes to
    `numpy.array2string`, `output_stream.write` replaces `print` when given."""
    emit(header_line(transforms, device, kwargs), render(arg, threshold=threshold), output_stream)


def header_line(transforms: Any, device: Any, keywords: dict[str, Any]) -> str:
    """The line before the value: the keywords, sorted by name (`what: ...`), with
    `transforms` and `device` among them where there are any; "" for none."""
    shown = dict(keywords)
    if transforms:
        shown["transforms"] = [(name, params) if params else name for name, params in transforms]
    if device is not None:
        shown["device"] = device
    return " ".join(f"{key}: {value}" for key, value in sorted(shown.items()))


def emit(header: str, body: str, output_stream: _Stream | None) -> None:
    """A printed tap's lines, together: to `output_stream`, else to stdout."""
    with _lock:
        for line in [header, body] if header else [body]:
            if output_stream is not None:
                output_stream.write(line + "\n")
            else:
                print(line, flush=True)


def render(arg: Any, *, threshold: int | None = None, width: int = _WIDTH) -> str:
    """`arg` as id_print shows it."""
    return _layout(_document(arg, threshold), width)


# ---- a small Wadler-style pretty printer (the layout of jax's pretty_printer) ----------


@dataclasses.dataclass(frozen=True)
class _Text:
    text: str


@dataclasses.dataclass(frozen=True)
class _Break:  # a space, or a new line when its group does not fit
    pass


@dataclasses.dataclass(frozen=True)
class _Nest:
    indent: int
    child: _Doc


@dataclasses.dataclass(frozen=True)
class _Concat:
    children: tuple[_Doc, ...]


@dataclasses.dataclass(frozen=True)
class _Group:  # laid out flat if it fits on the rest of the line, else its breaks break
    child: _Doc


_Doc = _Text | _Break | _Nest | _Concat | _Group


def _bracketed(open_: str, items: list[_Doc], close: str) -> _Doc:
    joined: list[_Doc] = []
    for index, item in enumerate(items):
        joined += [_Break(), item] if index else [item]
    return _Group(_Concat((_Text(open_), _Nest(2, _Concat(tuple(joined))), _Text(close))))


def _document(arg: Any, threshold: int | None) -> _Doc:
    if isinstance(arg, tuple):
        return _bracketed("( ", [_document(a, threshold) for a in arg], " )")
    if isinstance(arg, list):
        return _bracketed("[ ", [_document(a, threshold) for a in arg], " ]")
    if isinstance(arg, dict):
        items: list[_Doc] = [
            _Concat((_Text(f"{key}="), _document(value, threshold)))
            for key, value in sorted(arg.items())
        ]
        return _bracketed("{ ", items, " }")
    if isinstance(arg, np.ndarray):
        return _Text(np.array2string(arg, threshold=threshold))
    return _Text(str(arg))


_FLAT, _BREAK = False, True


def _fits(doc: _Doc, room: int) -> bool:
    """Whether `doc`, laid out flat, takes at most `room` columns."""
    agenda: list[_Doc] = [doc]
    while room >= 0 and agenda:
        node = agenda.pop()
        if isinstance(node, _Text):
            room -= len(node.text)
        elif isinstance(node, _Break):
            room -= 1
        elif isinstance(node, _Concat):
            agenda.extend(reversed(node.children))
        else:
            agenda.append(node.child)
    return room >= 0


def _layout(doc: _Doc, width: int) -> str:
    lines: list[str] = []
    line = ""
    column = 0
    agenda: list[tuple[int, bool, _Doc]] = [(0, _BREAK, doc)]
    while agenda:
        indent, mode, node = agenda.pop()
        if isinstance(node, _Text):
            line += node.text
            column += len(node.text)
        elif isinstance(node, _Break):
            if mode is _BREAK:
                lines.append(line)
                line, column = " " * indent, indent
            else:
                line += " "
                column += 1
        elif isinstance(node, _Nest):
            agenda.append((indent + node.indent, mode, node.child))
        elif isinstance(node, _Concat):
            agenda.extend((indent, mode, child) for child in reversed(node.children))
        else:
            flat = _fits(node.child, width - column)
            agenda.append((indent, _FLAT if flat else _BREAK, node.child))
    lines.append(line)
    return "\n".join(lines)
