"""A run name with a '.' (as the shipped qwen3.6-27b-5t3d has), through the real CLI, real tmux and
the real CPU job: the plan shows the derived session, and ps, logs, attach and stop find the run by
the name the user knows. Unsafe names are refused before anything runs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from run_cli import DEMO, LONG, Cli, alive, events, recorded_pids, refused

from runner.launch.control import attach_argv
from runner.launch.registry import Registry

NAME = "demo.v1.2"


@pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux (./dev test installs it)")
def test_a_dotted_config_name_runs_in_tmux_and_every_verb_finds_it(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    # The config's own run.name (a --set is how the job reads it too), not --name.
    args = ["run", DEMO, "--set", f"run.name={NAME}", "--runs-root", str(cli.runs), *LONG]
    shown = cli(*args, "--dry-run").stdout
    assert f"name {NAME}  backend tmux" in shown, shown
    assert "tmux      dflash-demo_v1_2-" in shown, "the plan shows the derived session"

    plan = json.loads(cli(*args, "--json").stdout.strip().splitlines()[-1])
    run_id, hp = plan["run_id"], plan["hosts"][0]
    session = hp["tmux_session"]
    assert plan["name"] == NAME and run_id.startswith(f"{NAME}-")
    assert session == "dflash-" + run_id.replace(".", "_")
    assert subprocess.run(["tmux", "has-session", "-t", f"={session}"]).returncode == 0
    run_dir = Path(hp["run_dir"])
    assert run_dir == cli.runs / run_id
    cli.wait_step(run_dir, 1)
    (row,) = cli.ps()
    assert row["name"] == NAME and row["run_id"] == run_id and row["state"] == "running", row
    assert json.loads((run_dir / "run.json").read_text())["config"]["run"]["name"] == NAME
    assert "drafter-0" in cli("logs", NAME, "--list").stdout
    assert "drafter-0" in cli("logs", session, "--list").stdout, "the name `tmux ls` shows finds it too"
    # attach execs tmux, which needs a terminal: its target is checked against the live window.
    rec = Registry(Path(cli.env["DFLASH_STATE_DIR"])).find(NAME)
    target = attach_argv(rec, rec.hosts[0])[3]
    panes = subprocess.run(
        ["tmux", "list-panes", "-t", target, "-F", "#{window_name}"], capture_output=True, text=True
    )
    assert panes.returncode == 0 and panes.stdout.split() == ["node0"], (target, panes.stderr)

    pids = recorded_pids(run_dir)
    result = json.loads(cli("stop", NAME, "--json", timeout=400).stdout)
    assert result["graceful"] and result["state"] == "stopped", result
    assert [p for p in pids if alive(p)] == [], "stop left processes of the run behind"
    assert events(run_dir, "stopped")[-1]["reason"] == "signal SIGTERM"
    assert subprocess.run(["tmux", "has-session", "-t", f"={session}"], capture_output=True).returncode != 0


def test_unsafe_names_are_refused_before_anything_runs(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    marker = tmp_path / "pwned"
    for bad in (f"x;touch {marker}", f"$(touch {marker})", "-oProxyCommand=id", "a/../b", "a:b", "n" * 49):
        refused(cli, "run", DEMO, "--name", bad, "--runs-root", str(cli.runs), want="(--name) is not allowed")
        refused(
            cli,
            "run",
            DEMO,
            "--set",
            f"run.name={bad}",
            "--runs-root",
            str(cli.runs),
            "--dry-run",
            want=f"(run.name of {DEMO}) is not allowed",
        )
    assert not marker.exists() and not cli.runs.exists() and cli.ps() == []
