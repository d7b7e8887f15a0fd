"""The multi-process job on CPU: T=1 target, D=2 drafters (gloo), a drafter SIGKILLed mid-run, two
launches forming one drafter group as two hosts, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from jobs import PIPELINE_SETS, finish_all, start_job, wait_for

from dflash.pipeline.state_copy import copy_dir
from dflash.pipeline.transport import name_for_run
from dflash.rundir import RunDir

COMMON = [*PIPELINE_SETS, "--set", "pipeline.queue_depth=4"]


def _launch(
    repo: Path,
    tmp: Path,
    run_dir: Path,
    *extra: str,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    return start_job("dflash.launch", repo, tmp, run_dir, *COMMON, *extra, env=env)


def test_drafter_sigkill_restarts_group_targets_survive(repo, tmp_path):
    run_dir = tmp_path / "run"
    total = 40
    proc = _launch(
        repo,
        tmp_path,
        run_dir,
        "--set",
        "pipeline.drafters=2",
        "--set",
        f"train.total_steps={total}",
        "--set",
        "train.checkpoint_every=8",
        "--set",
        "pipeline.state_copy_every=0",  # the checkpoint path (the copies': test_state_copy_job.py)
        env={"DFLASH_LOG_BATCHES": "1"},
    )
    run = RunDir(run_dir)
    wait_for(lambda: (run.checkpoints / "step-16").exists(), 240, proc)
    target_pid = run.read_events("launched")[0]["targets"]["target-0"]
    victim = json.loads(run.heartbeat_path("drafter", 1).read_text())["pid"]
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    _check_timelines(run, killed_at)

    restart = run.read_events("restart")
    assert len(restart) == 1 and restart[0]["generation"] == 1 and restart[0]["resumed_from"] >= 16
    # The target process kept its weights: same pid from launch to the end, started once.
    assert json.loads(run.heartbeat_path("target", 0).read_text())["pid"] == target_pid
    stopped = run.read_events("stopped")[-1]
    assert stopped["reason"] == "completed" and stopped["target_starts"] == {"target-0": 1}
    assert run.read_events("drafters_done")[-1]["step"] == total
    assert (run.checkpoints / f"step-{total}").exists()
    # No batch lost: everything produced was acked (trained) or is still ready at the end, and within
    # one generation no batch was trained twice.
    q = stopped["queue"]
    assert q["produced"] == q["acked"] + stopped["ready_at_end"]
    batches = run.read_events("batch")
    for gen in {b["generation"] for b in batches}:
        ids = [(b["target"], b["batch"]) for b in batches if b["generation"] == gen]
        assert len(ids) == len(set(ids)), f"a batch was delivered twice within generation {gen}"
    # With one target and FIFO delivery, the batches that left the queue are exactly 0..n-1, and each
    # was trained (the killed drafter's leased batch was delivered again).
    trained = {b["batch"] for b in batches}
    assert trained == set(range(q["produced"] - stopped["ready_at_end"]))


DRAFTER_PHASES = [
    "imports",
    "cuda_init",
    "rendezvous",
    "target_config",
    "frozen_head_load",
    "model_build",
    "state_restore",
    "lease_reclaim",
    "first_batch",
    "first_step",
]
TARGET_PHASES = [
    "imports",
    "cuda_init",
    "data",
    "model_load",
    "queue_attach",
    "first_batch",
    "first_forward",
    "first_publish",
]
RESTART_PHASES = ["death_detection", "stop_old_workers", "respawn", "process_start"]


def _contiguous(ev: dict) -> float:
    """The phases follow each other without a gap from the origin; returns their sum."""
    at = ev["origin_at"]
    for p in ev["phases"]:
        assert abs(p["start"] - at) < 0.01 and p["seconds"] >= 0, (p, at, ev["phases"])
        at = p["start"] + p["seconds"]
    assert abs(at - ev["ready_at"]) < 0.01, ev
    return sum(p["seconds"] for p in ev["phases"])


def _check_timelines(run: RunDir, killed_at: float) -> None:
    """Each start's `generation_start`: the drafter group's first start from the launch, its restart
    from the SIGKILL, the target's first start; phases in order, adding up to the measured gap."""
    starts = run.read_events("generation_start")
    drafters = sorted((e for e in starts if e["role"] == "drafter-group"), key=lambda e: e["generation"])
    assert [e["generation"] for e in drafters] == [0, 1], starts
    first, restart = drafters
    assert [p["phase"] for p in first["phases"]] == ["launcher_start", "process_start", *DRAFTER_PHASES]
    assert first["origin"] == "launch" and first["restart"] is False
    launched = run.read_events("launched")[0]["t"]
    assert abs(first["origin_at"] - launched) < 1.0, (first["origin_at"], launched)
    assert [p["phase"] for p in restart["phases"]] == [*RESTART_PHASES, *DRAFTER_PHASES]
    assert restart["origin"] == "death" and restart["restart"] is True
    # The death as the job sees it (the dead rank's last heartbeat) is the kill, within its beat.
    assert killed_at - 1.1 <= restart["origin_at"] <= killed_at + 0.05, (restart["origin_at"], killed_at)
    # The measured gap: the SIGKILL to the first trained step of the new generation (the event's
    # own time comes right after that step), against the phases' sum.
    gap = restart["t"] - killed_at
    total = _contiguous(restart)
    assert abs(total - gap) <= 0.1 * gap, (total, gap, restart["phases"])
    assert abs(restart["total_s"] - total) < 0.01
    assert restart["resumed_from"] >= 16 and restart["resumed_from_kind"] == "checkpoint"
    assert restart["died_at_step"] >= restart["resumed_from"]
    assert restart["rolled_back_steps"] == restart["died_at_step"] - restart["resumed_from"]
    assert restart["first_step"] == restart["resumed_from"] + 1
    (shape,) = restart["graphs"]
    assert (
        restart["graphs"][shape]
        <= next(p for p in restart["phases"] if p["phase"] == "first_step")["seconds"]
    )
    _contiguous(first)
    (target,) = [e for e in starts if e["role"] == "target"]
    assert target["worker"] == "target-0" and target["generation"] == 0 and target["origin"] == "spawn"
    names = [p["phase"] for p in target["phases"]]
    assert names == ["process_start", *TARGET_PHASES], names
    _contiguous(target)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launches_form_one_drafter_group(repo, tmp_path):
    port = _free_port()
    procs = []
    for node in (0, 1):
        procs.append(
            _launch(
                repo,
                tmp_path,
                tmp_path / f"host{node}",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--set",
                "train.total_steps=12",
                "--set",
                "train.checkpoint_every=6",
                "--set",
                "pipeline.rdzv_timeout_s=120",
            )
        )
    outs = finish_all(procs, timeout=300)
    for node, (p, out) in enumerate(zip(procs, outs, strict=True)):
        logs = "".join(
            f"\n--- {f.name}\n{f.read_text()[-3000:]}"
            for f in sorted((tmp_path / f"host{node}" / "logs").glob("*.log"))
        )
        assert p.returncode == 0, f"host {node} exited {p.returncode}:\n{out}{logs}"
    for node in (0, 1):
        run = RunDir(tmp_path / f"host{node}")
        assert run.read_events("stopped")[-1]["reason"] == "completed"
        assert run.heartbeat_path("target", node).exists(), "targets are indexed per host"
        assert (run.checkpoints / "step-12").exists(), "every host keeps its own checkpoint replica"
    starts = [e for n in (0, 1) for e in RunDir(tmp_path / f"host{n}").read_events("started")]
    assert [e["world_size"] for e in starts] == [2], "one group of two drafters; its rank 0 logs the start"
    plan = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.launch",
            str(repo / "configs" / "demo-cpu.toml"),
            "--plan",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "10.0.0.1:29400",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = plan.stdout.strip().splitlines()
    assert len(lines) == 2 and "--node-rank 0" in lines[0] and "--node-rank 1" in lines[1]
    assert all("--rdzv-endpoint 10.0.0.1:29400" in ln for ln in lines)


def test_sigterm_stops_gracefully_with_checkpoint(repo, tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(
        repo, tmp_path, run_dir, "--set", "train.total_steps=100000", "--set", "train.checkpoint_every=100000"
    )
    run = RunDir(run_dir)
    copies = copy_dir(f"{name_for_run(run_dir)}-n0")
    wait_for(lambda: len(run.read_metrics()) >= 2 and (copies / "tensors").exists(), 240, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert not copies.exists(), "the drafter state copies outlived a graceful stop"
    stopped = run.read_events("stopped")[-1]
    assert stopped["reason"] == "signal SIGTERM"
    done = run.read_events("drafters_done")[-1]
    assert done["stopped_by_signal"] and done["step"] > 0
    assert run.read_events("checkpoint")[-1]["step"] == done["step"]
    for hb in run.workers.glob("*-*.json"):
        if hb.name.endswith(".data.json"):
            continue
        assert json.loads(hb.read_text())["state"] == "stopped", hb.name


def test_a_restarted_targets_timeline_runs_from_its_death(repo, tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(
        repo, tmp_path, run_dir, "--set", "pipeline.restart_targets=true", "--set", "train.total_steps=100000"
    )
    run = RunDir(run_dir)
    wait_for(lambda: len(run.read_metrics()) >= 1, 240, proc)
    killed_at = time.time()
    os.kill(run.read_events("launched")[0]["targets"]["target-0"], signal.SIGKILL)
    target_starts = lambda: [e for e in run.read_events("generation_start") if e["role"] == "target"]  # noqa: E731
    wait_for(lambda: len(target_starts()) == 2, 120, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    restart = target_starts()[1]
    assert restart["generation"] == 1 and restart["restart"] and restart["origin"] == "death"
    names = [p["phase"] for p in restart["phases"]]
    assert names == ["death_detection", "respawn", "process_start", *TARGET_PHASES], names
    assert killed_at - 1.1 <= restart["origin_at"] <= killed_at + 0.05
    gap = restart["t"] - killed_at
    total = _contiguous(restart)
    assert abs(total - gap) <= 0.1 * gap, (total, gap, restart["phases"])


def test_target_death_stops_job_cleanly(repo, tmp_path):
    run_dir = tmp_path / "run"
    proc = _launch(
        repo, tmp_path, run_dir, "--set", "train.total_steps=100000", "--set", "train.checkpoint_every=100000"
    )
    run = RunDir(run_dir)
    wait_for(lambda: len(run.read_metrics()) >= 1, 240, proc)
    os.kill(run.read_events("launched")[0]["targets"]["target-0"], signal.SIGKILL)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out
    stopped = run.read_events("stopped")[-1]
    assert stopped["reason"].startswith("target-0 died")
    assert run.read_events("worker_died")[0]["worker"] == "target-0"
    assert run.read_events("checkpoint"), "the drafters saved a final checkpoint"
    assert not copy_dir(f"{name_for_run(run_dir)}-n0").exists(), "state copies outlived a failed job"


def test_missing_host_fails_with_a_clear_reason(repo, tmp_path):
    """One of two hosts never starts: the group gives up after rdzv_timeout_s and says why."""
    proc = _launch(
        repo,
        tmp_path,
        tmp_path / "host0",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--rdzv-endpoint",
        f"127.0.0.1:{_free_port()}",
        "--set",
        "pipeline.rdzv_timeout_s=8",
    )
    out = finish_all([proc], timeout=180)[0]
    assert proc.returncode == 1, out
    reason = RunDir(tmp_path / "host0").read_events("stopped")[-1]["reason"]
    assert "did not form" in reason and "rdzv_timeout_s=8" in reason, reason


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_run_dir_in_use_is_refused_and_orphaned_workers_stop_themselves(repo, tmp_path):
    """A second job on a live run directory is refused. When the supervisor is SIGKILLed (no
    clean-up runs), every worker notices within a heartbeat, checkpoints and exits on its own."""
    run_dir = tmp_path / "run"
    args = ["--set", "train.total_steps=100000", "--set", "train.checkpoint_every=100000"]
    proc = _launch(repo, tmp_path, run_dir, *args)
    run = RunDir(run_dir)
    wait_for(lambda: len(run.read_metrics()) >= 1, 240, proc)

    second = _launch(repo, tmp_path, run_dir, *args)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2 and "in use by another job" in out and str(proc.pid) in out, out

    launched = run.read_events("launched")[0]
    workers = [
        json.loads(run.heartbeat_path("target", 0).read_text())["pid"],
        json.loads(run.heartbeat_path("drafter", 0).read_text())["pid"],
        launched["drafter_group_pid"],
    ]
    proc.kill()
    proc.wait()
    # The run-dir lock lives on in the workers: while any of them runs, no second job may start.
    import fcntl

    with open(run.lock_path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            acquired = True
        except BlockingIOError:
            acquired = False
        assert not (acquired and not all(_gone(pid) for pid in workers)), "lock free while workers run"
    deadline = time.time() + 120
    try:
        while not all(_gone(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.5)
        assert all(_gone(pid) for pid in workers), "workers outlived their supervisor"
    finally:  # orphans are out of the conftest clean-up's reach (no parent to find them from)
        for pid in workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert json.loads(run.heartbeat_path("drafter", 0).read_text())["state"] == "stopped"
    assert run.read_events("drafters_done")[-1]["stopped_by_signal"]
    assert run.read_events("checkpoint"), "the orphaned drafters saved a checkpoint on their way out"
    # No clean-up ran: the drafter state copies are left in /dev/shm, and the next job's start
    # (dflash.pipeline.supervisor.state_copies) sweeps them, their supervisor being gone.
    from dflash.pipeline.state_copy import remove_stale_copies

    copies = copy_dir(f"{name_for_run(run_dir)}-n0")
    assert copies.exists()
    assert copies in remove_stale_copies() and not copies.exists()


def test_launch_arguments_are_checked_before_anything_starts(repo, capsys):
    from dflash.pipeline.supervisor import main

    config = str(repo / "configs" / "demo-cpu.toml")
    assert main([config, "--plan", "--nnodes", "2"]) == 2
    assert "--rdzv-endpoint HOST0:PORT" in capsys.readouterr().err
    assert main([config, "--plan", "--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"]) == 2
    assert "--node-rank 2 must be in 0..1" in capsys.readouterr().err
    assert main([config, "--plan", "--nnodes", "0"]) == 2
    assert "--nnodes must be >= 1" in capsys.readouterr().err


def test_same_error_before_the_first_step_twice_stops_at_once(repo, tmp_path):
    """A drafter group that fails the same deterministic way in two consecutive generations (here: the
    run directory holds a checkpoint of another drafter) stops the job there, the error in the
    stopped event, instead of spending all of pipeline.max_restarts on it."""
    from dflash.checkpoint import save_checkpoint

    run_dir = tmp_path / "run"
    other = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "sliding_window": 3}
    save_checkpoint(
        RunDir(run_dir).checkpoints,
        4,
        weights={},
        hf_config=other,
        trainer_state={"trainer": {}, "data": {}, "rng": {}},
        keep_last=3,
    )
    proc = _launch(repo, tmp_path, run_dir, "--set", "pipeline.max_restarts=6")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    run = RunDir(run_dir)
    stopped = run.read_events("stopped")[-1]
    assert "twice in a row" in stopped["reason"], stopped
    assert "is of a different drafter" in stopped["error"], stopped
    generations = {e["generation"] for e in run.read_events("worker_error")}
    assert generations == {0, 1}, "stopped after the second identical failure, restarts 2..6 unspent"
