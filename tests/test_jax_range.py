"""tapd's JAX range (issue 27, item 4): one statement of it (tapd.emitter.jax_compat)
that pyproject.toml, setup.py and the scripts agree with, open above: pip never refuses
tapd beside a newer jax. Below the floor, `import tapd` says so in one line and taps fail
at trace time with the same words. Past the tested range, `import tapd` warns once,
naming it, and taps run, on both backends, while the JAX internals tapd calls still fit
(`jax_compat.SEAMS`); one that does not fails the tap at trace time, naming itself, never
a TypeError from inside JAX. The newer versions are faked: the jax module's
`__version__`, which is what tapd reads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import PROCESS_TIMEOUT, Daemon, SubscriberProcess, wait_until
from tapd.emitter import jax_compat
from tapd.emitter.jax_compat import cpu_put

ROOT = Path(__file__).resolve().parent.parent

StartDaemon = Callable[..., Daemon]
StartSubscriber = Callable[..., SubscriberProcess]


def python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PROCESS_TIMEOUT, env={**os.environ, **(env or {})})  # fmt: skip


@pytest.mark.fast
@pytest.mark.parametrize(
    ("version", "taps", "tested"),
    [("0.8.0", True, True), ("0.10.2", True, True), ("0.12.0.1", True, True),
     ("0.12.9.dev20270101", True, True), ("0.13.0", True, False), ("0.13.0.dev1", True, False),
     ("1.0", True, False), ("0.7.2", False, False), ("0.4.30", False, False)],
)  # fmt: skip
def test_the_range(version: str, taps: bool, tested: bool) -> None:
    refused = jax_compat.unsupported_reason(version)
    assert (refused is None) == taps
    if refused is not None:
        assert refused.startswith(f"tapd supports jax>=0.8.0, and this is jax {version}: ")
        assert "\n" not in refused
    untested = jax_compat.untested_reason(version)
    assert (untested is None) == (tested or not taps)
    if untested is not None:
        assert untested.startswith(
            f"tapd is tested with jax 0.8.0 to 0.12, and this is jax {version}"
        )
        assert "'jax<0.13' 'jaxlib<0.13'" in untested and "\n" not in untested


@pytest.mark.fast
def test_pyproject_setup_and_the_scripts_claim_the_same_open_range() -> None:
    assert jax_compat.SUPPORTED == "jax>=0.8.0"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for extra in ("jax", "dev"):
        extras = project["project"]["optional-dependencies"][extra]
        asked = [r for r in extras if re.match(r"jax(lib)?(?![\w-])", r)]  # (not jax-tqdm)
        assert sorted(asked) == ["jax>=0.8.0", "jaxlib>=0.8.0"], extra  # no upper bound
    assert "JAX=${JAX:-'jax>=0.8.0 jaxlib>=0.8.0'}" in (ROOT / "scripts" / "setup").read_text()
    installs = (ROOT / "scripts" / "check-installs").read_text()
    assert "'jax>=0.8.0' 'jaxlib>=0.8.0'" in installs and "<0." not in installs
    assert "jaxlib>=0.8.0" in (ROOT / "setup.py").read_text()  # what native builds use
    assert "jax==0.8.0 jaxlib==0.8.0" in (ROOT / ".ci" / "run").read_text()  # the floor


BELOW = """
import jax, jax.numpy as jnp
jax.__version__ = "0.7.2"  # what tapd reads, as a jax of that version would say
import tapd
try:
    jax.jit(lambda x: tapd.tap(x, "t"))(jnp.ones(2))
except tapd.TapDefinitionError as exc:
    print("TAP:", exc)
try:
    jax.jit(lambda x: tapd.id_tap(print, x))(jnp.ones(2))
except tapd.TapDefinitionError as exc:
    print("ID_TAP:", exc)
"""


def test_below_the_floor_import_says_so_in_one_line_and_taps_fail_at_trace_time() -> None:
    result = python(BELOW)
    assert result.returncode == 0, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("tapd supports jax>=0.8.0, and this is jax 0.7.2")
    assert result.stdout.splitlines() == [f"TAP: {line}", f"ID_TAP: {line}"]


# A jax newer than the tested range: taps run, on the backend the test asks for, into
# a real daemon and subscriber; a closure runs here, as host_callback's did.
NEWER = """
import json, jax, jax.numpy as jnp
jax.__version__ = "0.13.0"  # what tapd reads, as a newer jax would say
import tapd
seen = []
step = jax.jit(lambda x: tapd.id_tap(lambda a, t: seen.append(a.tolist()), tapd.tap(x, "t")))
for i in range(3):
    step(jnp.full(2, float(i)))
tapd.barrier_wait(timeout=30)
print(json.dumps({"backend": tapd.backend(), "seen": seen, "stats": tapd.stats()}))
"""


def test_a_newer_jax_warns_once_naming_the_tested_range_and_taps_run(
    start_daemon: StartDaemon, start_subscriber: StartSubscriber, backend: str
) -> None:
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "t")
    result = python(NEWER, env={"TAPD_ENDPOINT": daemon.endpoint})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "tapd" in line]
    assert warnings == [jax_compat.untested_reason("0.13.0")], result.stderr
    got = json.loads(result.stdout.splitlines()[-1])
    # The native handler still registers where this jaxlib's FFI API takes it.
    assert got["backend"] == backend
    assert got["seen"] == [[float(i)] * 2 for i in range(3)]
    assert (got["stats"]["delivered"], got["stats"]["errors"]) == (6, 0)
    wait_until(lambda: len(subscriber.records()) == 3, "the subscriber's three taps")
    assert [r["value"] for r in subscriber.records()] == [[float(i)] * 2 for i in range(3)]


# The same newer jax with one of the internals tapd calls changed: a parameter added
# that tapd does not pass, or the function gone.
MISFIT = """
import jax, jax.numpy as jnp
jax.__version__ = "0.13.0"
from jax._src import callback
from jax._src.interpreters import mlir
if "{change}" == "signature":
    mlir.set_sharding = lambda ctx, op, sharding, placement: None
else:
    del callback.emit_python_callback
import tapd
for name, traced in [
    ("TAP", lambda x: tapd.tap(x, "t")),
    ("ID_TAP", lambda x: tapd.id_tap(lambda a, t: None, x)),
]:
    try:
        jax.jit(traced)(jnp.ones(2))
        print(name, "ran")
    except tapd.TapDefinitionError as exc:
        print(name, exc)
"""


@pytest.mark.parametrize(
    ("change", "seam", "detail"),
    [("signature", "mlir.set_sharding (jax._src.interpreters.mlir.set_sharding)",
      "missing a required argument: 'placement'"),
     ("removal", "callback.emit_python_callback (jax._src.callback.emit_python_callback)",
      "has no attribute 'emit_python_callback'")],
)  # fmt: skip
def test_a_seam_that_does_not_fit_a_newer_jax_fails_at_trace_time_naming_itself(
    change: str, seam: str, detail: str
) -> None:
    result = python(MISFIT.replace("{change}", change))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["TAP", "ID_TAP"], result.stdout
    for line in lines:
        assert f"tapd cannot tap with jax 0.13.0: JAX's internal {seam} does not fit" in line
        assert detail in line and "tapd is tested with jax 0.8.0 to 0.12" in line


@pytest.mark.fast
def test_every_seam_fits_the_installed_jax_and_a_misfit_is_named() -> None:
    assert jax_compat.seam_misfit() is None
    odd = {"json.dumps": jax_compat.Seam("json", "dumps", lambda parameters: (2, ()))}
    message = jax_compat.seam_misfit(odd)
    assert message is not None
    assert "JAX's internal json.dumps (json.dumps) does not fit the call tapd makes" in message
    assert "too many positional arguments" in message


def test_inside_the_tested_range_import_says_nothing() -> None:
    result = python("import tapd")
    assert (result.returncode, result.stderr) == (0, "")


def test_the_installed_jax_is_read_without_importing_it() -> None:
    result = python(
        "import sys, tapd.emitter.jax_compat as c; print(c.installed_jax(), 'jax' in sys.modules)"
    )
    import jax

    assert result.stdout.split() == [jax.__version__, "False"]
    assert re.match(r"\d+\.\d+", jax.__version__)


@pytest.mark.fast
def test_cpu_puts_match_jax_device_put_on_the_fast_path_and_the_fallbacks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tapd.debug` hands its callbacks what `jax.device_put(args, cpu)` gives: the fast
    internal path (also the put a run of taps makes for its first tap's types) and the
    public fallback agree with it, weak types included."""
    import jax
    import numpy as np

    cpu = jax.local_devices(backend="cpu")[0]
    leaves = [
        np.arange(6, dtype=np.float32).reshape(2, 3),
        np.array(3, np.int32),
        np.frombuffer(bytes(range(16)), np.uint8)[3:11],  # read-only, unaligned
        np.array([True, False]),
    ]
    expected = jax.device_put(leaves, cpu)

    def check(arrays: list) -> None:
        for index, (got, want) in enumerate(zip(arrays, expected, strict=True)):
            assert isinstance(got, jax.Array)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
            assert got.devices() == {cpu} and got.committed
            assert got.weak_type == (index == 1)

    def check_both() -> None:
        check(jax_compat.cpu_putter(cpu)(leaves, frozenset({1})))
        # made for the first tap of a run, then used for the others: the same types
        put_like = jax_compat.cpu_putter_like(cpu, [leaf.copy() for leaf in leaves], frozenset({1}))
        check(put_like(leaves))
        one = jax_compat.cpu_putter_like(cpu, leaves[1:2], frozenset({0}))  # one leaf
        (got,) = one([np.array(7, np.int32)])
        assert int(got) == 7 and got.weak_type and got.devices() == {cpu}
        # leaves that are not numpy arrays (numpy scalars): converted on each call
        scalars = jax_compat.cpu_putter_like(cpu, [np.float32(1), np.int32(2)], frozenset())
        got = scalars([np.float32(1.5), np.int32(3)])
        assert [float(v) for v in got] == [1.5, 3.0]
        assert [v.dtype for v in got] == [np.float32, np.int32]

    check_both()

    def internals_differ() -> None:
        raise AttributeError("module 'pxla' has no attribute 'batched_device_put'")

    monkeypatch.setattr(cpu_put, "_device_putter", internals_differ)
    check_both()

    def put_refused(*args: object) -> None:  # found, but its signature changed
        raise TypeError("batched_device_put(): incompatible function arguments")

    monkeypatch.setattr(cpu_put, "_device_putter", lambda: put_refused)
    check_both()


# Uses of a name that the installed jax deprecates which tapd makes on purpose, each where
# a newer spelling is missing (tapd/emitter/jax_compat), with the reason.
DEPRECATED_ON_PURPOSE = {
    ("tapd/emitter/jax_compat/calls.py", "jax.sharding.SingleDeviceSharding"):
        "single_device_sharding's fallback, for a jax without make_single_device_sharding",
    ("tapd/emitter/gathered/rewrite.py", "jax.lax.pvary"):
        "Rewriter._own's fallback, for a jax without lax.pcast (jax 0.8.0 has only pvary)",
}  # fmt: skip


def jax_names_used(source: str) -> set[tuple[str, int]]:
    """Each public jax name the source reaches, as (dotted name, line): `from jax.m import
    n` gives jax.m.n; `jax.m.n` and `alias.n` (after `import jax.m as alias` or `from jax
    import m`) give each attribute of the chain (jax.m, jax.m.n), so that each can be
    looked up as a module's attribute."""
    import ast

    tree = ast.parse(source)
    aliases = {"jax": "jax"}
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "jax":
                    aliases[name.asname or "jax"] = name.name if name.asname else "jax"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jax":
            for name in node.names:
                aliases[name.asname or name.name] = f"{node.module}.{name.name}"
                found.add((f"{node.module}.{name.name}", node.lineno))

    def dotted(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node)) is not None:
            found.add((name, node.lineno))  # (the chain's inner nodes give its prefixes)
    return found


def deprecated_in_the_installed_jax(dotted: str) -> str | None:
    """The installed jax's deprecation message for `dotted` (module.name), or None: the
    names a public jax module lists in its `_deprecations` (what its `__getattr__`
    warns about, or refuses once removed)."""
    import importlib

    module_name, _, name = dotted.rpartition(".")
    if not module_name or "._src" in module_name:
        return None
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None  # not a module: an attribute chain whose prefix is a class or a value
    table = getattr(module, "_deprecations", None)
    if not isinstance(table, dict) or name not in table:
        return None
    message = table[name][0]
    return str(message) if message else f"{dotted} is deprecated"


@pytest.mark.fast
def test_tapd_uses_no_name_the_installed_jax_deprecates() -> None:
    """A deprecated name warns where it runs, and `-W error` (this suite's setting, and
    some users') makes the warning an error: jax 0.12.1's SingleDeviceSharding failed
    CI that way. Read from the source, every path counts, also those only a TPU or a GPU
    runs. CI runs this with the newest jax pip gives."""
    used: dict[tuple[str, str], str] = {}
    for path in sorted((ROOT / "tapd").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for dotted, line in jax_names_used(path.read_text()):
            message = deprecated_in_the_installed_jax(dotted)
            if message is not None:
                used[(relative, dotted)] = f"{relative}:{line}: {message}"
    unexplained = sorted(where for key, where in used.items() if key not in DEPRECATED_ON_PURPOSE)
    assert not unexplained, "\n".join(unexplained)
    for relative, name in DEPRECATED_ON_PURPOSE:  # (none left behind by a removed fallback)
        assert name.rpartition(".")[2] in (ROOT / relative).read_text(), (relative, name)


@pytest.mark.fast
def test_the_deprecation_check_reads_every_way_a_jax_name_is_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = (
        "import jax\nimport jax.numpy as jnp\nfrom jax import sharding\n"
        "from jax.sharding import Mesh as M\nfrom jax._src import core\n"
        "jax.sharding.PartitionSpec\njnp.float32\nsharding.NamedSharding\ncore.Tracer\n"
    )
    names = {dotted for dotted, _ in jax_names_used(source)}
    assert {"jax.sharding.PartitionSpec", "jax.numpy.float32", "jax.sharding.NamedSharding",
            "jax.sharding.Mesh", "jax._src.core.Tracer"} <= names  # fmt: skip
    # A public module with a deprecation table as jax writes them (jax/sharding.py in
    # 0.12.1): (message, the old object), or (message, None) once removed.
    module = types.ModuleType("jax.tapd_test_module")
    module._deprecations = {  # type: ignore[attr-defined]
        "Old": ("jax.tapd_test_module.Old is deprecated; use New.", object),
        "Gone": ("jax.tapd_test_module.Gone was removed.", None),
    }
    monkeypatch.setitem(sys.modules, "jax.tapd_test_module", module)
    message = deprecated_in_the_installed_jax("jax.tapd_test_module.Old")
    assert message == "jax.tapd_test_module.Old is deprecated; use New."
    assert deprecated_in_the_installed_jax("jax.tapd_test_module.Gone") is not None
    assert deprecated_in_the_installed_jax("jax.tapd_test_module.New") is None
    import jax

    if "SingleDeviceSharding" in getattr(jax.sharding, "_deprecations", {}):  # jax >= 0.12.1
        message = deprecated_in_the_installed_jax("jax.sharding.SingleDeviceSharding")
        assert message is not None and "make_single_device_sharding" in message
    assert deprecated_in_the_installed_jax("jax.sharding.PartitionSpec") is None
    assert deprecated_in_the_installed_jax("jax._src.core.Tracer") is None
