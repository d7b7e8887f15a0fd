"""The real Dockerfile built on a real Docker engine, FROM a local debootstrap base (nothing is pulled).

The CI image uses the runner-only lock so the build stays small; the full CUDA image is the opt-in
`slow` test (it needs the registry for the pinned nvidia/cuda base and torch's CUDA wheels).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.envs import load_variant
from runner.lock import expected_packages, read_lock

CLI = [sys.executable, "-m", "runner.cli"]
pytestmark = pytest.mark.docker


def _ca_args() -> list[str]:
    # This workplace reaches the registry through a TLS-intercepting proxy: its CA rides along.
    ca = os.environ.get("SSL_CERT_FILE")
    return ["--ca-cert", ca] if ca and Path(ca).is_file() else []


@pytest.fixture(scope="module")
def snapshot(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A frozen copy of the project: edits to the checkout during the test must not change the tag."""
    dst = tmp_path_factory.mktemp("snapshot")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("runner", "dflash", "envs"):
        shutil.copytree(repo / name, dst / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "Dockerfile.cu128", "Dockerfile.cu130"):
        if (repo / name).exists():
            shutil.copy2(repo / name, dst / name)
    return dst


def _build(root: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [*CLI, "build", "--variant", "cu130", "--json", *extra, *_ca_args()],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "DFLASH_PROJECT_DIR": str(root)},
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_real_dockerfile_builds_and_matches_its_lock(repo: Path, snapshot: Path, base_image: str) -> None:
    start = time.monotonic()
    first = _build(snapshot, "--lock-kind", "runner", "--base-image", base_image)
    built_s = time.monotonic() - start
    assert first["status"] in ("built", "exists")
    tag = first["tag"]
    lock = read_lock(repo / "envs/cu130/runner.lock")
    assert first["labels"]["io.dflash.lock-sha256"] == lock.sha256
    assert first["labels"]["io.dflash.variant"] == "cu130"
    assert first["labels"]["io.dflash.fingerprint"].startswith(tag.rsplit("-", 1)[1])

    again = _build(snapshot, "--lock-kind", "runner", "--base-image", base_image)
    assert again["status"] == "exists" and again["tag"] == tag and again["image_id"] == first["image_id"]

    user = subprocess.run(
        ["docker", "run", "--rm", tag, "sh", "-c", 'id -un; echo "$DFLASH_LOCK_SHA256"'],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    # Not root; and a job in the image records which lock built it (run.json lock_sha256).
    assert user.stdout.split() == ["dflash", lock.sha256]
    # doctor inside the image: the runner there, the image's own lock, no drift.
    proc = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--network",
            "none",
            tag,
            "dflashctl",
            "doctor",
            "--json",
            "--variant",
            "cu130",
            "--lock-kind",
            "runner",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["drift"]["extra"] == [] and report["drift"]["missing"] == []
    fp = report["fingerprint"]
    want = expected_packages(lock, fp["markers"])
    assert {k: fp["packages"][k] for k in want} == want
    # And from outside, probing the image through docker run -i.
    outside = subprocess.run(
        [*CLI, "doctor", "--image", tag, "--variant", "cu130", "--json"],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    assert outside.returncode == 0, outside.stderr
    print(f"runner image {tag}: first build {built_s:.1f} s ({first['status']})")


@pytest.mark.slow
def test_full_cuda_image(repo: Path, snapshot: Path) -> None:
    v = load_variant("cu130", repo)
    result = _build(snapshot)
    assert result["labels"]["org.opencontainers.image.base.name"] == v.base_image
    proc = subprocess.run(
        [*CLI, "doctor", "--image", result["tag"], "--variant", "cu130", "--json"],
        capture_output=True,
        text=True,
        cwd=repo,
    )
    report = json.loads(proc.stdout)
    assert report["drift"]["torch_swap"] is None and report["fingerprint"]["torch"]["cuda"] == "13.0"
