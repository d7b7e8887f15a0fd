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


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Wait for launches that depend on each other (hosts of one group). When one fails or time runs
    out, the others are stopped (SIGTERM, then the launcher's forced stop) instead of being left
    waiting for a peer that is gone; every launch's output comes back for the assertion message."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.5)
    for sig in (signal.SIGTERM, signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)
        time.sleep(2)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs
