"""run puts the compile cache in place: --warm warms and restores it into the managed directory, the
job then compiles warm (no cache_miss); the next launch reuses it. Drift refuses a launch."""

from __future__ import annotations

import json
from pathlib import Path

from run_cli import DEMO, REPO, Cli, events


def test_warm_restore_then_reuse(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    cli = Cli(tmp_path, HOME=str(home))  # its own managed caches: nothing there to reuse yet
    cli.seed_runs_root()
    sets = ["train.total_steps=4", "train.checkpoint_every=4", "run.status_interval_s=1"]
    args = ["--runs-root", str(cli.runs), *[a for s in sets for a in ("--set", s)]]
    cli("run", DEMO, "--backend", "foreground", "--warm", "--name", "wa", *args, timeout=900)
    (row,) = cli.ps()
    assert row["state"] == "stopped", row
    run_dir = Path(row["run_dirs"][0])
    runner = json.loads((run_dir / "run.json").read_text())["runner"]
    assert runner["cache_action"] == "warm" and runner["cache_key"]
    cache_dir = Path(runner["cache_dir"])
    assert cache_dir == home / ".cache" / "dflashctl" / "compile" / runner["cache_key"]
    assert json.loads((cache_dir / "artifact.json").read_text())["key"] == runner["cache_key"]
    assert runner["env"]["DFLASH_EXPECT_WARM_CACHE"] == "1"
    assert events(run_dir, "cache_miss") == [], "the restored artifact did not cover the job's compile"
    compiled = events(run_dir, "compiled")
    assert compiled and all(e["misses"] == 0 for e in compiled), compiled
    again = json.loads(cli("run", DEMO, "--dry-run", "--json", *args).stdout)
    assert again["hosts"][0]["cache_action"] == "reuse"
    assert again["hosts"][0]["cache_dir"] == str(cache_dir)


def test_drift_refuses_unless_allowed(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    base = [
        "run",
        DEMO,
        "--venv",
        str(REPO / ".venv"),
        "--variant",
        "cu130",
        "--dry-run",
        "--runs-root",
        str(cli.runs),
    ]
    refused = cli(*base, check=False)
    assert refused.returncode == 1 and "differs from variant cu130" in refused.stderr, refused.stderr
    assert "torch" in refused.stderr and "--allow-drift" in refused.stderr
    allowed = cli(*base, "--allow-drift")
    assert "launching anyway: --allow-drift" in allowed.stderr
