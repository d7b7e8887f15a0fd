"""`cache restore --dest`: a destination that is not a cache is refused before anything is touched.

A restore moves the old dest aside and later deletes old copies beyond keep_previous, so a dest
that is a user's directory, the current directory or `/` would lose files. Each case runs the real
`dflashctl` (a subprocess) from a scratch working directory under tmp_path, never from the repo:
before this was fixed, `--dest ""` moved the working directory itself aside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_helpers import make_artifact, tree_listing

from runner.cache.restore import previous_copies, restore
from runner.cache.signing import Keyring
from runner.cache.store import Artifact, Store

NO_PROBE = ["--force", "--python", "/nonexistent/python"]
"""restore without probing the destination environment (the dest checks under test come first)."""


@pytest.fixture()
def setup(tmp_path: Path) -> tuple[Path, Artifact, dict[str, str]]:
    """(a working directory holding user files, an artifact in the store, the CLI's env)."""
    store = Store(tmp_path / "store").ensure()
    art = make_artifact(store, tmp_path, tag="d")
    work = tmp_path / "work" / "inner"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    env = {
        **os.environ,
        "DFLASH_CACHE_STORE": str(store.root),
        "DFLASH_STATE_DIR": str(tmp_path / "state"),
        "XDG_CONFIG_HOME": str(tmp_path / "no-config"),
        "COLUMNS": "400",
    }
    return work, art, env


def _restore(cwd: Path, env: dict[str, str], key: str, dest: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runner.cli", "cache", "restore", key, "--dest", dest, *NO_PROBE],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _refused(out: subprocess.CompletedProcess[str], want: str) -> None:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    assert out.returncode == 2, f"exit {out.returncode}\n{text}"
    assert out.stderr.count("error:") == 1 and want in " ".join(out.stderr.split()), text


def test_dangerous_destinations_are_refused_untouched(
    setup: tuple[Path, Artifact, dict[str, str]], tmp_path: Path
) -> None:
    work, art, env = setup
    user = tmp_path / "projects"
    (user / "src").mkdir(parents=True)
    (user / "src" / "main.py").write_text("print('mine')")
    before = tree_listing(tmp_path)
    for dest, want in [
        ("", "is the current directory"),
        (".", "is the current directory"),
        (str(work), "is the current directory"),
        ("..", "is a parent of the current directory"),
        (str(tmp_path), "is a parent of the current directory"),
        ("/", "is the filesystem root"),
        (str(user), "is a non-empty directory that is not a compile cache"),
    ]:
        _refused(_restore(work, env, art.key, dest), want)
    assert tree_listing(tmp_path) == before, "nothing was created, moved or deleted"
    assert (work / "notes.txt").read_text() == "mine" and (user / "src" / "main.py").is_file()


def test_bad_destinations_say_why(setup: tuple[Path, Artifact, dict[str, str]], tmp_path: Path) -> None:
    work, art, env = setup
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for dest, want in [
        (str(a_file / "cache"), "is a file, not a directory"),
        ("/sys/kernel/dflash-cache", "is not writable by this user"),  # read-only even for root
        ("/proc/dflash-cache", "is not writable by this user"),
        (str(tmp_path / ("n" * 300)), "bytes, longer than the"),
        (str(tmp_path / ("n" * 250)), "a restore keeps the old cache as <dest>.prev-<time>"),
    ]:
        _refused(_restore(work, env, art.key, dest), want)
    assert a_file.read_text() == ""


def test_caches_are_accepted_and_only_cache_copies_deleted(
    setup: tuple[Path, Artifact, dict[str, str]], tmp_path: Path
) -> None:
    work, art, env = setup
    # A cache a job compiled into (DFLASH_CACHE_DIR: only inductor/ and triton/) may be replaced.
    job_cache = tmp_path / "live" / "cache"
    (job_cache / "inductor").mkdir(parents=True)
    (job_cache / "triton").mkdir()
    out = _restore(work, env, art.key, str(job_cache))
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads((job_cache / "artifact.json").read_text())["key"] == art.key
    # A user directory someone once put at a `.prev-*` name is never deleted, however old.
    squatter = job_cache.with_name("cache.prev-20000101-000000-000000")
    squatter.mkdir()
    (squatter / "thesis.tex").write_text("mine")
    loaded = Artifact.load(art.path)
    for _ in range(3):
        restore(loaded, job_cache, dest_fingerprint=None, ring=Keyring(), keep_previous=0)
    assert (squatter / "thesis.tex").read_text() == "mine"
    assert previous_copies(job_cache) == [squatter]
    # A restored cache that a job then wrote more into is still a cache (its artifact.json says so).
    (job_cache / "inductor" / "more").write_text("x")
    (job_cache / "notes-by-job").write_text("x")
    assert restore(loaded, job_cache, dest_fingerprint=None, ring=Keyring()).moved_aside is not None
