"""A spare drafter process takes over a killed drafter's rank (issue 45), on the CPU with the real
job: the new generation skips the imports, CUDA start, frozen head load and model build (and, in
mode graphs, the graphs' first load), its timeline continues at `handover`, a new spare gets ready
for the next death, and the job completes; a spare that died first leaves today's path."""

from __future__ import annotations

import json
import os
import signal

from jobs import PIPELINE_SETS, start_job, wait_for

from dflash.rundir import RunDir


def _last_step(run: RunDir) -> int:
    try:
        return int(json.loads(run.heartbeat_path("drafter", 0).read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def _spare_sets(total: int, mode: str) -> list[str]:
    return [*PIPELINE_SETS, "--set", f"train.total_steps={total}", "--set", f"pipeline.spare_drafters={mode}"]


def _ready(run: RunDir) -> list[dict]:
    return run.read_events("spare_ready") if run.events.exists() else []


def _kill_drafter(run: RunDir) -> int:
    pid = json.loads(run.heartbeat_path("drafter", 0).read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_spare_takes_over_a_killed_drafter(repo, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, *_spare_sets(40, "graphs"))
    run = RunDir(run_dir)
    wait_for(lambda: len(_ready(run)) >= 1 and _last_step(run) >= 4, 240, proc, poll=0.05)
    (first_spare,) = _ready(run)
    assert first_spare["mode"] == "graphs"
    victim = _kill_drafter(run)
    assert victim != first_spare["pid"]  # generation 0 started before its spare was ready
    # The spare that took over is the new drafter; a replacement gets ready for the next death.
    wait_for(lambda: len(_ready(run)) >= 2, 240, proc, poll=0.1)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    (takeover,) = run.read_events("spare_takeover")
    assert takeover["pid"] == first_spare["pid"] and takeover["generation"] == 1
    starts = {e["generation"]: e for e in run.read_events("generation_start")}
    cold, warm = starts[0], starts[1]
    assert cold["spare"] is None and warm["spare"] == "graphs" and warm["spare_pid"] == first_spare["pid"]
    names = [p["phase"] for p in warm["phases"]]
    assert names[: names.index("handover") + 1] == [
        "death_detection",
        "stop_old_workers",
        "respawn",
        "process_start",
        "handover",
    ], names
    for skipped in ("imports", "cuda_init", "target_config", "frozen_head_load", "model_build"):
        assert skipped not in names, names
    assert names[-1] == "first_step" and "state_restore" in names
    # The phases add up to the gap (each starts where the one before ended).
    assert abs(sum(p["seconds"] for p in warm["phases"]) - warm["total_s"]) < 0.05
    for a, b in zip(warm["phases"], warm["phases"][1:], strict=False):
        assert abs(a["start"] + a["seconds"] - b["start"]) < 0.01, (a, b)
    assert run.read_events("stopped")[-1]["reason"] == "completed"
    assert run.read_events("drafters_done")[-1]["step"] == 40
    assert warm["resumed_from_kind"] == "copy"


def test_a_dead_spare_leaves_the_cold_start(repo, tmp_path):
    run_dir = tmp_path / "run"
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, *_spare_sets(30, "host"))
    run = RunDir(run_dir)
    wait_for(lambda: len(_ready(run)) >= 1 and _last_step(run) >= 4, 240, proc, poll=0.05)
    (spare,) = _ready(run)
    assert spare["mode"] == "host"
    os.kill(spare["pid"], signal.SIGKILL)
    _kill_drafter(run)  # before the supervisor's replacement spare can be ready
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    (died,) = run.read_events("spare_died")
    assert died["local_rank"] == 0 and died["exit_code"] == -signal.SIGKILL and died["restarted"]
    assert not run.read_events("spare_takeover")
    starts = {e["generation"]: e for e in run.read_events("generation_start")}
    assert starts[1]["spare"] is None
    assert "imports" in [p["phase"] for p in starts[1]["phases"]]
    assert run.read_events("stopped")[-1]["reason"] == "completed"
