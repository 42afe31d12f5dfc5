"""How tapd's packages may import each other, read from the source (AST) rather than
trusted to review: nothing the emitter imports, however indirectly, is the daemon's
(it reaches the daemon through sockets and shared memory only), and tapd/protocol/ has
no import circle and no import inside a function (the way circles were dodged), with
schema.py at its bottom. tapd/protocol/ stands on the ground modules only (errors,
consumer names, the runtime directory and pids), which import nothing above them; the
ring's layout is the protocol's (ring_format.py), so the subscriber library reads rings
without tapd's native library.

The whole house (tapd/ and client/) has no import circle, counting the imports inside
functions and under TYPE_CHECKING: a circle is not untied by hiding one of its imports.
The rooms that tapd.emitter.lifecycle makes and wires (the local path, the print order,
the sender, the native backend, the site resolver) do not reach it. No module is longer
than 600 lines, no class than 400 (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "tapd"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}
CLIENT = ROOT / "client" / "tapd_client"
# tapd's modules and the subscriber library's (tapd_client.*, from client/)
HOUSE = {**MODULES, **{module_name(p, CLIENT.parent): p for p in CLIENT.rglob("*.py")}}


@functools.cache
def parsed(path: Path) -> ast.Module:
    """`path`'s syntax tree, read once: the graphs below walk every module three times,
    at collection, in each pytest-xdist worker."""
    return ast.parse(path.read_text(), str(path))


def imports(path: Path, modules: dict[str, Path] = MODULES) -> Iterator[tuple[ast.stmt, str]]:
    """Every import statement in `path` (at any depth: in functions, under
    TYPE_CHECKING) and each module of `modules` it names."""
    name = next(n for n, p in modules.items() if p == path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` packages up
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # `from tapd.clients import control` names a module; `from x import f` x.
                yield node, f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base


def edges(name: str, *, packages: bool) -> set[str]:
    """The tapd modules `name` imports; with `packages`, each with the packages above it
    (importing a.b.c runs a/__init__.py and a/b/__init__.py too)."""
    found = set()
    for _, target in imports(MODULES[name]):
        parts = target.split(".")
        for end in range(1 if packages else len(parts), len(parts) + 1):
            prefix = ".".join(parts[:end])
            if prefix in MODULES and prefix != name:
                found.add(prefix)
    return found


# What loading a module loads (with its packages' __init__), and what its own source
# imports (the graph in which a circle is a circle: every package's __init__ imports
# its own modules, and runs before them).
LOADS = {name: edges(name, packages=True) for name in MODULES}
IMPORTS = {name: edges(name, packages=False) for name in MODULES}


def reachable(start: str, graph: dict[str, set[str]] = LOADS) -> dict[str, str]:
    """Every module `start` imports, however indirectly: module -> the one it came from."""
    came_from = {start: ""}
    todo = [start]
    while todo:
        current = todo.pop()
        for target in graph[current]:
            if target not in came_from:
                came_from[target] = current
                todo.append(target)
    return came_from


def chain(came_from: dict[str, str], end: str) -> str:
    steps = [end]
    while came_from[steps[-1]]:
        steps.append(came_from[steps[-1]])
    return " -> ".join(reversed(steps))


@pytest.mark.fast
def test_the_graph_sees_the_imports_it_must() -> None:
    """(So that the checks below cannot pass on a graph that reads nothing.)"""
    assert "tapd.protocol.schema" in IMPORTS["tapd.protocol.wire"]
    assert "tapd.clients.control" in IMPORTS["tapd.emitter.sender"]
    assert "tapd.daemon.router" in IMPORTS["tapd.daemon.forward"]
    assert "tapd.daemon" in reachable("tapd.daemon.forward")
    assert "tapd.daemon" not in reachable("tapd.daemon.forward", IMPORTS)


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("tapd.emitter")))
def test_nothing_the_emitter_imports_is_the_daemon_s(module: str) -> None:
    came_from = reachable(module)
    daemon = sorted(m for m in came_from if m == "tapd.daemon" or m.startswith("tapd.daemon."))
    assert not daemon, f"the emitter imports the daemon: {chain(came_from, daemon[0])}"


def loaded_after(modules: str, *packages: str) -> list[str]:
    """What of `packages` a fresh interpreter has loaded once it imported `modules`."""
    code = (
        f"import sys, {modules}\n"
        f"print(sorted(m for m in sys.modules for p in {packages!r}"
        " if m == p or m.startswith(p + '.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return list(ast.literal_eval(out.stdout.strip()))


def test_an_emitting_process_loads_no_daemon_module() -> None:
    """The same at run time, in a fresh interpreter: the sender and the tap API."""
    assert loaded_after("tapd.emitter.sender, tapd.emitter.tapping", "tapd.daemon") == []


def test_a_daemon_a_subscriber_and_the_command_load_no_jax_nor_ml_dtypes() -> None:
    """Their start stays light: ml_dtypes' import alone costs ~0.5 s of CPU, paid by
    every daemon start and `tapd` command (tapd/protocol/dtypes.py imports it when a tap
    of one of its types is first decoded). So does id_print's print worker."""
    modules = "tapd.daemon.server, tapd_client.subscriber, tapd.cli.main, tapd.print_worker"
    assert loaded_after(modules, "jax", "ml_dtypes") == []


PROTOCOL = sorted(m for m in MODULES if m.startswith("tapd.protocol."))


@pytest.mark.fast
@pytest.mark.parametrize("module", PROTOCOL)
def test_protocol_has_no_import_circle(module: str) -> None:
    for target in sorted(IMPORTS[module] & set(PROTOCOL)):
        back = reachable(target, IMPORTS)  # a way back from what it imports: a circle
        assert module not in back, f"import circle: {module} -> {chain(back, module)}"


@pytest.mark.fast
def test_schema_is_the_bottom_of_protocol() -> None:
    below = reachable("tapd.protocol.schema", IMPORTS)
    assert {m for m in below if m.startswith("tapd.protocol.")} <= {
        "tapd.protocol.schema",
        "tapd.protocol.rules",
        "tapd.protocol.dtypes",
        "tapd.protocol.tree",
        "tapd.protocol.ring_format",
    }, f"schema.py imports {sorted(below)}"


# What every layer may stand on: modules at tapd's root that import no tapd package above
# them (tapd.settings: where the runtime directory's defaults are declared).
GROUND = {"tapd.errors", "tapd.consumers", "tapd.runtime"}
ABOVE_GROUND = ("tapd.protocol", "tapd.native", "tapd.daemon", "tapd.emitter", "tapd.clients")


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(GROUND))
def test_the_ground_imports_nothing_above_it(module: str) -> None:
    came_from = reachable(module, IMPORTS)
    above = sorted(m for m in came_from if m.startswith(ABOVE_GROUND))
    assert not above, f"a ground module imports upward: {chain(came_from, above[0])}"


@pytest.mark.fast
@pytest.mark.parametrize("module", PROTOCOL)
def test_protocol_stands_on_the_ground_only(module: str) -> None:
    outside = {m for m in IMPORTS[module] if not m.startswith("tapd.protocol")}
    assert outside <= GROUND, f"{module} imports {sorted(outside - GROUND)}"


@pytest.mark.fast
@pytest.mark.parametrize("path", sorted(CLIENT.rglob("*.py")), ids=lambda p: p.name)
def test_the_subscriber_library_imports_no_native_daemon_or_emitter_module(path: Path) -> None:
    """(It reads rings by their layout, tapd/protocol/ring_format.py, with mmap.)"""
    for node in ast.walk(parsed(path)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            assert not name.startswith(("tapd.native", "tapd.daemon", "tapd.emitter")), (
                f"{path.relative_to(ROOT)}:{node.lineno} imports {name}"
            )


@pytest.mark.fast
def test_protocol_imports_nothing_inside_a_function() -> None:
    for module, path in MODULES.items():
        if not module.startswith("tapd.protocol"):
            continue
        for function in ast.walk(parsed(path)):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                # (a library imported when first needed is another matter: ml_dtypes)
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = ["." if node.level else node.module or ""]
                else:
                    continue
                assert not any(n == "." or n.split(".")[0] == "tapd" for n in names), (
                    f"{path.relative_to(ROOT)}:{node.lineno}: an import of tapd inside "
                    f"{function.name}() (tapd/protocol/ imports at the top, in layers)"
                )


def house_imports(name: str) -> set[str]:
    """The modules of the house (tapd/, client/) that `name`'s own source imports."""
    found = set()
    for _, target in imports(HOUSE[name], HOUSE):
        while target and target not in HOUSE:  # `from tapd_client.meta import X`: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each set of modules that import each other
    (Tarjan's strongly connected components), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while component[-1:] != [module]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def one_way_round(graph: dict[str, set[str]], circle: list[str]) -> str:
    """A path that goes once round `circle`, from its first module back to it."""
    inside = {module: graph[module] & set(circle) for module in circle}
    start = circle[0]
    back = reachable(start, inside)
    end = next(module for module in circle if start in inside[module])
    return f"{chain(back, end)} -> {start}"


GRAPH = {name: house_imports(name) for name in HOUSE}


@pytest.mark.fast
def test_the_house_graph_sees_the_imports_it_must() -> None:
    """(So that the circle check cannot pass on a graph that reads nothing: imports in
    functions, and the subscriber library's, are among its arrows.)"""
    assert "tapd.emitter.lifecycle" in GRAPH["tapd"]  # in a function (no JAX at import)
    assert "tapd.protocol.batch" in GRAPH["tapd_client.handlers"]
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}}
    assert circles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert one_way_round(graph, ["a", "b", "c"]) == "a -> b -> c -> a"


@pytest.mark.fast
def test_the_house_has_no_import_circle() -> None:
    found = circles(GRAPH)
    assert not found, "import circles:\n" + "\n".join(
        f"{len(c)} modules import each other ({', '.join(c)}); one way round: "
        f"{one_way_round(GRAPH, c)}"
        for c in found
    )


# The rooms tapd.emitter.lifecycle makes and wires: each is handed what it needs of the
# emitter (callables, the daemon's ring), and none reaches lifecycle to get it.
WIRED = ("tapd.emitter.local", "tapd.emitter.print_order", "tapd.emitter.sender",
         "tapd.emitter.native_backend", "tapd.emitter.entries")  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith(WIRED)))
def test_a_room_lifecycle_wires_does_not_reach_it(module: str) -> None:
    came_from = reachable(module, GRAPH)
    assert "tapd.emitter.lifecycle" not in came_from, (
        f"{module} reaches the module that wires it: {chain(came_from, 'tapd.emitter.lifecycle')}"
    )


MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(HOUSE))
def test_a_module_and_its_classes_are_within_their_bounds(module: str) -> None:
    path = HOUSE[module]
    text = path.read_text()
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)}: {lines} lines"
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ClassDef):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            assert size <= MAX_CLASS_LINES, (
                f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}, {size} lines"
            )


# The gathered path's room (tapd/emitter/gathered/): the rest of tapd reaches it through
# its face (its __init__.py) only, so that its modules can change among themselves.
GATHERED = "tapd.emitter.gathered"


@pytest.mark.fast
@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith(GATHERED)))
def test_the_gathered_room_is_entered_through_its_face(module: str) -> None:
    inside = sorted(m for m in IMPORTS[module] if m.startswith(GATHERED + "."))
    assert not inside, f"{module} imports {inside}, not the face {GATHERED}"


@pytest.mark.fast
def test_the_gathered_face_is_what_lowering_imports() -> None:
    """(So that the check above cannot pass on a graph that misses the room.)"""
    assert GATHERED in IMPORTS["tapd.emitter.lowering"]
    assert f"{GATHERED}.host" in IMPORTS[f"{GATHERED}.flush"]
