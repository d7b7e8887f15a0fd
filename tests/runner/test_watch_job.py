"""`dflashctl watch` on a real CPU job in tmux, with faults injected from the test, one after the
other on one job (a job start costs a minute on 2 cores): a SIGKILLed drafter (reported within 5 s;
the job's group restarts it; watch sees the recovery), a SIGSTOPped one (reported hung within 30 s,
turned into a dead one by watch), a drafter slowed by a stop/continue duty cycle (an ETA blow-up,
and no kill), and a last SIGKILL when the group has no restarts left (watch relaunches the job, which
resumes from its checkpoint)."""

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
from run_cli import DEMO, REPO, Cli

pytestmark = pytest.mark.skipif(not shutil.which("tmux"), reason="needs tmux")


def _events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def _wait_event(run_dir: Path, pred, timeout: float, since: float) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        for e in _events(run_dir):
            if e["t"] >= since and pred(e):
                return e
        time.sleep(0.25)
    tail = "\n".join(json.dumps(e)[:300] for e in _events(run_dir)[-15:])
    raise AssertionError(f"no matching event within {timeout} s; last events:\n{tail}")


def _drafter(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "workers" / "drafter-0.json").read_text())


def _wait_training(run_dir: Path, after_step: int, timeout: float = 180) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            hb = _drafter(run_dir)
            if hb["step"] > after_step and hb["state"] in ("computing", "waiting_input"):
                return hb
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"drafter never trained past step {after_step}")


def _launch(cli: Cli, name: str, *sets: str) -> tuple[str, Path]:
    args = ["--set", "train.total_steps=100000", "--set", "run.status_interval_s=1"]
    for s in sets:
        args += ["--set", s]
    out = cli("run", DEMO, "--runs-root", str(cli.runs), "--name", name, *args, "--json")
    plan = json.loads(out.stdout.strip().splitlines()[-1])
    return plan["run_id"], Path(plan["hosts"][0]["run_dir"])


def _watch(cli: Cli, run_id: str, log: Path, *extra: str) -> subprocess.Popen[str]:
    """watch as users start it, off a tty: its output (the dashboard whenever findings change) goes
    to `log`, which a failing test quotes."""
    return subprocess.Popen(
        [sys.executable, "-m", "runner.cli", "watch", run_id, "--grace", "5", *extra],
        env=cli.env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _stop_watch(watch: subprocess.Popen[str], log: Path) -> str:
    watch.terminate()
    watch.wait(timeout=30)
    return log.read_text()


def test_watch_kill_stop_slow_and_relaunch(tmp_path: Path) -> None:
    cli = Cli(tmp_path)
    cli.seed_runs_root()
    run_id, run_dir = _launch(cli, "wf", "pipeline.max_restarts=2", "train.checkpoint_every=10")
    log = tmp_path / "watch.log"
    # Steady-state detectors (ETA, throughput) ignore the first warmup_s of a process: 300 s by default.
    watch = _watch(cli, run_id, log, "--threshold", "warmup_s=15")
    try:
        hb = _wait_training(run_dir, 5)
        time.sleep(3)  # watch has seen the healthy run
        # 1. SIGKILL: reported within 5 s, the job's group restarts it, watch sees the recovery.
        killed_at = time.time()
        os.kill(hb["pid"], signal.SIGKILL)
        dead = _wait_event(
            run_dir, lambda e: e["event"] == "finding" and e["kind"] == "dead_worker", 30, killed_at
        )
        assert dead["t"] - killed_at < 5, f"dead drafter reported after {dead['t'] - killed_at:.1f} s"
        assert dead["source"] == "watch" and dead["subject"] == "drafter-0"
        _wait_event(
            run_dir, lambda e: e["event"] == "restart" and e.get("role") == "drafter-group", 120, killed_at
        )
        rec = _wait_event(run_dir, lambda e: e["event"] == "recovered", 180, killed_at)
        assert rec["subject"] == "drafter-0"
        actions = [e for e in _events(run_dir) if e["event"] == "action" and e["t"] >= killed_at]
        assert actions == [], "a dead drafter is the job's to restart; watch only reports it"

        # 2. SIGSTOP: reported hung within 30 s; watch turns it into a dead one; the group restarts.
        hb = _wait_training(run_dir, _drafter(run_dir)["step"])
        stopped_at = time.time()
        os.kill(hb["pid"], signal.SIGSTOP)
        hung = _wait_event(
            run_dir, lambda e: e["event"] == "finding" and e["kind"] == "hung_worker", 60, stopped_at
        )
        assert hung["t"] - stopped_at < 30, f"hung drafter reported after {hung['t'] - stopped_at:.1f} s"
        term = _wait_event(
            run_dir, lambda e: e["event"] == "action" and e["action"] == "terminate", 30, stopped_at
        )
        kill = _wait_event(
            run_dir, lambda e: e["event"] == "action" and e["action"] == "kill", 60, stopped_at
        )
        assert term["target_pid"] == kill["target_pid"] == hb["pid"] and kill["ok"]
        _wait_event(run_dir, lambda e: e["event"] == "restart" and e.get("generation") == 2, 120, stopped_at)
        _wait_event(run_dir, lambda e: e["event"] == "recovered", 180, kill["t"])

        # 3. Slowed by a stop/continue duty cycle: not hung, not killed, but the ETA blows up.
        hb = _wait_training(run_dir, _drafter(run_dir)["step"])
        time.sleep(20)  # past warmup_s: healthy steady ETAs of the new generation
        slow_from = time.time()
        blown = None
        while time.time() - slow_from < 120 and blown is None:
            os.kill(hb["pid"], signal.SIGSTOP)
            time.sleep(2.5)
            os.kill(hb["pid"], signal.SIGCONT)
            time.sleep(0.5)
            blown = next((e for e in _events(run_dir) if e["t"] >= slow_from and e["event"] == "finding"
                          and e["kind"] in ("eta_blowup", "slow_kernels")), None)  # fmt: skip
        assert blown is not None, "a 6x slower drafter went unnoticed"
        later = [e for e in _events(run_dir) if e["event"] == "action" and e["t"] >= slow_from]
        assert later == [], f"a slow but working drafter must not be killed: {later}"

        # 4. The group's restarts are spent: the next death stops the job; watch relaunches it.
        hb = _wait_training(run_dir, _drafter(run_dir)["step"])
        killed_at = time.time()
        os.kill(hb["pid"], signal.SIGKILL)
        stopped = _wait_event(run_dir, lambda e: e["event"] == "stopped", 120, killed_at)
        assert "drafter group failed" in stopped["reason"]
        relaunch = _wait_event(
            run_dir, lambda e: e["event"] == "action" and e["action"] == "relaunch", 60, killed_at
        )
        assert relaunch["ok"], relaunch
        _wait_event(run_dir, lambda e: e["event"] == "launched", 120, relaunch["t"])
        started = _wait_event(
            run_dir, lambda e: e["event"] == "started" and e.get("resumed_from"), 180, relaunch["t"]
        )
        assert started["resumed_from"] >= 10, "the relaunched job resumed from its checkpoint"
        assert cli.wait_state(run_id, {"running"})["state"] == "running"
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- watch output (tail)\n{_stop_watch(watch, log)[-6000:]}") from None
    finally:
        out = _stop_watch(watch, log)
        cli("stop", run_id, "--force", check=False)
    assert "drafter-0" in out and watch.returncode is not None
