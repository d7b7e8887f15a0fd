"""`python -m dflash.launch CONFIG --plan [--json]`: every host's command, as data and as shell lines."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from dflash.pipeline.supervisor import main

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo-cpu.toml")


def _plan(capsys, *argv: str) -> str:
    assert main([DEMO, "--set", "train.total_steps=5", "--plan", *argv]) == 0
    return capsys.readouterr().out


def test_json_plan_is_the_text_plan(capsys, tmp_path):
    hosts = ["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400", "--run-dir", str(tmp_path / "r")]
    plan = json.loads(_plan(capsys, *hosts, "--json"))
    assert plan["nnodes"] == 2 and plan["rdzv_endpoint"] == "10.0.0.1:29400"
    assert plan["run_dir"] == str(tmp_path / "r")
    assert [h["node_rank"] for h in plan["hosts"]] == [0, 1]
    assert plan["hosts"][1]["run_dir"] == f"{tmp_path / 'r'}-node1"
    assert plan["hosts"][1]["module_args"] == [
        "dflash.launch",
        DEMO,
        "--set",
        "train.total_steps=5",
        "--run-dir",
        f"{tmp_path / 'r'}-node1",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
    ]
    text = _plan(capsys, *hosts).strip().splitlines()
    assert text == [shlex.join([sys.executable, "-m", *h["module_args"]]) for h in plan["hosts"]]


def test_one_host_plan_and_default_run_dir(capsys):
    plan = json.loads(_plan(capsys, "--json"))
    assert plan["nnodes"] == 1 and plan["rdzv_endpoint"] == "127.0.0.1:0"
    assert Path(plan["run_dir"]).name.startswith("demo-cpu-"), "stamped like a new run's directory"
    assert plan["hosts"][0]["run_dir"] == plan["run_dir"] + "-node0"


def test_json_plan_through_the_real_cli_and_its_errors(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "dflash.launch", DEMO, "--plan", "--json", "--nnodes", "2"]
        + ["--rdzv-endpoint", "h0:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout.strip().splitlines()[-1])["hosts"]) == 2
    assert main([DEMO, "--json"]) == 2, "--json alone is no plan (and starts nothing)"
    assert "--json goes with --plan" in capsys.readouterr().err


def test_good_rendezvous_endpoints_pass(capsys):
    from dflash.plan.hosts import endpoint_problem

    for endpoint in ("10.0.0.1:29400", "gpu0:1", "gpu-0.cluster_a.local:65535", "[fd00::1]:29400", "[::1]:2"):
        assert endpoint_problem(endpoint) is None, endpoint
    plan = json.loads(_plan(capsys, "--nnodes", "2", "--rdzv-endpoint", "[fd00::1]:29400", "--json"))
    assert plan["rdzv_endpoint"] == "[fd00::1]:29400"
