"""`dflashctl run --backend foreground`: the job in this terminal, with the same plan and records."""

from __future__ import annotations

import json
from pathlib import Path

from run_cli import DEMO, Cli, events


def test_foreground_run_completes_and_is_recorded(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    sets = ["train.total_steps=8", "train.checkpoint_every=4", "run.status_interval_s=1"]
    out = cli(
        "run", DEMO, "--backend", "foreground", "--runs-root", str(cli.runs), "--name", "fg",
        *[a for s in sets for a in ("--set", s)],
    )  # fmt: skip
    assert "step=" in out.stdout and "completed" in out.stdout, out.stdout
    (row,) = cli.ps()
    assert row["state"] == "stopped" and row["backend"] == "foreground" and row["reason"] == "completed"
    run_dir = Path(row["run_dirs"][0])
    assert "step=" in (run_dir / "logs" / "supervisor.log").read_text()
    assert (run_dir / "checkpoints" / "step-8").exists()
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["runner"]["backend"] == "foreground" and manifest["config"]["train"]["total_steps"] == 8
    assert events(run_dir, "stopped")[-1]["reason"] == "completed"
    attach = cli("attach", "fg", check=False)
    assert attach.returncode == 1 and "foreground" in attach.stderr
