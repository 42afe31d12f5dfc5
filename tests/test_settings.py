"""The settings table (tapd/settings/): one declaration per setting, from which the
`tapd start` options, the TOML keys, the variables and docs/SETTINGS.md's table are made;
and the daemon's and the emitter's policies, which used to share TAPD_POLICY."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import tapd.settings as settings_module
from conftest import Daemon, SubscriberProcess, run_emitter
from tapd import config as config_module
from tapd.cli.commands.daemon import START_OPTIONS, daemon_config
from tapd.cli.main import build_parser
from tapd.emitter.settings import EmitterSettings, from_environment
from tapd.errors import ConfigError
from tapd.settings import DAEMON_SETTINGS, EMITTER_SETTINGS, SETTINGS, setting
from tapd.settings.markdown import NO_VARIABLE, markdown_table
from tapd.settings.setting import Setting

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PAGE = ROOT / "docs" / "SETTINGS.md"
# os.environ["TAPD_X"], os.environ.get("TAPD_X"), os.getenv(f"TAPD_{...}"), "TAPD_X" in environ
READS = re.compile(
    r"""(environ(\.get)?|getenv)\s*[(\[]\s*f?["']TAPD_|["']TAPD_\w*["']\s+in\s+\w*environ"""
)
TABLE = re.compile(
    r"<!-- settings table: python -m tapd.settings --markdown -->\n(.*?)"
    r"<!-- end of settings table -->",
    re.DOTALL,
)


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process deprecation warnings again."""
    monkeypatch.setattr(setting, "_warned", set())
    for name in ("TAPD_POLICY", "TAPD_DAEMON_POLICY", "TAPD_EMITTER_POLICY"):
        monkeypatch.delenv(name, raising=False)


# ---- the policy variables -------------------------------------------------------------------


def test_a_daemon_policy_in_the_old_variable_no_longer_breaks_an_emitter() -> None:
    """The defect: TAPD_POLICY=spool, exported for the daemon, made every emitter in the
    same environment fail at its first tap."""
    code = "from tapd.emitter.settings import from_environment; print(from_environment().policy)"
    env = {name: value for name, value in os.environ.items() if "POLICY" not in name}
    env["TAPD_POLICY"] = "spool"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "block"
    assert "TAPD_POLICY=spool is not one of the emitter's policy values" in result.stderr
    assert "TAPD_DAEMON_POLICY" in result.stderr and "TAPD_EMITTER_POLICY" in result.stderr


@pytest.mark.fast
def test_the_old_variable_keeps_its_meaning_where_it_was_valid_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {"TAPD_POLICY": "drop_newest"}
    with caplog.at_level(logging.WARNING, "tapd.settings"):
        assert config_module.load({}, None, environ).policy == "drop_newest"
        assert from_environment_of(environ).policy == "drop_newest"
    messages = [record.getMessage() for record in caplog.records]
    assert any("as TAPD_DAEMON_POLICY=drop_newest" in m for m in messages), messages
    assert any("as TAPD_EMITTER_POLICY=drop_newest" in m for m in messages), messages
    assert all("deprecated" in m for m in messages)
    with pytest.raises(ConfigError, match="TAPD_POLICY='sometimes' is not one of"):
        config_module.load({}, None, {"TAPD_POLICY": "sometimes"})


@pytest.mark.fast
def test_each_process_reads_its_own_policy_variable(caplog: pytest.LogCaptureFixture) -> None:
    # An emitter-side value no longer changes a daemon started from the same shell...
    emitter_side = {"TAPD_EMITTER_POLICY": "drop_newest"}
    assert config_module.load({}, None, emitter_side).policy == "block"
    assert from_environment_of(emitter_side).policy == "drop_newest"
    # ...and a daemon-side one is not the emitter's business.
    daemon_side = {"TAPD_DAEMON_POLICY": "spool"}
    assert config_module.load({}, None, daemon_side).policy == "spool"
    assert from_environment_of(daemon_side).policy == "block"
    assert caplog.records == []  # the new variables are not deprecated
    # The new variable wins over the old one; a flag over both.
    both = {"TAPD_DAEMON_POLICY": "spool", "TAPD_POLICY": "drop_newest"}
    assert config_module.load({}, None, both).policy == "spool"
    assert config_module.load({"policy": "block"}, None, both).policy == "block"
    with pytest.raises(ConfigError, match="TAPD_EMITTER_POLICY='spool' is not one of block"):
        from_environment_of({"TAPD_EMITTER_POLICY": "spool"})


def from_environment_of(environ: dict[str, str]) -> EmitterSettings:
    with pytest.MonkeyPatch.context() as patch:
        for name, value in environ.items():
            patch.setenv(name, value)
        return from_environment()


def test_a_daemon_and_its_emitter_share_a_shell_with_the_old_variable(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A job script exports TAPD_POLICY=spool, then starts the daemon and the JAX job."""
    monkeypatch.setenv("TAPD_POLICY", "spool")
    daemon = start_daemon("--spool-dir", str(tmp_path / "spool"))
    subscriber = start_subscriber(daemon, "loss")
    result = run_emitter(daemon.endpoint, "steps", "3")
    assert [r["value"] for r in subscriber.records()] == [0.0, 1.0, 2.0]
    assert "the emitter ignores it and uses block" in result["stderr"]
    log = daemon.log()
    assert "(policy spool)" in log
    assert "TAPD_POLICY=spool: the daemon takes it as TAPD_DAEMON_POLICY=spool" in log


# ---- one table, on the settings page ------------------------------------------------------


def every_declared_setting() -> set[Setting]:
    """Every Setting that tapd/settings/ declares: the fields of the daemon's and the
    emitter's, and every module-level one (whether or not SETTINGS lists it)."""
    declared = {value for value in vars(settings_module).values() if isinstance(value, Setting)}
    return declared | set(DAEMON_SETTINGS) | set(EMITTER_SETTINGS)


def page_rows() -> list[list[str]]:
    """The cells of each row of docs/SETTINGS.md's table."""
    found = TABLE.search(SETTINGS_PAGE.read_text())
    assert found is not None, "docs/SETTINGS.md has no settings table between its markers"
    lines = found.group(1).splitlines()[2:]  # below the header and its rule
    return [re.split(r"(?<!\\)\|", line)[1:-1] for line in lines]


def test_the_settings_page_has_the_table_the_settings_make() -> None:
    found = TABLE.search(SETTINGS_PAGE.read_text())
    assert found is not None, "docs/SETTINGS.md has no settings table between its markers"
    assert found.group(1) == markdown_table(), (
        "docs/SETTINGS.md's table is out of date: paste `python -m tapd.settings --markdown`"
    )
    printed = subprocess.run(
        [sys.executable, "-m", "tapd.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert printed == markdown_table()


@pytest.mark.fast
def test_every_setting_of_tapd_settings_has_its_row_on_the_settings_page() -> None:
    """Each declared setting, with its variable (or its `tapd.configure()` keyword), its
    default and its help, one row each; and the README sends readers there."""
    everything = every_declared_setting()
    assert everything <= set(SETTINGS), {s.name for s in everything - set(SETTINGS)}
    rows = page_rows()
    assert len(rows) == len(SETTINGS)
    for declared, cells in zip(SETTINGS, rows, strict=True):
        variable, _, _, default, also, what = (cell.strip() for cell in cells)
        if declared.variable is not None:
            assert variable == f"`{declared.variable}`", (declared.name, variable)
        else:  # block_warning_after: only tapd.configure() sets it
            assert variable == NO_VARIABLE, (declared.name, variable)
            assert f"`tapd.configure({declared.name}=)`" in also, (declared.name, also)
        assert default.replace("\\|", "|") == declared.shown_default, declared.name
        assert what.replace("\\|", "|") == declared.help, declared.name
    names = [cells[0].strip() for cells in rows if cells[0].strip() != NO_VARIABLE]
    assert len(names) == len(set(names)), "a variable has two rows"
    readme = (ROOT / "README.md").read_text()
    assert "docs/SETTINGS.md" in readme
    assert "<!-- settings table" not in readme, "the table lives on docs/SETTINGS.md only"


@pytest.mark.fast
def test_a_setting_the_page_would_miss_is_found() -> None:
    """The check above compares against every Setting object of tapd/settings/, so a new
    one that is not listed in SETTINGS (and so not on the page) fails it."""
    stray = Setting("stray", int, "not listed", ("emitter",), variable="TAPD_STRAY")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(settings_module, "STRAY", stray, raising=False)
        assert stray in every_declared_setting()
        assert stray not in SETTINGS
    assert stray not in every_declared_setting()


# Each daemon setting, from each of its sources, with the value it must come out as. The
# TOML value is TOML source text: typed (integers, floats, booleans, strings), as a user
# writes it. `needs`: other TOML keys a value needs to be valid (a tcp:// endpoint needs
# CurveZMQ keys or --insecure).
@dataclasses.dataclass(frozen=True)
class Case:
    toml: str
    env: str
    flag: tuple[str, ...]
    expected: object
    needs: str = ""


DAEMON_CASES = {
    "endpoint": Case(
        '"ipc:///tmp/tapd-test/other.sock"',
        "ipc:///tmp/tapd-test/other.sock",
        ("--endpoint", "ipc:///tmp/tapd-test/other.sock"),
        "ipc:///tmp/tapd-test/other.sock",
    ),
    "dormant": Case("false", "0", ("--no-dormant",), False),
    "tcp": Case(
        '"tcp://127.0.0.1:5555"',
        "tcp://127.0.0.1:5555",
        ("--tcp", "tcp://127.0.0.1:5555"),
        "tcp://127.0.0.1:5555",
        needs="insecure = true",
    ),
    "curve_secret_key": Case(
        '"/keys/daemon.key_secret"',
        "/keys/daemon.key_secret",
        ("--curve-secret-key", "/keys/daemon.key_secret"),
        Path("/keys/daemon.key_secret"),
    ),
    "curve_allowed": Case(
        '"/keys/allowed"',
        "/keys/allowed",
        ("--curve-allowed", "/keys/allowed"),
        Path("/keys/allowed"),
    ),
    "insecure": Case("true", "1", ("--insecure",), True),
    "forward": Case(
        '"tcp://upstream.example:5555"',
        "tcp://upstream.example:5555",
        ("--forward", "tcp://upstream.example:5555"),
        "tcp://upstream.example:5555",
        needs="insecure = true",
    ),
    "forward_server_key": Case(
        '"/keys/upstream.key"',
        "/keys/upstream.key",
        ("--forward-server-key", "/keys/upstream.key"),
        Path("/keys/upstream.key"),
    ),
    "policy": Case('"spool"', "spool", ("--policy", "spool"), "spool"),
    "spool_dir": Case(
        '"/var/spool/t"', "/var/spool/t", ("--spool-dir", "/var/spool/t"), Path("/var/spool/t")
    ),
    "spool_bytes": Case(
        "2_000_000_000", "2000000000", ("--spool-bytes", "2000000000"), 2_000_000_000
    ),
    "spool_fallback": Case(
        '"drop_newest"', "drop_newest", ("--spool-fallback", "drop_newest"), "drop_newest"
    ),
    "queue_bytes": Case("65536", "65536", ("--queue-bytes", "65536"), 65536),
    "emitter_window_bytes": Case(
        "1048576", "1048576", ("--emitter-window-bytes", "1048576"), 1048576
    ),
    "subscriber_timeout": Case("2.5", "2.5", ("--subscriber-timeout", "2.5"), 2.5),
    "startup_grace": Case("0.25", "0.25", ("--startup-grace", "0.25"), 0.25),
    "drain_timeout": Case("3", "3", ("--drain-timeout", "3"), 3.0),  # a TOML integer
    "wake_ack_timeout": Case("0.75", "0.75", ("--wake-ack-timeout", "0.75"), 0.75),
    "coalesce": Case("0.004", "0.004", ("--coalesce", "0.004"), 0.004),
    "max_message_bytes": Case("4096", "4096", ("--max-message-bytes", "4096"), 4096),
    "pidfile": Case(
        '"/tmp/t/x.pid"', "/tmp/t/x.pid", ("--pidfile", "/tmp/t/x.pid"), Path("/tmp/t/x.pid")
    ),
    "idle_exit": Case("30.5", "30.5", ("--idle-exit", "30.5"), 30.5),
    "started_by": Case("4242", "4242", ("--started-by", "4242"), 4242),
    "log_level": Case('"debug"', "debug", ("--log-level", "debug"), "debug"),
    "metrics": Case('"127.0.0.1:0"', "127.0.0.1:0", ("--metrics", "127.0.0.1:0"), "127.0.0.1:0"),
}


@pytest.fixture
def no_tapd_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TAPD_"):
            monkeypatch.delenv(name)


@pytest.mark.fast
@pytest.mark.usefixtures("no_tapd_variables")
@pytest.mark.parametrize("spelling", ["-", "_"])
def test_every_daemon_setting_is_a_config_field_a_start_option_a_toml_key_and_a_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spelling: str
) -> None:
    parsed = vars(build_parser().parse_args(["start"]))
    assert {s.name for s in DAEMON_SETTINGS} == set(config_module.Config.__dataclass_fields__)
    assert set(DAEMON_CASES) == {s.name for s in DAEMON_SETTINGS}, "a setting without a case"
    assert all(s in DAEMON_SETTINGS or s.name == "config" for s in START_OPTIONS)
    for declared in DAEMON_SETTINGS:
        case = DAEMON_CASES[declared.name]
        assert declared.variable and declared.variable.startswith("TAPD_"), declared
        assert declared.name in parsed or declared.global_flag, declared.flag  # an option
        assert case.expected != getattr(config_module.load({}, None, {}), declared.name)
        key = declared.name.replace("_", spelling)
        needs = tmp_path / f"{declared.name}-needs.toml"
        needs.write_text(f"[daemon]\n{case.needs}\n")
        toml = tmp_path / f"{declared.name}.toml"
        toml.write_text(f"[daemon]\n{key} = {case.toml}\n{case.needs}\n")
        loaded = {
            "toml": config_module.load({}, toml, {}),
            "env": config_module.load({}, needs, {declared.variable: case.env}),
        }
        monkeypatch.setenv("TAPD_CONFIG", str(needs))
        global_flags, start_flags = (case.flag, ()) if declared.global_flag else ((), case.flag)
        args = build_parser().parse_args([*global_flags, "start", *start_flags])
        loaded["flag"] = daemon_config(args)
        monkeypatch.delenv("TAPD_CONFIG")
        for source, config in loaded.items():
            value = getattr(config, declared.name)
            assert value == case.expected, (declared.name, source, value)
            assert type(value) is type(case.expected), (declared.name, source, value)


@pytest.mark.fast
@pytest.mark.usefixtures("no_tapd_variables")
def test_flags_beat_variables_which_beat_the_toml_file_which_beats_the_defaults(
    tmp_path: Path,
) -> None:
    toml = tmp_path / "tapd.toml"
    toml.write_text("[daemon]\nqueue-bytes = 1000\ndormant = false\ndrain-timeout = 4.5\n")
    environ = {"TAPD_QUEUE_BYTES": "2000", "TAPD_DORMANT": "1"}
    defaults = config_module.load({}, None, {})
    assert (defaults.queue_bytes, defaults.dormant, defaults.drain_timeout) == (
        256 * 10**6,
        True,
        10.0,
    )
    from_file = config_module.load({}, toml, {})
    assert (from_file.queue_bytes, from_file.dormant, from_file.drain_timeout) == (1000, False, 4.5)
    from_env = config_module.load({}, toml, environ)
    assert (from_env.queue_bytes, from_env.dormant, from_env.drain_timeout) == (2000, True, 4.5)
    flags = {"queue_bytes": "3000", "drain_timeout": None}  # None: not given
    from_flags = config_module.load(flags, toml, environ)
    assert (from_flags.queue_bytes, from_flags.dormant, from_flags.drain_timeout) == (
        3000,
        True,
        4.5,
    )


@pytest.mark.fast
@pytest.mark.parametrize(
    ("line", "wanted"),
    [
        ("queue-bytes = 2.5", "is not an integer"),  # would have been 2 bytes
        ('queue-bytes = "65536"', "is not an integer"),
        ("spool_bytes = true", "is not an integer"),
        ("drain-timeout = true", "is not a number"),  # would have been one second
        ('subscriber-timeout = "10"', "is not a number"),
        ("dormant = 1", "is not true or false"),
        ('insecure = "yes"', "is not true or false"),
        ("log-level = 7", "is not a string"),
        ("pidfile = 42", "is not a string"),
        ('policy = ["block"]', "is not a string"),
    ],
)
def test_a_toml_value_of_the_wrong_type_is_refused_naming_the_file_and_key(
    tmp_path: Path, line: str, wanted: str
) -> None:
    toml = tmp_path / "tapd.toml"
    toml.write_text(f"[daemon]\n{line}\n")
    key = line.split(" = ")[0]
    with pytest.raises(ConfigError, match=re.escape(f"{toml}: {key} = ") + f".*{wanted}"):
        config_module.load({}, toml, {})


@pytest.mark.fast
def test_every_variable_is_declared_once_and_read_through_the_table() -> None:
    variables = [s.variable for s in SETTINGS if s.variable]
    assert len(variables) == len(set(variables))
    assert set(EMITTER_SETTINGS) <= set(SETTINGS)
    # setup.py and tapd/native/build.py run without tapd (a build), so read their own.
    standalone = {ROOT / "setup.py", ROOT / "tapd" / "native" / "build.py"}
    sources = [*ROOT.glob("tapd/**/*.py"), *ROOT.glob("client/**/*.py"), ROOT / "setup.py"]
    for source in sources:
        text = source.read_text()
        for name in re.findall(r"\bTAPD_[A-Z0-9_]*[A-Z0-9]\b", text):
            assert name in variables, f"{source.relative_to(ROOT)} names undeclared {name}"
        if source in standalone or source.is_relative_to(ROOT / "tapd" / "settings"):
            continue
        for read in READS.finditer(text):
            assert not read, f"{source.relative_to(ROOT)} reads a variable itself: {read[0]}"


@pytest.mark.fast
@pytest.mark.parametrize(
    "name", ["subscriber_timeout", "drain_timeout", "startup_grace", "wake_ack_timeout"]
)
def test_a_negative_wait_is_refused_naming_it(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name} must be >= 0, got -1.0"):
        config_module.load({}, None, {f"TAPD_{name.upper()}": "-1"})


@pytest.mark.fast
@pytest.mark.parametrize("value", ["-0.001", "1.5"])
def test_a_coalescing_wait_outside_0_to_1_second_is_refused_naming_it(value: str) -> None:
    with pytest.raises(ConfigError, match=f"coalesce must be between 0 and 1 second, got {value}"):
        config_module.load({}, None, {"TAPD_COALESCE": value})


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("on", True), ("0", False), ("strict", "strict"), ("STRICT", "strict")],
)
def test_ordered_is_a_boolean_that_also_takes_strict(raw: str, value: object) -> None:
    assert from_environment_of({"TAPD_ORDERED": raw}).ordered == value


def test_an_ordered_value_that_is_neither_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match="TAPD_ORDERED: ordered='sometimes' is not a valid"):
        from_environment_of({"TAPD_ORDERED": "sometimes"})
    with pytest.raises(ConfigError, match="ordered 'sometimes' is not True, False or strict"):
        EmitterSettings(ordered="sometimes")  # type: ignore[arg-type]
