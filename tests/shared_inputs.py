"""The read-only inputs every demo job prepares alike, made once per test session and copied into
each job test's runs root before its job starts: the tiny random target that `target.path = "tiny"`
builds there (dflash.data.demo.make_tiny_target), the demo corpus, the target's responses to it that the
demo trains on (dflash.data.responses) and their tokenized cache. The job then
finds them complete, as a rerun on the same runs root does, and skips seconds of building and
tokenizing on CI's two cores. Building them is tested where it is the subject: the tiny target in
tests/dflash/test_target.py (concurrent builders included), the corpus and the cache in
tests/dflash/test_data.py, and in every test that does not seed its runs root.

One build per session: the directory is named in the environment by the first pytest process
(conftest), so pytest-xdist's workers inherit it, and an flock makes the second worker wait for the
first one's build. It is built by the job's own functions (dflash.manifest), in a subprocess run from
this checkout, so a test process never imports transformers for it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIR_ENV = "DFLASH_TEST_SHARED_INPUTS"
DEMO = REPO / "configs" / "demo-cpu.toml"
SEED_NAMES = (".tiny-target-l8-h64-s0", ".demo", ".responses", ".tokcache")
"""What the demo config (seed 0, 8 layers, hidden 64, data.responses) prepares under its runs root."""

_BUILD = """
import dataclasses, sys
from pathlib import Path
from dflash.config import load_config
from dflash.data.dataset import load_dataset
from dflash.data.inputs import open_target
from dflash.data.prepare import training_data

root = Path(sys.argv[1])
cfg = load_config(sys.argv[2], [f"run.runs_root={root}"])
target, tok, _ = open_target(cfg)
data = dataclasses.replace(cfg.data, path=training_data(cfg, target, tok, lambda _msg: None)[0])
load_dataset(data, tok, root / ".tokcache", lambda _msg: None)
"""


def shared_dir() -> Path:
    path = os.environ.get(DIR_ENV)
    if not path:  # a test run without the conftest (a helper imported on its own)
        path = os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="dflash-test-inputs-")
    return Path(path)


def _built() -> Path:
    root = shared_dir() / "demo"
    done = root / ".complete"
    if done.exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(shared_dir() / ".demo.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if not done.exists():
            built = subprocess.run(
                [sys.executable, "-c", _BUILD, str(root), str(DEMO)],
                cwd=REPO,  # this checkout's dflash, not the one the venv was installed from
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            assert built.returncode == 0, f"building the shared demo inputs failed:\n{built.stderr[-4000:]}"
            missing = [n for n in SEED_NAMES if not (root / n).exists()]
            assert not missing, f"the demo job's runs root did not get {missing}: update SEED_NAMES"
            done.touch()
    finally:
        os.close(fd)
    return root


def seed_runs_root(runs_root: Path) -> Path:
    """Copies (never links: a job may rewrite what it finds) of the demo's prepared inputs in
    runs_root, each only where runs_root has none yet."""
    src = _built()
    runs_root = Path(runs_root)
    runs_root.mkdir(parents=True, exist_ok=True)
    for name in SEED_NAMES:
        if not (runs_root / name).exists():
            shutil.copytree(src / name, runs_root / name)
    return runs_root
