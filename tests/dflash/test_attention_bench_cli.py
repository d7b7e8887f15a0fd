"""bench/attention_backward.py refuses what it cannot run before it builds any input: --flash (flex's
FlashAttention-4 backend, GPU-only kernels) with --tiny (the CPU smoke run), or without its packages
(the job's environments, this one included, do not ship them)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "attention_backward.py"


def refused(tmp_path: Path, *flags: str) -> str:
    """Run the bench with `flags`; assert it exited 2 (argparse's usage error) and wrote no report; its stderr."""
    out = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, str(BENCH), *flags, "--out", str(out)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert not out.exists()
    return r.stderr


def test_flash_with_tiny_is_refused_with_what_to_do(tmp_path: Path) -> None:
    err = refused(tmp_path, "--flash", "--tiny")
    assert "--flash needs a GPU" in err and "drop --tiny or --flash" in err


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_without_its_packages_names_them(tmp_path: Path) -> None:
    err = refused(tmp_path, "--flash")
    assert "--flash needs the flash-attn-4 package" in err and "PYTHONPATH" in err
