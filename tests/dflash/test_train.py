"""The single-process job end to end on CPU: run directory contents, SIGKILL + resume at the right step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import start_job

from dflash.rundir import RunDir, parse_status_line

FAST = [
    "--set",
    "attention.compile=false",
    "--set",
    "train.checkpoint_every=4",
    "--set",
    "run.status_interval_s=0.5",
    "--set",
    "train.warmup_steps=2",
]


def _train(repo: Path, runs: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    return start_job("dflash.train", repo, runs, run_dir, *FAST, *extra)


def _train_once(repo: Path, runs: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m dflash.train` on the demo config, to completion (for runs that fail early)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.train",
            str(repo / "configs" / "demo-cpu.toml"),
            "--set",
            f"run.runs_root={runs}",
            *args,
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_dir_contract_and_resume_after_sigkill(repo, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "r1"
    # The first run is far from done when it is killed, however late this test gets scheduled.
    proc = _train(repo, runs, run_dir, "--set", "train.total_steps=1000")
    ckpt = run_dir / "checkpoints" / "step-8"
    deadline = time.time() + 240
    while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert ckpt.exists(), proc.stdout.read() if proc.poll() is not None else "no checkpoint in time"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run = RunDir(run_dir)
    # Heartbeats exist for both roles, with device and state.
    hb = json.loads((run.workers / "drafter-0.json").read_text())
    assert hb["role"] == "drafter" and hb["device"] == "cpu" and hb["state"] != "stopped"
    assert (run.workers / "target-0.json").exists()

    newest = max(int(p.name.split("-")[1]) for p in run.checkpoints.glob("step-*"))
    total = newest + 6
    again = _train(repo, runs, run_dir, "--set", f"train.total_steps={total}")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    started = run.read_events("started")
    assert len(started) == 2 and started[0]["resumed_from"] is None
    assert started[1]["resumed_from"] == newest, "resumes from the newest complete checkpoint"
    assert run.read_events("stopped")[-1]["reason"] == "completed"
    assert run.read_events("stopped")[-1]["step"] == total
    steps = [c["step"] for c in run.read_events("checkpoint")]
    assert steps[-1] == total
    assert sorted(p.name for p in run.checkpoints.iterdir()) == [f"step-{newest + 4}", f"step-{total}"]
    # The status line is printed from the metrics records, in the field's format.
    lines = [ln for ln in out.splitlines() if ln.startswith("[") and " step=" in ln]
    assert lines and parse_status_line(lines[-1])["step"] == total
    recs = run.read_metrics()
    for key in (
        "loss",
        "acc",
        "acc_per_pos",
        "streak",
        "lr",
        "noise",
        "tgt_bps",
        "dft_bps",
        "tok_s",
        "q_pre",
        "q_hs",
        "epoch",
        "eta_s",
        "compile",
        "gpu_mem_gb",
    ):
        assert key in recs[-1], key
    assert len(recs[-1]["acc_per_pos"]) == 15
    manifest = run.read_manifest()
    assert manifest["config"]["train"]["total_steps"] == 1000, "the manifest keeps the first config"
    assert len(manifest["command_lines"]) == 2
    ck = json.loads((run.checkpoints / f"step-{total}" / "config.json").read_text())
    assert ck["block_size"] == 16


def test_bad_data_fails_before_model_load(repo, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    out = _train_once(repo, tmp_path, "--set", f"data.path={empty}", "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 2
    assert "error:" in out.stderr and "empty.jsonl" in out.stderr
    assert not (tmp_path / "r" / "checkpoints").exists() or not any(
        (tmp_path / "r" / "checkpoints").iterdir()
    )


def test_config_error_names_key(repo, tmp_path):
    out = _train_once(repo, tmp_path, "--set", "train.token_budget=-5")
    assert out.returncode == 2 and "train.token_budget" in out.stderr


@pytest.mark.skipif(os.cpu_count() is None, reason="needs cpu count")
def test_sigterm_checkpoints_and_stops(repo, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "r2"
    proc = _train(
        repo, runs, run_dir, "--set", "train.total_steps=400", "--set", "train.checkpoint_every=1000"
    )
    run = RunDir(run_dir)
    deadline = time.time() + 180
    while time.time() < deadline and not run.read_metrics():
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    stopped = run.read_events("stopped")[-1]
    assert stopped["reason"] == "signal SIGTERM"
    assert run.read_events("checkpoint")[-1]["step"] == stopped["step"] > 0


def test_resume_refuses_a_checkpoint_of_another_drafter(repo, tmp_path):
    """Same tensor shapes, different drafter (another mask token): resuming would silently train
    something else, so it is refused, naming what differs."""
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "r"
    first = _train(repo, runs, run_dir, "--set", "train.total_steps=4")
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out
    again = _train(repo, runs, run_dir, "--set", "train.total_steps=8", "--set", "drafter.mask_token_id=5")
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 2 and "different drafter" in out and "dflash_config" in out, out


def test_status_records_come_one_per_read_back_never_two_at_once(repo, tmp_path):
    """The loop keeps one step queued ahead (dflash.step.trainer.StepAhead); a checkpoint step and the last
    step come back together with the step before them. With a status due at every step, the first of
    such a pair gets no record of its own: its interval would be the microseconds between two reads
    (the demo's last record said 166.7K tok/s against 2.4K). Records: 1, 3 (2 came with it), 4, 6."""
    runs = tmp_path / "runs"
    done = _train_once(
        repo,
        runs,
        "--set",
        "attention.compile=false",
        "--set",
        "train.total_steps=6",
        "--set",
        "train.checkpoint_every=3",
        "--set",
        "run.status_interval_s=1e-6",
        "--run-dir",
        str(runs / "r"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run = RunDir(runs / "r")
    assert [r["step"] for r in run.read_metrics()] == [1, 3, 4, 6]
    assert [c["step"] for c in run.read_events("checkpoint")] == [3, 6]
