"""`dflashctl run --backend tmux` on this machine with real tmux and the real CPU job; ps, logs, stop."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from run_cli import DEMO, LONG, Cli, alive, events, recorded_pids

pytestmark = pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux (./dev test installs it)")


def test_run_ps_logs_stop_in_tmux(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    marker = tmp_path / "pwned"
    # A runs root full of shell syntax: it must arrive as one literal path, never run.
    runs_root = tmp_path / f"runs $(touch {marker}); `touch {marker}`"
    out = cli(
        "run", DEMO, "--backend", "tmux", "--runs-root", str(runs_root), "--name", "tm", *LONG, "--json"
    )
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    run_id = plan["run_id"]
    run_dir = Path(plan["hosts"][0]["run_dir"])
    assert run_dir.parent == runs_root and run_id.startswith("tm-")
    session = plan["hosts"][0]["tmux_session"]
    assert subprocess.run(["tmux", "has-session", "-t", f"={session}"]).returncode == 0
    cli.wait_step(run_dir, 3)
    row = cli.wait_state(run_id, {"running"})
    assert row["backend"] == "tmux" and row["hosts"] == ["local"]
    assert any(r["run_id"] == run_id for r in json.loads(cli("ps", "--json").stdout)), (
        "running runs are listed"
    )

    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["format"] == 1 and manifest["run_id"] == run_id
    runner = manifest["runner"]
    assert runner["backend"] == "tmux" and runner["argv"]["0"] == plan["hosts"][0]["argv"]
    assert (
        runner["cache_key"]
        and runner["cache_dir"] == f"{cli.home}/.cache/dflashctl/compile/{runner['cache_key']}"
    )
    assert manifest["config"]["run"]["name"] == "tm", "the job filled in its own fields"
    assert manifest["command_lines"], "the job recorded its command line"

    cli.wait_step(run_dir, 3)
    logs = cli("logs", "tm", "-n", "200").stdout
    assert "step=" in logs, logs
    assert "drafter-0" in cli("logs", run_id[:8], "--list").stdout
    assert cli("logs", run_id, "--worker", "target-0", "-n", "5").returncode == 0

    pids = recorded_pids(run_dir)
    assert len(pids) >= 4 and all(alive(p) for p in pids)
    stopped = cli("stop", run_id, "--json", timeout=400)
    result = json.loads(stopped.stdout)
    assert result["graceful"] and result["state"] == "stopped", result
    assert [p for p in pids if alive(p)] == [], "stop left processes of the run behind"
    assert events(run_dir, "stopped")[-1]["reason"] == "signal SIGTERM"
    assert list((run_dir / "checkpoints").glob("step-*")), "a graceful stop writes a final checkpoint"
    assert subprocess.run(["tmux", "has-session", "-t", f"={session}"], capture_output=True).returncode != 0
    assert "step=" in (run_dir / "logs" / "supervisor.log").read_text()
    assert not marker.exists()
    assert cli.ps()[0]["state"] == "stopped"
    # The stopped run's final checkpoint under speculative decoding, in the job's environment.
    measured = json.loads(
        cli("eval", "tm", "--json", "--limit", "2", "--max-new", "8").stdout.splitlines()[-1]
    )
    assert (
        measured["kind"] == "run"
        and measured["source"] == str(run_dir.resolve())
        and measured["prompts"] == 2
    )
    assert 1.0 <= measured["tau"] <= 16 and measured["rounds"] == sum(measured["histogram"].values())
    assert not marker.exists()


def test_force_stop_kills_every_recorded_process(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    out = cli("run", DEMO, "--runs-root", str(cli.runs), "--name", "fk", *LONG, "--json")
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    run_dir = Path(plan["hosts"][0]["run_dir"])
    cli.wait_step(run_dir, 1)
    pids = recorded_pids(run_dir)
    result = json.loads(cli("stop", "fk", "--force", "--json").stdout)
    assert result["forced"] and not result["graceful"]
    assert [p for p in pids if alive(p)] == []
    assert cli.ps()[0]["state"] == "stale", "killed hard: no final event, no process"


def test_stop_right_after_run_reaches_the_starting_job(tmp_path: Path) -> None:
    """`stop` in the startup window: the supervisor may not hold job.lock yet, or hold it before
    its SIGTERM handler is installed. The stop waits until it takes the signal, and says graceful
    only when the run ended `stopped`."""
    cli = Cli(tmp_path)
    out = cli(
        "run", DEMO, "--backend", "tmux", "--runs-root", str(cli.runs), "--name", "early", *LONG, "--json"
    )
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    run_dir = Path(plan["hosts"][0]["run_dir"])
    session = plan["hosts"][0]["tmux_session"]
    result = json.loads(cli("stop", "early", "--json", timeout=400).stdout)
    assert result["signalled"] == ["local"] and result["missed"] == [], result
    assert result["graceful"] and not result["forced"] and result["state"] == "stopped", result
    assert events(run_dir, "stopped")[-1]["reason"] == "signal SIGTERM"
    assert [p for p in recorded_pids(run_dir) if alive(p)] == [], "stop left processes of the run behind"
    assert subprocess.run(["tmux", "has-session", "-t", f"={session}"], capture_output=True).returncode != 0
    assert cli.ps()[0]["state"] == "stopped"
