"""The `tapd` command: help, health probe codes, detach/status/stop, subscribe MODULE."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import APPS, Daemon, SubscriberProcess, run_emitter, tapd_cmd, wait_until
from tapd import config as config_module
from tapd.cli.exit_codes import ExitCode
from tapd.errors import ConfigError


def stop_and_read(process: subprocess.Popen[str]) -> str:
    process.terminate()
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    return out


def test_help_explains_every_command() -> None:
    result = tapd_cmd("--help")
    assert result.returncode == 0
    for command in ("start", "stop", "status", "check", "subscribe", "tail", "demo", "doctor"):
        assert command in result.stdout
    start_help = tapd_cmd("start", "--help").stdout
    assert "--policy" in start_help and "drop_newest" in start_help


def test_help_typical_use_starts_no_daemon_and_says_when_to_start_one_by_hand() -> None:
    """Since autostart (tapd/autostart.py, tests/test_autostart.py), a user needs a
    subscriber and the JAX program; a daemon is started by hand where a deployment owns
    it (managed hosts, with TAPD_AUTOSTART=0)."""
    text = tapd_cmd("--help").stdout
    typical, _, by_hand = text.partition("Start the daemon by hand")
    typical = typical.partition("Typical use:")[2]
    assert typical and by_hand, text
    minutes = config_module.ON_DEMAND_IDLE_EXIT / 60
    assert f"starts one, which stops after {minutes:g} idle minutes" in " ".join(typical.split())
    commands = [line.split()[1] for line in typical.splitlines() if line.startswith("  tapd ")]
    assert commands == ["subscribe", "tail"]  # and no `tapd start`
    by_hand = " ".join(by_hand.partition("positional arguments:")[0].split())
    assert "managed hosts" in by_hand and "set TAPD_AUTOSTART=0 for the clients" in by_hand
    assert "tapd start --detach" in by_hand


def test_check_exits_unreachable_when_no_daemon(runtime_dir: Path) -> None:
    result = tapd_cmd("check", "--endpoint", f"ipc://{runtime_dir}/none.sock", "--timeout", "0.3")
    assert result.returncode == ExitCode.UNREACHABLE
    assert "unhealthy" in result.stdout


def test_detach_status_check_stop(runtime_dir: Path) -> None:
    env = {"TAPD_RUNTIME_DIR": str(runtime_dir)}
    started = tapd_cmd("start", "--detach", env=env)
    assert started.returncode == 0, started.stderr
    try:
        assert tapd_cmd("check", env=env).returncode == ExitCode.OK
        status = tapd_cmd("status", "--json", env=env)
        assert json.loads(status.stdout)["subscribers"] == []
        assert (runtime_dir / "tapd.pid").exists()
        again = tapd_cmd("start", "--detach", env=env)
        assert again.returncode == ExitCode.ALREADY_RUNNING
    finally:
        stopped = tapd_cmd("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert not (runtime_dir / "tapd.pid").exists()
    assert not (runtime_dir / "tapd.sock").exists()
    assert tapd_cmd("check", "--timeout", "0.3", env=env).returncode == ExitCode.UNREACHABLE


def test_runtime_directory_is_private(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    env = {"TAPD_RUNTIME_DIR": str(runtime)}
    assert tapd_cmd("start", "--detach", env=env).returncode == 0
    try:
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    finally:
        tapd_cmd("stop", env=env)


def test_refuses_a_runtime_directory_others_can_enter(tmp_path: Path) -> None:
    runtime = tmp_path / "open"
    runtime.mkdir(mode=0o755)
    os.chmod(runtime, 0o755)
    result = tapd_cmd("start", env={"TAPD_RUNTIME_DIR": str(runtime)})
    assert result.returncode == ExitCode.CONFIG
    assert "chmod 700" in result.stderr


def test_subscribe_module_runs_host_callback_style_tap_functions(
    start_daemon: Callable[..., Daemon], backend: str
) -> None:
    daemon = start_daemon()
    env = {**os.environ, "PYTHONPATH": f"{APPS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runner = subprocess.Popen(
        [sys.executable, "-m", "tapd", "subscribe", "tap_functions", "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    printer = subprocess.Popen(
        [sys.executable, "-m", "tapd", "subscribe", "tapd.printing", "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    wait_until(lambda: daemon.subscriber_count() == 2, "both subscribers")
    result = run_emitter(daemon.endpoint, "host_callback_api")
    assert result["results"] == [[1, 2], [0, 1, 2], [10.0, 10.0]]  # result= / identity
    assert result["stats"]["delivered"] == 3
    recorded = [
        line
        for line in stop_and_read(runner).splitlines(keepends=True)
        if line.startswith("RECORD")
    ]
    printed = stop_and_read(printer)
    # Both backends know the device; a subscriber names it as the emitter's JAX does
    # (str(device): "cpu:0" in jax 0.10, "TFRT_CPU_0" in jax 0.8).
    import jax

    name = str(jax.local_devices(backend="cpu")[0])
    device = f"TapDevice(platform='cpu', id=0, name={name!r})"
    assert recorded == [
        "RECORD arg=[0, 1] transforms=[] kwargs={}\n",
        f"RECORD arg=[0, 1, 2] transforms=[] kwargs={{'device': {device}}}\n",
    ]
    assert "what: scaled\n[10. 10.]" in printed  # host_callback's id_print format


@pytest.mark.fast
def test_config_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    toml = tmp_path / "tapd.toml"
    toml.write_text('[daemon]\npolicy = "drop_newest"\nqueue-bytes = 1000\ndrain_timeout = 3.5\n')
    env = {"TAPD_QUEUE_BYTES": "2000"}
    config = config_module.load({"drain_timeout": 1.0, "policy": None}, toml, env)
    assert config.policy == "drop_newest"  # file over default
    assert config.queue_bytes == 2000  # env over file
    assert config.drain_timeout == 1.0  # flag over file
    assert config.subscriber_timeout == 10.0  # default
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        (tmp_path / "bad.toml").write_text("colour = 'red'\n")
        config_module.load({}, tmp_path / "bad.toml", {})
    with pytest.raises(ConfigError, match="TAPD_QUEUE_BYTES: queue_bytes='lots' is not"):
        config_module.load({}, None, {"TAPD_QUEUE_BYTES": "lots"})
    with pytest.raises(ConfigError, match="policy 'sometimes'"):
        config_module.load({"policy": "sometimes"}, None, {})


def test_tail_prints_taps_as_they_arrive(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon()
    tail = subprocess.Popen(
        [sys.executable, "-m", "tapd", "tail", "loss", "--endpoint", daemon.endpoint],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    wait_until(lambda: daemon.subscriber_count() == 1, "tail to subscribe")
    run_emitter(daemon.endpoint, "steps", "3")
    lines = [line for line in stop_and_read(tail).splitlines() if "loss:" in line]
    assert [line.split("loss: ")[1] for line in lines] == ["0.0", "1.0", "2.0"]
    assert "#2 step=2]" in lines[2]


def test_doctor_reports_the_native_library_and_the_daemon(runtime_dir: Path) -> None:
    result = tapd_cmd("doctor", "--endpoint", f"ipc://{runtime_dir}/none.sock")
    assert result.returncode == 0
    assert "ring library" in result.stdout
    assert "not answering" in result.stdout
    # Which path taps take on each platform, and why where it is not the native one.
    assert "taps on CPU" in result.stdout and "taps on GPU" in result.stdout
    assert "TPU has no user FFI handlers" in result.stdout


def test_without_the_native_library_auto_falls_back_to_portable_and_says_so_once(
    start_daemon: Callable[..., Daemon],
    start_subscriber: Callable[..., SubscriberProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TAPD_BACKEND", "auto")
    daemon = start_daemon()
    subscriber = start_subscriber(daemon, "loss")
    result = run_emitter(daemon.endpoint, "steps", "5",
                         env={"TEST_HIDE_NATIVE_LIBRARY": "1",
                              "XDG_CACHE_HOME": str(tmp_path)})  # fmt: skip
    assert result["stderr"].count("using the portable backend") == 1
    assert "/nonexistent/c++" in result["stderr"] or "compiler" in result["stderr"]
    assert [r["value"] for r in subscriber.records()] == [0.0, 1.0, 2.0, 3.0, 4.0]
