"""Starting the real job (`python -m dflash.train` / `dflash.launch`) on the demo config from tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def start_job(
    module: str, repo: Path, runs_root: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            str(repo / "configs" / "demo-cpu.toml"),
            "--run-dir",
            str(run_dir),
            "--set",
            f"run.runs_root={runs_root}",
            *args,
        ],
        cwd=repo,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
