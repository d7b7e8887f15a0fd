"""`dflashctl doctor`: the probe runs inside the checked environment; drift and torch swaps fail it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from runner.doctor import diagnose, driver_check, required_driver
from runner.envs import load_variant
from runner.lock import read_lock

CLI = [sys.executable, "-m", "runner.cli"]
FIELDS = {
    "schema",
    "python",
    "platform",
    "markers",
    "torch",
    "triton",
    "driver",
    "gpus",
    "packages",
    "paths",
    "disk_free_bytes",
    "tools",
    "errors",
}


def _probe(python: str, repo: Path, cwd: str = "/") -> dict:
    src = (repo / "dflash/envprobe.py").read_text()
    out = subprocess.run([python, "-"], input=src, capture_output=True, text=True, check=True, cwd=cwd)
    return json.loads(out.stdout)


def test_probe_from_stdin_prints_the_documented_fields(repo: Path) -> None:
    fp = _probe(sys.executable, repo)
    assert set(fp) == FIELDS
    doc = (repo / "dflash/envprobe.py").read_text().split('"""')[1]
    for key in FIELDS:
        assert f"\n    {key}" in doc, f"{key} is not documented in the module docstring"
    import torch

    assert (
        fp["torch"]["version"] == torch.__version__
        and fp["torch"]["git_version"] == torch.version.git_version
    )
    assert fp["packages"]["torch"] == torch.__version__
    assert fp["python"]["executable"] == sys.executable
    assert fp["markers"]["sys_platform"] == sys.platform


def test_probe_module_form_matches(repo: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dflash.envprobe"], capture_output=True, text=True, check=True, cwd=repo
    )
    # Same working directory: it is on sys.path in both forms, and may hold an egg-info.
    assert json.loads(out.stdout)["packages"] == _probe(sys.executable, repo, cwd=str(repo))["packages"]


def test_doctor_here_prints_fingerprint_and_passes_without_a_lock(repo: Path) -> None:
    proc = subprocess.run([*CLI, "doctor", "--json"], capture_output=True, text=True, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["drift"] is None and report["fingerprint"]["torch"]["version"]


def _gpu_fp(fp: dict, driver: str | None, cuda: str) -> dict:
    # No GPU here: the NVML/torch answers of a GPU host are stated, the rest is this machine's.
    return {
        **fp,
        "driver": {"version": driver, "cuda": None, "source": "nvml" if driver else None},
        "torch": {**fp["torch"], "cuda": cuda},
        "gpus": [
            {
                "index": 0,
                "name": "NVIDIA H200",
                "compute_capability": "9.0",
                "memory_total_mib": 143771,
                "source": "torch",
            }
        ],
    }


def test_driver_vs_cuda(repo: Path) -> None:
    fp = _probe(sys.executable, repo)
    cu130, cu128 = load_variant("cu130", repo), load_variant("cu128", repo)
    assert driver_check(_gpu_fp(fp, "570.124.06", "13.0"), cu130).status == "fail"
    assert driver_check(_gpu_fp(fp, "580.95.05", "13.0"), cu130).status == "ok"
    assert driver_check(_gpu_fp(fp, "570.124.06", "12.8"), cu128).status == "ok"
    assert driver_check(_gpu_fp(fp, "565.57.01", "12.8"), None).status == "fail"
    assert driver_check(_gpu_fp(fp, None, "13.0"), cu130).status == "fail"
    assert (required_driver("13.0"), required_driver("12.8"), required_driver("13.2")) == (580, 570, 580)


def test_torch_swap_against_the_variant(repo: Path) -> None:
    fp = _probe(sys.executable, repo)  # torch 2.13.0+cpu here
    report = diagnose(
        fp,
        target="here",
        variant=load_variant("cu130", repo),
        lock=read_lock(repo / "envs/cu130/requirements.lock"),
    )
    assert not report.ok
    assert report.checks[0].name == "TORCH SWAP" and "the pin is torch==2.11.0" in report.checks[0].detail
    assert {
        "name": "torch",
        "expected": "2.11.0",
        "installed": fp["packages"]["torch"],
    } in report.drift.different


@pytest.fixture(scope="module")
def runner_venv(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv with the runner lock and the project (no torch), made by `dflashctl build --venv`."""
    path = tmp_path_factory.mktemp("venv") / "env"
    env = {**os.environ}
    proc = subprocess.run(
        [
            *CLI,
            "build",
            "--variant",
            "cu130",
            "--lock-kind",
            "runner",
            "--venv",
            str(path),
            "--venv-python",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return path


def test_cli_runs_without_torch(runner_venv: Path) -> None:
    py = str(runner_venv / "bin/python")
    assert subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0
    for args in ([], ["build"], ["doctor"], ["lock"]):
        proc = subprocess.run(
            [str(runner_venv / "bin/dflashctl"), *args, "--help"], capture_output=True, text=True, cwd="/"
        )
        assert proc.returncode == 0, proc.stderr
        assert "Usage" in proc.stdout


def test_drift_in_a_real_venv(repo: Path, runner_venv: Path, tmp_path: Path) -> None:
    py = str(runner_venv / "bin/python")
    lock = repo / "envs/cu130/runner.lock"

    def doctor(*args: str) -> tuple[int, dict]:
        proc = subprocess.run(
            [*CLI, "doctor", "--python", py, "--json", *args], capture_output=True, text=True, cwd=repo
        )
        assert proc.returncode in (0, 3), proc.stderr
        return proc.returncode, json.loads(proc.stdout)

    rc, report = doctor("--lock", str(lock))
    assert rc == 0, [c for c in report["checks"] if c["status"] == "fail"]
    assert report["drift"] == {"missing": [], "extra": [], "different": [], "torch_swap": None}
    rc, report = doctor("--variant", "cu130", "--lock-kind", "runner")
    assert rc == 0

    # A stray package, the way the field's environment got polluted.
    subprocess.run(
        [*_uv(), "pip", "install", "--python", py, "--no-deps", "six"], check=True, capture_output=True
    )
    rc, report = doctor("--lock", str(lock))
    assert rc == 3
    assert [e for e in report["drift"]["extra"] if e.startswith("six==")]
    assert any(c["name"] == "extra" and "six==" in c["detail"] for c in report["checks"])

    # A different torch appears (here the CPU 2.13.0 build, made visible through a .pth): a TORCH SWAP
    # against a lock that pins the variant's torch.
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(site, "zz-borrowed-torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    full = (repo / "envs/cu130/requirements.lock").read_text()
    torch_entry = full[full.index("\ntorch==") + 1 :].split("\n# via", 1)[0].split("    # via")[0]
    pinned = tmp_path / "pinned.lock"
    pinned.write_text(lock.read_text() + torch_entry)
    rc, report = doctor("--lock", str(pinned))
    assert rc == 3
    assert report["checks"][0]["name"] == "TORCH SWAP"
    assert "the pin is torch==2.11.0" in report["drift"]["torch_swap"]
    human = subprocess.run(
        [*CLI, "doctor", "--python", py, "--lock", str(pinned)],
        capture_output=True,
        text=True,
        cwd=repo,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert human.returncode == 3 and "TORCH SWAP" in human.stdout and "six==" in human.stdout


def _uv() -> list[str]:
    beside = Path(sys.executable).parent / "uv"
    return [str(beside)] if beside.is_file() else ["uv"]
