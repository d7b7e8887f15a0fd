"""A minimal local Debian image with python3 and g++ (inductor compiles C++ on CPU) for the Docker tests: made once per engine with
debootstrap + docker import (nothing can be pulled here) and reused by tag."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

BASE_TAG = "dflash-test-base:bookworm-gxx"


@pytest.fixture(scope="session")
def base_image() -> str:
    """A minimal Debian with python3, made once per Docker engine and reused by tag (one maker at a
    time: pytest-xdist workers each ask for it)."""
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_base_image()


LOCK = Path(tempfile.gettempdir()) / "dflash-test-base-image.lock"


def _make_base_image() -> str:
    if subprocess.run(["docker", "image", "inspect", BASE_TAG], capture_output=True).returncode == 0:
        return BASE_TAG
    if not shutil.which("debootstrap"):
        pytest.fail("debootstrap is needed to make the test base image (./dev test installs it)")
    with tempfile.TemporaryDirectory(prefix="dflash-base-") as tmp:
        root = Path(tmp, "root")
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates,g++",
                "bookworm",
                str(root),
            ],
            check=True,
            capture_output=True,
            timeout=1200,
        )
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "import", "-", BASE_TAG],
            stdin=tar.stdout,
            check=True,
            capture_output=True,
            timeout=600,
        )
        assert tar.wait() == 0
    return BASE_TAG
