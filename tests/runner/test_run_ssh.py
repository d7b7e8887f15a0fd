"""`dflashctl run --host` over a real OpenSSH server on loopback: one host, then two "hosts" whose
drafters form one group; ps, logs and stop from the launching side."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from run_cli import DEMO, LONG, REPO, Cli, alive, events, recorded_pids

pytestmark = pytest.mark.ssh
VENV = str(REPO / ".venv")


def _cli(tmp_path: Path, sshd_server) -> Cli:  # type: ignore[no-untyped-def]
    cli = Cli(tmp_path, DFLASH_SSH_OPTS=sshd_server.opts)
    cli.seed_runs_root()
    return cli


def _no_masters_left() -> None:
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "ControlPath=/tmp/dflashctl-ssh-" not in ps, "an ssh ControlMaster outlived its command"


def test_run_over_ssh_then_ps_logs_stop(tmp_path: Path, sshd_server) -> None:  # type: ignore[no-untyped-def]
    cli = _cli(tmp_path, sshd_server)
    out = cli(
        "run",
        DEMO,
        "--host",
        sshd_server.host,
        "--venv",
        VENV,
        "--runs-root",
        str(cli.runs),
        "--name",
        "sh",
        *LONG,
        "--json",
    )
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    hp = plan["hosts"][0]
    assert hp["host"] == sshd_server.host and hp["argv"][0] == f"{VENV}/bin/python"
    run_dir = Path(hp["run_dir"])
    _no_masters_left()
    cli.wait_step(run_dir, 2)
    assert cli.wait_state(plan["run_id"], {"running"})["hosts"] == [sshd_server.host]
    assert "step=" in cli("logs", "sh", "-n", "100").stdout
    manifest = json.loads((run_dir / "run.json").read_text())
    assert manifest["runner"]["hosts"] == [sshd_server.host] and manifest["config"]
    # watch's sampler runs on the host through the same ssh path (the bundle fed to python3 -).
    snap = json.loads(cli("watch", "sh", "--once", "--json", check=False).stdout)
    (node,) = snap["hosts"]
    assert node["ssh_host"] == sshd_server.host and node["node_rank"] == 0, node
    workers = {w["name"]: w for w in node["workers"]}
    assert workers["drafter-0"]["alive"] and workers["target-0"]["alive"], workers
    assert snap["exit_code"] in (0, 1, 2) and "findings" in node
    pids = recorded_pids(run_dir)
    result = json.loads(cli("stop", "sh", "--json", timeout=400).stdout)
    assert result["graceful"] and result["state"] == "stopped"
    assert [p for p in pids if alive(p)] == []
    assert list((run_dir / "checkpoints").glob("step-*"))
    _no_masters_left()


def test_two_hosts_form_one_drafter_group(tmp_path: Path, sshd_server) -> None:  # type: ignore[no-untyped-def]
    cli = _cli(tmp_path, sshd_server)
    hosts = [sshd_server.host, f"127.0.0.1:{sshd_server.port}"]
    sets = ["train.total_steps=12", "train.checkpoint_every=6", "pipeline.rdzv_timeout_s=120"]
    out = cli(
        "run", DEMO, *[a for h in hosts for a in ("--host", h)], "--venv", VENV, "--runs-root", str(cli.runs),
        "--name", "mh", *[a for s in sets for a in ("--set", s)], "--json",
    )  # fmt: skip
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    assert plan["nnodes"] == 2 and plan["rdzv_endpoint"].startswith("127.0.0.1:")
    run_dirs = [Path(h["run_dir"]) for h in plan["hosts"]]
    assert [d.name for d in run_dirs] == [f"{plan['run_id']}-node0", f"{plan['run_id']}-node1"]
    for i, h in enumerate(plan["hosts"]):
        assert h["argv"][h["argv"].index("--node-rank") + 1] == str(i)
        assert h["argv"][h["argv"].index("--rdzv-endpoint") + 1] == plan["rdzv_endpoint"]
    row = cli.wait_state(plan["run_id"], {"stopped", "failed"}, timeout=400)
    logs = "".join(
        f"\n--- {f}\n{f.read_text()[-2000:]}" for d in run_dirs for f in sorted((d / "logs").glob("*.log"))
    )
    assert row["state"] == "stopped", f"{row}{logs}"
    for d in run_dirs:
        assert events(d, "stopped")[-1]["reason"] == "completed"
        assert (d / "checkpoints" / "step-12").exists(), "every host keeps its checkpoint replica"
    starts = [e for d in run_dirs for e in events(d, "started")]
    assert [e["world_size"] for e in starts] == [2], "one drafter group across both hosts"
    _no_masters_left()
