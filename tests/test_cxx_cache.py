"""tests/cxx_cache.py, the session's g++ wrapper: the same compile is served from the cache, a changed
source or flag is compiled again, and what comes back loads and runs."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WRAPPER = Path(__file__).resolve().parent / "cxx_cache.py"
SOURCE = 'extern "C" int answer(int x) {{ return x * {k}; }}\n'


def _env(real: str, objects: Path) -> dict[str, str]:
    """The wrapper's environment: the compiler it runs and its object cache."""
    return {**os.environ, "DFLASH_TEST_CXX": real, "DFLASH_TEST_CXX_CACHE": str(objects)}


@pytest.fixture
def compiler(tmp_path: Path):
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++")
    calls = tmp_path / "calls"
    counting = tmp_path / "bin" / "g++"
    counting.parent.mkdir()
    counting.write_text(f'#!/bin/sh\necho x >> "{calls}"\nexec "{real}" "$@"\n')
    counting.chmod(0o755)
    env = _env(str(counting), tmp_path / "objects")

    def build(src: Path, out: Path, *flags: str) -> int:
        """Compile src into out through the wrapper; the real compiler's runs so far."""
        cmd = [sys.executable, str(WRAPPER), str(src), "-O1", *flags, "-shared", "-fPIC", "-o", str(out)]
        subprocess.run(cmd, env=env, check=True)
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    return build


def _answer(so: Path, x: int) -> int:
    return ctypes.CDLL(str(so)).answer(x)


def test_same_compile_is_served_from_the_cache(tmp_path: Path, compiler) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    for d in (a, b):
        (d / "k.cpp").write_text(SOURCE.format(k=3))
    # Each compile also asks the real compiler its --version (part of the key): 2 runs for a miss.
    assert compiler(a / "k.cpp", a / "k.so") == 2
    assert compiler(b / "k.cpp", b / "k.so") == 3, "the same source at another path ran g++ again"
    assert _answer(b / "k.so", 5) == 15 and os.access(b / "k.so", os.R_OK)

    (b / "k.cpp").write_text(SOURCE.format(k=4))  # new contents: compiled, and the new code runs
    assert compiler(b / "k.cpp", b / "k4.so") == 5
    assert _answer(b / "k4.so", 5) == 20
    assert compiler(b / "k.cpp", b / "k4o2.so", "-O2") == 7, "another flag is another object"


def test_what_it_does_not_cache_runs_the_real_compiler(tmp_path: Path, compiler) -> None:
    (tmp_path / "k.cpp").write_text(SOURCE.format(k=2))
    out = tmp_path / "k.i"
    env = _env(shutil.which("g++") or "g++", tmp_path / "objects")
    proc = subprocess.run(
        [sys.executable, str(WRAPPER), "-E", str(tmp_path / "k.cpp"), "-o", str(out)], env=env
    )
    assert proc.returncode == 0 and "answer" in out.read_text()
    assert not (tmp_path / "objects").exists(), "a preprocessing run was cached"
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++\n")
    failed = subprocess.run(
        [sys.executable, str(WRAPPER), str(bad), "-shared", "-o", str(tmp_path / "bad.so")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert failed.returncode != 0 and "error" in failed.stderr
    assert not list((tmp_path / "objects").glob("*.so")), "a failed compile left an object in the cache"
