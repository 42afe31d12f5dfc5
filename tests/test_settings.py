"""The settings table (tapd/settings/): one declaration per setting, from which the
`tapd start` options, the TOML keys, the variables and README's table are made; and the
daemon's and the emitter's policies, which used to share TAPD_POLICY."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Daemon, SubscriberProcess, run_emitter
from tapd import config as config_module
from tapd.cli.commands.daemon import START_OPTIONS
from tapd.cli.main import build_parser
from tapd.emitter.settings import EmitterSettings, from_environment
from tapd.errors import ConfigError
from tapd.settings import DAEMON_SETTINGS, EMITTER_SETTINGS, SETTINGS, setting
from tapd.settings.markdown import markdown_table

ROOT = Path(__file__).resolve().parent.parent
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


# ---- one table ----------------------------------------------------------------------------


def test_readme_has_the_table_the_settings_make() -> None:
    found = TABLE.search((ROOT / "README.md").read_text())
    assert found is not None, "README.md has no settings table between its markers"
    assert found.group(1) == markdown_table(), (
        "README's settings table is out of date: paste `python -m tapd.settings --markdown`"
    )
    printed = subprocess.run(
        [sys.executable, "-m", "tapd.settings", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert printed == markdown_table()


def test_every_daemon_setting_is_a_config_field_a_start_option_a_toml_key_and_a_variable(
    tmp_path: Path,
) -> None:
    parsed = vars(build_parser().parse_args(["start"]))
    assert {s.name for s in DAEMON_SETTINGS} == set(config_module.Config.__dataclass_fields__)
    samples = {bool: "1", int: "7", float: "0.5", Path: "/x/y", str: None}
    for declared in DAEMON_SETTINGS:
        assert declared.variable and declared.variable.startswith("TAPD_"), declared
        assert declared.name in parsed or declared.global_flag, declared.flag  # an option
        raw = declared.choices[-1] if declared.choices else samples[declared.base_type]
        if raw is None:
            continue  # text with a format of its own (endpoints, levels): tests of their own
        expected = declared.convert(raw, "test")
        flags: dict[str, str] = {}
        for source in ("env", "toml"):
            environ = {declared.variable: raw} if source == "env" else {}
            toml = tmp_path / f"{declared.name}.toml"
            toml.write_text(f"[daemon]\n{declared.name.replace('_', '-')} = {raw!r}\n")
            loaded = config_module.load(flags, toml if source == "toml" else None, environ)
            assert getattr(loaded, declared.name) == expected, (declared.name, source)
    assert all(s in DAEMON_SETTINGS or s.name == "config" for s in START_OPTIONS)


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
