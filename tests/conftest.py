"""Shared test set-up: markers that skip when the hardware or engine is absent.

In CI (DFLASH_REQUIRE_REAL=1, set by .ci/run) a missing Docker engine or sshd is a failure, not a
skip: those tests must run for real there. GPU tests always skip without CUDA (run them on the H200).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REQUIRE_REAL = os.environ.get("DFLASH_REQUIRE_REAL") == "1"

# One thread per process, set before anything imports torch: the job tests run two or three job
# processes at once on CI's two cores, and with every process at one thread the job's drafters,
# targets and warm compile under one thread count: one compile context instead of two (inductor
# keys CPU graphs by thread count), half the warm time. The tests of the thread rule set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# One directory of prepared job inputs for the whole session (tests/shared_inputs.py), set here, in
# the first pytest process, so that pytest-xdist's workers inherit it and build them only once.
os.environ.setdefault("DFLASH_TEST_SHARED_INPUTS", tempfile.mkdtemp(prefix="dflash-test-inputs-"))


def _session_cxx_cache() -> None:
    """Inductor's C++ compiles through tests/cxx_cache.py for the session (it says why), set up in
    the first pytest process like the shared inputs, so xdist's workers and every job process a
    test starts inherit it."""
    if os.environ.get("DFLASH_TEST_CXX_CACHE") == "off" or "DFLASH_TEST_CXX" in os.environ:
        return
    real = shutil.which(os.environ.get("CXX") or "g++")
    if real is None:
        return
    root = Path(tempfile.mkdtemp(prefix="dflash-test-cxx-"))
    # Named as the real compiler (g++, clang++): inductor picks its flags by the compiler's name.
    wrapper = root / "bin" / Path(real).name
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -E "{REPO / "tests" / "cxx_cache.py"}" "$@"\n')
    wrapper.chmod(0o755)
    os.environ.update(DFLASH_TEST_CXX=real, DFLASH_TEST_CXX_CACHE=str(root / "objects"), CXX=str(wrapper))


_session_cxx_cache()


def _docker_ok() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _cuda_ok() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    docker = _docker_ok() if any("docker" in i.keywords for i in items) else True
    have_sshd = os.path.exists("/usr/sbin/sshd")
    cuda = _cuda_ok() if any("gpu" in i.keywords for i in items) else True
    slow = os.environ.get("DFLASH_SLOW") == "1"
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device; run on the H200"))
        if "slow" in item.keywords and not slow:
            item.add_marker(pytest.mark.skip(reason="slow: set DFLASH_SLOW=1"))
        # Under REQUIRE_REAL nothing is skipped: the test runs and fails loudly if the engine is absent.
        if "docker" in item.keywords and not docker and not REQUIRE_REAL:
            item.add_marker(pytest.mark.skip(reason="no Docker engine; ./dev test installs and starts one"))
        if "ssh" in item.keywords and not have_sshd and not REQUIRE_REAL:
            item.add_marker(pytest.mark.skip(reason="no sshd; ./dev test installs openssh-server"))


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def _no_jobs_left_behind():
    """A job test that fails before its job exits must not leave the job (and its worker processes,
    which run in their own sessions) competing for the CPU with every later test."""
    yield
    from jobs import STARTED, kill_tree

    for proc in STARTED:
        if proc.poll() is None:
            kill_tree(proc)
    STARTED.clear()


@pytest.fixture(autouse=True)
def _isolated_environ():
    """Code under test may point inductor at a cache dir through os.environ (use_cache_dir does):
    restore the environment after each test so later subprocesses do not inherit it."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


DYNAMO_DEFAULT_RECOMPILE_LIMIT = 8
"""torch._dynamo.config.recompile_limit's default (torch 2.10-2.13)."""


@pytest.fixture(autouse=True)
def _dynamo_recompile_limit_restored():
    """A trainer sets dynamo's process-wide recompile limit from its shape plan (shapes.
    apply_recompile_limit: one job per process in real runs). Built in the pytest process, it must
    not pass its limit on to later tests there: a lower one made a later flex compile hit it."""
    before = sys.modules.get("torch._dynamo")
    saved = before.config.recompile_limit if before is not None else DYNAMO_DEFAULT_RECOMPILE_LIMIT
    yield
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.config.recompile_limit = saved


from docker_base import base_image  # noqa: E402,F401  (fixtures shared across test files)
from sshd import sshd, sshd_server  # noqa: E402,F401
