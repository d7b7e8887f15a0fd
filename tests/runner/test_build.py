"""`dflashctl build` plans: whole-plan comparisons, content-addressed tags, deterministic contexts."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.build import plan_image, plan_venv, write_context
from runner.envs import load_variant
from runner.errors import RunnerError
from runner.lock import read_lock


@pytest.fixture()
def project(repo: Path, tmp_path: Path) -> Path:
    """A copy of the project the test may edit."""
    dst = tmp_path / "proj"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("runner", "dflash", "envs"):
        shutil.copytree(repo / name, dst / name, ignore=ignore)
    for name in ("pyproject.toml", "Dockerfile.cu128", "Dockerfile.cu130", "README.md"):
        if (repo / name).exists():
            shutil.copy2(repo / name, dst / name)
    return dst


def _expected_fingerprint(root: Path, files: list[str], build_args: dict[str, str]) -> str:
    digests = {f: hashlib.sha256((root / f).read_bytes()).hexdigest() for f in files}
    return hashlib.sha256(
        json.dumps({"files": digests, "build_args": build_args}, sort_keys=True).encode()
    ).hexdigest()


def test_plan_is_whole_and_stable(project: Path) -> None:
    v = load_variant("cu130", project)
    plan = plan_image(v, root=project, lock_kind="runner", base_image="dflash-test-base:bookworm")
    lock = read_lock(project / "envs/cu130/runner.lock")
    args = {
        "BASE_IMAGE": "dflash-test-base:bookworm",
        "VARIANT": "cu130",
        "LOCK": "runner.lock",
        "LOCK_SHA256": lock.sha256,
    }
    files = plan.context_files
    assert "Dockerfile.cu130" in files and "envs/cu130/runner.lock" in files and "dflash/envprobe.py" in files
    assert not any("cu128" in f or "__pycache__" in f for f in files)
    fp = _expected_fingerprint(project, files, args)
    labels = {
        "org.opencontainers.image.title": "dflashctl",
        "org.opencontainers.image.version": "0.1.0",
        "org.opencontainers.image.base.name": "dflash-test-base:bookworm",
        "io.dflash.variant": "cu130",
        "io.dflash.lock": "runner.lock",
        "io.dflash.lock-sha256": lock.sha256,
        "io.dflash.fingerprint": fp,
    }
    tag = f"dflash:cu130-runner-{fp[:16]}"
    command = ["env", "DOCKER_BUILDKIT=0", "docker", "build", "-f", "Dockerfile.cu130", "-t", tag]
    for k, val in args.items():
        command += ["--build-arg", f"{k}={val}"]
    for k, val in labels.items():
        command += ["--label", f"{k}={val}"]
    assert plan.to_dict() == {
        "variant": "cu130",
        "lock_kind": "runner",
        "lock": "envs/cu130/runner.lock",
        "lock_sha256": lock.sha256,
        "dockerfile": "Dockerfile.cu130",
        "base_image": "dflash-test-base:bookworm",
        "build_args": args,
        "labels": labels,
        "fingerprint": fp,
        "tag": tag,
        "context_files": files,
        "ca_cert": None,
        "wheelhouse": None,
        "host": None,
        "network": None,
        "command": command + ["-"],
    }
    assert plan_image(v, root=project, lock_kind="runner", base_image="dflash-test-base:bookworm") == plan


def test_tag_follows_the_inputs(project: Path, tmp_path: Path) -> None:
    v = load_variant("cu130", project)
    tag = plan_image(v, root=project).tag
    assert tag.startswith("dflash:cu130-") and plan_image(v, root=project).tag == tag
    # The proxy CA changes how files are fetched, not what is installed: same tag.
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    assert plan_image(v, root=project, ca_cert=ca).tag == tag
    # Another variant's files are not in this image.
    (project / "envs/cu128/requirements.lock").write_text(
        (project / "envs/cu128/requirements.lock").read_text() + "\n"
    )
    assert plan_image(v, root=project).tag == tag
    assert plan_image(v, root=project, base_image="other@sha256:" + "0" * 64).tag != tag
    dockerfile = project / "Dockerfile.cu130"
    dockerfile.write_text(dockerfile.read_text() + "# changed\n")
    tag2 = plan_image(v, root=project).tag
    assert tag2 != tag
    lock = project / "envs/cu130/requirements.lock"
    lock.write_text(lock.read_text() + "# reviewed\n")
    tag3 = plan_image(v, root=project).tag
    assert tag3 not in (tag, tag2)
    (project / "dflash" / "envprobe.py").write_text((project / "dflash/envprobe.py").read_text() + "\n")
    assert plan_image(v, root=project).tag not in (tag, tag2, tag3)


def test_stale_lock_refuses_to_plan(project: Path) -> None:
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('"rich>=13",', '"rich>=13",\n  "six>=1",'))
    with pytest.raises(RunnerError, match="is stale"):
        plan_image(load_variant("cu130", project), root=project, lock_kind="runner")


def test_context_tar_is_deterministic(project: Path, tmp_path: Path) -> None:
    v = load_variant("cu130", project)
    ca = tmp_path / "ca.pem"
    ca.write_text("pem")
    plan = plan_image(v, root=project, lock_kind="runner", ca_cert=ca)
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    write_context(plan, project, a)
    write_context(plan, project, b)
    assert a.read_bytes() == b.read_bytes()
    import tarfile

    with tarfile.open(a) as tar:
        names = tar.getnames()
    assert names == plan.context_files + [".build/ca.pem"]


def test_dry_run_cli_prints_the_plan(repo: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner.cli",
            "build",
            "--variant",
            "cu130",
            "--dry-run",
            "--json",
            "--lock-kind",
            "runner",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
    )
    assert (
        json.loads(out.stdout)
        == plan_image(load_variant("cu130", repo), root=repo, lock_kind="runner").to_dict()
    )
    human = subprocess.run(
        [sys.executable, "-m", "runner.cli", "build", "--variant", "cu130", "--dry-run"],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
    ).stdout
    assert "tag: dflash:cu130-" in human and "io.dflash.lock-sha256" in human


def test_bad_options_say_what_to_do(repo: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "runner.cli",
            "build",
            "--variant",
            "cu130",
            "--dry-run",
            "--wheelhouse",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    # The message is wrapped to the terminal's width wherever the path ends: compare words.
    assert proc.returncode == 1 and "no .whl files" in " ".join(proc.stderr.split())


def test_venv_plan(repo: Path, tmp_path: Path) -> None:
    v = load_variant("cu128", repo)
    plan = plan_venv(v, tmp_path / "env", root=repo, lock_kind="runner", uv="uv", wheelhouse=tmp_path / "wh")
    py = str(tmp_path / "env/bin/python")
    assert plan.commands == [
        ["uv", "venv", "--no-config", "--allow-existing", "--python", "3.12", str(tmp_path / "env")],
        [
            "uv",
            "pip",
            "sync",
            "--no-config",
            "--python",
            py,
            "--require-hashes",
            "--only-binary",
            ":all:",
            "--offline",
            "--no-index",
            "--find-links",
            str(tmp_path / "wh"),
            str(repo / "envs/cu128/runner.lock"),
        ],
        [
            "uv",
            "pip",
            "install",
            "--no-config",
            "--python",
            py,
            "--no-deps",
            "--no-build-isolation",
            "--offline",
            str(repo),
        ],
    ]
