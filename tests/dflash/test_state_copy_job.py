"""A drafter death resumes from the drafter group's state copy in host shared memory (issue 44), on
the CPU with the real job: no checkpoint until the end, a copy every k steps, the rank that writes
the copies (rank 0 of a two-rank DDP group) SIGKILLed after step N; the new generation resumes at
a step >= N - k from the copy, no batch is lost, none is trained twice beyond the copies' interval,
and the copies are gone once the job ends."""

from __future__ import annotations

import json
import os
import signal

from jobs import PIPELINE_SETS, start_job, wait_for

from dflash.pipeline.state_copy import copy_dir
from dflash.pipeline.transport import name_for_run
from dflash.rundir import RunDir


def _last_step(run: RunDir) -> int:
    try:
        return int(json.loads(run.heartbeat_path("drafter", 0).read_text()).get("step") or 0)
    except (OSError, ValueError):
        return 0


def test_a_killed_drafter_resumes_from_the_state_copy(repo, tmp_path):
    run_dir, total, every, kill_after = tmp_path / "run", 30, 3, 14
    proc = start_job(
        "dflash.launch",
        repo,
        tmp_path,
        run_dir,
        *PIPELINE_SETS,
        "--set",
        f"train.total_steps={total}",
        "--set",
        "train.checkpoint_every=1000",
        "--set",
        f"pipeline.state_copy_every={every}",
        "--set",
        "pipeline.drafters=2",  # a DDP group: each rank restores its own small state, rank 0 the tensors
        "--set",
        f"pipeline.queue_depth={2 * (every + 2) + 1}",
        env={"DFLASH_LOG_BATCHES": "1"},
    )
    run = RunDir(run_dir)
    copies = copy_dir(f"{name_for_run(run_dir)}-n0")
    wait_for(lambda: _last_step(run) >= kill_after, 240, proc, poll=0.05)
    died = _last_step(run)
    assert (copies / "owner").exists(), "the supervisor made no copy directory"
    victim = json.loads(run.heartbeat_path("drafter", 0).read_text())["pid"]
    os.kill(victim, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out

    (restart,) = run.read_events("restart")
    assert restart["resumed_from_kind"] == "copy", restart
    # At most `every` steps lost, counted from the step the heartbeat booked before the kill.
    assert died - every <= restart["resumed_from"] <= died + 1, (died, restart)
    assert restart["resumed_from"] % every == 0
    (start,) = [e for e in run.read_events("generation_start") if e.get("generation") == 1]
    assert start["resumed_from_kind"] == "copy" and start["rolled_back_steps"] <= every
    assert start["spare"] is None  # pipeline.spare_drafters = off: today's path
    stopped = run.read_events("stopped")[-1]
    assert stopped["reason"] == "completed"
    assert run.read_events("drafters_done")[-1]["step"] == total
    # No batch lost: every batch that left the queue was trained, the killed generation's unacked
    # ones again by the next; trained twice only those of the steps after the copy it resumed from.
    q = stopped["queue"]
    assert q["produced"] == q["acked"] + stopped["ready_at_end"]
    batches = run.read_events("batch")
    trained = [b["batch"] for b in batches]
    assert set(trained) == set(range(q["produced"] - stopped["ready_at_end"]))
    twice = len(trained) - len(set(trained))
    assert twice <= every + 1, (twice, restart)
    # Steps of the new generation follow the copy's step on: its first step is the copy's + 1.
    assert start["first_step"] == restart["resumed_from"] + 1
    assert not copies.exists(), f"copies left behind after the job ended: {list(copies.iterdir())}"
