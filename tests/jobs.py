"""Starting the real job (`python -m dflash.train` / `dflash.pipeline.supervisor`) on the demo config from tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from shared_inputs import seed_runs_root

from dflash.pipeline.supervisor import kill_process_tree

STARTED: list[subprocess.Popen[str]] = []
"""Every job a test started; conftest kills what is left of them after each test, so a failed test
cannot leave a training job loading the 2 CI cores for the rest of the run."""


PIPELINE_SETS = [
    "--set",
    "attention.compile=false",
    "--set",
    "run.status_interval_s=1",
    "--set",
    "pipeline.prefetch_depth=4",
    "--set",
    "train.warmup_steps=2",
    "--set",
    "pipeline.spare_drafters=off",
    "--set",
    "train.tau_eval=false",
]
"""The pipeline job tests' overrides of the demo config: eager attention (no compile on CI's two
cores), a status line every second, a short warm-up, no spare drafter process and no in-job tau (more
processes on CI's two cores; tests/dflash/test_spare_job.py and test_tau_job.py turn them on)."""


def wait_for(
    pred: Callable[[], bool], timeout: float, proc: subprocess.Popen[str], poll: float = 0.2
) -> None:
    """Until pred() holds; fails with the job's output if the job exits first, or on timeout."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early:\n{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(poll)
    raise AssertionError("timed out")


def kill_tree(proc: subprocess.Popen[str]) -> None:
    """The job's own kill_process_tree (workers run in sessions of their own), then reap."""
    kill_process_tree(proc.pid)
    try:
        proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError):
        pass


def start_job(
    module: str,
    repo: Path,
    runs_root: Path,
    run_dir: Path,
    *args: str,
    env: dict[str, str] | None = None,
    config: Path | None = None,
) -> subprocess.Popen[str]:
    """config: the job's TOML (default the demo's). runs_root gets the session's prepared demo
    inputs first (shared_inputs): the tiny target and the demo corpus are not built again."""
    seed_runs_root(runs_root)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            module,
            str(config or repo / "configs" / "demo-cpu.toml"),
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
    STARTED.append(proc)
    return proc


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
    for _ in range(2):  # the first SIGTERM stops gracefully, the second forces
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGTERM)
        if alive:
            time.sleep(2)
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            kill_tree(p)
            outs.append(f"(killed: no exit 60 s after two SIGTERMs; output lost)\nrc={p.returncode}")
    return outs
