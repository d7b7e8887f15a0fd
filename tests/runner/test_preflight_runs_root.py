"""Preflight hands --runs-root to the job's own check on every host, so a runs root the job cannot
write is refused before anything starts there: on remote hosts this check is the only one (the
runner's own probe of the runs root runs on this machine only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from run_cli import DEMO

from runner.cache.store import Store
from runner.errors import BadInput
from runner.launch.plan import Request
from runner.launch.preflight import preflight


def test_job_check_sees_the_runs_root(tmp_path: Path) -> None:
    req = Request(config=DEMO, backend="foreground", runs_root="/sys/kernel/dflash-runs")
    warnings: list[str] = []
    with pytest.raises(BadInput) as e:
        preflight(req, run_id="rr-1", name="rr", store=Store(tmp_path / "store"), warn=warnings.append)
    message = " ".join(str(e.value).split())
    assert "run.runs_root" in message and "/sys/kernel/dflash-runs" in message, message
    assert "not writable by this user" in message, message
