"""A graceful stop is not a death: `dflashctl stop` on a real CPU job in tmux with `dflashctl watch`
running gives no critical finding, no `dead_worker` in the report, and a drafter exit code of 0;
a drafter that dies after the stop began (here: frozen, then SIGKILLed while the group stops) is
still a death, with a non-zero exit code, no restart, and watch's critical `dead_worker`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from jobs import start_job
from run_cli import DEMO, REPO, Cli

from dflash.rundir import RunDir

pytestmark = pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux")


def _wait(pred, timeout: float, what: str) -> Any:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _step(run_dir: Path) -> int:
    try:
        return int(json.loads((run_dir / "workers" / "drafter-0.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0


def test_a_graceful_stop_with_watch_running_is_no_death(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    sets = ["train.total_steps=100000", "run.status_interval_s=1", "train.checkpoint_every=100000"]
    args = [a for s in sets for a in ("--set", s)]
    out = cli("run", DEMO, "--runs-root", str(cli.runs), "--name", "gs", *args, "--json")
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    run_id, run_dir = plan["run_id"], Path(plan["hosts"][0]["run_dir"])
    log = tmp_path / "watch.log"
    watch = subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "watch", run_id, "--grace", "5"],
        env=cli.env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    watched = None
    try:
        _wait(lambda: _step(run_dir) > 3, 240, "the drafter to train")
        time.sleep(2)  # watch has seen the healthy run
        stopped_at = time.time()
        result = json.loads(cli("stop", run_id, "--json", timeout=400).stdout)
        assert result["graceful"] and result["state"] == "stopped", result
        # watch ends by itself once the job stopped for good; its exit code is its findings' worst.
        watched = watch.wait(timeout=60)
    finally:
        watch.terminate()
        watch.wait(timeout=30)
        cli("stop", run_id, "--force", check=False)
    text = log.read_text()
    evs = RunDir(run_dir).read_events()
    stop = next(e for e in evs if e["event"] == "stopped")
    assert stop["reason"] == "signal SIGTERM" and stop["drafter_exit_code"] == 0, stop
    done = next(e for e in evs if e["event"] == "drafters_done")
    assert done["stopped_by_signal"] and done["step"] > 3
    assert [e["step"] for e in evs if e["event"] == "checkpoint"] == [done["step"]], "one final checkpoint"
    assert not [e for e in evs if e["event"] == "restart"], "no drafter died"
    findings = [e for e in evs if e["event"] == "finding" and e["t"] >= stopped_at]
    assert findings == [], (findings, text[-4000:])  # watch records warnings and criticals
    assert watched == 0, text[-4000:]
    said = " ".join(text.split())
    assert (
        f"the job was stopped on request (signal SIGTERM), the drafters' final step {done['step']}" in said
    ), text[-4000:]
    assert "dead" not in said.split("the job was stopped")[-1], text[-4000:]
    for hb in (run_dir / "workers").glob("*-[0-9].json"):
        assert json.loads(hb.read_text())["state"] == "stopped", hb.name
    report = json.loads(cli("report", str(run_dir), "--json", "--out", str(tmp_path / "r.png")).stdout)
    assert "dead_worker" not in report["findings"] and report["findings_by_severity"].get("critical", 0) == 0
    assert report["stop_reason"] == "signal SIGTERM"


def test_a_drafter_that_dies_during_the_stop_is_a_death(repo: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    sets = ["train.total_steps=100000", "train.checkpoint_every=100000", "pipeline.max_restarts=3"]
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, *[a for s in sets for a in ("--set", s)])
    run = RunDir(run_dir)
    _wait(lambda: _step(run_dir) > 2 or proc.poll() is not None, 240, "the drafter to train")
    victim = json.loads(run.heartbeat_path("drafter", 0).read_text())["pid"]
    os.kill(victim, signal.SIGSTOP)  # it cannot take the stop: it will die in it
    stopped_at = time.time()
    proc.send_signal(signal.SIGTERM)
    _wait(lambda: (run_dir / "stopping").exists(), 30, "the supervisor's stop file")
    time.sleep(1)  # the SIGTERM to the worker is pending in the frozen process
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=240)
    stop = run.read_events("stopped")[-1]
    assert stop["reason"] == "signal SIGTERM" and stop["drafter_exit_code"] not in (0, None), (stop, out)
    assert not [e for e in run.read_events("restart") if e["t"] >= stopped_at], "no restart during a stop"
    assert not run.read_events("drafters_done") and not run.read_events("checkpoint")
    assert (
        "the failed drafter group is not restarted"
        in (run_dir / "logs" / "drafter-group-node0.log").read_text()
    )
    cli = Cli(tmp_path)
    once = cli("watch", str(run_dir), "--once", "--json", check=False)
    (doc,) = json.loads(once.stdout)["hosts"]
    kinds = {(f["kind"], f["subject"], f["severity"]) for f in doc["findings"]}
    assert ("dead_worker", "drafter-0", "critical") in kinds, doc["findings"]
    (job,) = [f for f in doc["findings"] if f["kind"] == "job_stopped"]
    assert job["severity"] == "warning" and "a drafter died while it stopped" in job["message"], job
    assert once.returncode == 2
