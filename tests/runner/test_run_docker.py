"""`dflashctl run --backend docker` on the real Docker engine: the CPU demo in a container built
from the local base, its job environment the project's venv mounted read-only (no torch image can be
built here: nothing is pulled, and the registry's torch is a CUDA build of several GB)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from run_cli import DEMO, LONG, REPO, Cli, events

pytestmark = pytest.mark.docker


def _inspect(name: str) -> dict:
    out = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def test_run_in_docker_then_stop_with_final_checkpoint(tmp_path: Path, base_image: str) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    out = cli(
        "run", DEMO, "--backend", "docker", "--image", base_image, "--venv", str(REPO / ".venv"),
        "--runs-root", str(cli.runs), "--name", "dk", *LONG, "--json",
    )  # fmt: skip
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    hp = plan["hosts"][0]
    run_dir = Path(hp["run_dir"])
    try:
        info = _inspect(hp["container"])
        labels = info["Config"]["Labels"]
        assert labels["io.dflash.run"] == plan["run_id"] and labels["io.dflash.role"] == "supervisor"
        assert info["HostConfig"]["RestartPolicy"]["Name"] in ("", "no")
        assert info["HostConfig"]["ShmSize"] == hp["shm_bytes"] > 256 << 20
        assert info["Config"]["User"] == f"{os.getuid()}:{os.getgid()}"
        assert info["HostConfig"]["Init"] is True
        binds = info["HostConfig"]["Binds"]
        assert f"{cli.runs}:{cli.runs}" in binds and any(b.endswith(":ro") for b in binds)
        cli.wait_step(run_dir, 2)
        assert cli.wait_state(plan["run_id"], {"running"})["backend"] == "docker"
        manifest = json.loads((run_dir / "run.json").read_text())
        assert (
            manifest["runner"]["image_digest"] == info["Image"] and manifest["image_digest"] == info["Image"]
        )
        assert "step=" in cli("logs", "dk", "-n", "50").stdout
        owners = {p.stat().st_uid for p in run_dir.rglob("*")}
        assert owners == {os.getuid()}, "files in the run directory belong to the invoking user"
        result = json.loads(cli("stop", "dk", "--json", timeout=400).stdout)
        assert result["graceful"] and result["state"] == "stopped", result
        assert _inspect(hp["container"])["State"]["Status"] == "exited"
        assert events(run_dir, "stopped")[-1]["reason"] == "signal SIGTERM"
        assert list((run_dir / "checkpoints").glob("step-*")), "the graceful stop checkpointed"
    finally:
        subprocess.run(["docker", "rm", "-f", hp["container"]], capture_output=True)
