"""Cross-half: the runner's reader (runner.rundir, no dflash import) parses what the real job writes,
while it runs (lock held, heartbeats, metrics) and after it stopped (lock free, final event)."""

from __future__ import annotations

import time
from pathlib import Path

from jobs import start_job

from dflash.rundir import RUN_FORMAT as JOB_FORMAT
from dflash.rundir import WORKER_STATES as JOB_STATES
from runner.rundir import RUN_FORMAT, WORKER_STATES, RunLocation, read_run


def test_the_halves_agree_on_the_heartbeat_states() -> None:
    assert WORKER_STATES == JOB_STATES, "runner/rundir/reader.py and dflash/rundir.py list the states"


def test_reader_parses_a_live_and_a_finished_job(repo: Path, tmp_path: Path) -> None:
    assert RUN_FORMAT == JOB_FORMAT, "the two halves must agree on run.json's format"
    run_dir = tmp_path / "run"
    proc = start_job(
        "dflash.launch", repo, tmp_path, run_dir,
        "--set", "train.total_steps=100000", "--set", "run.status_interval_s=1",
    )  # fmt: skip
    loc = RunLocation(str(run_dir))
    deadline = time.monotonic() + 240
    view = read_run(loc)
    while time.monotonic() < deadline:
        view = read_run(loc)
        if view.metrics and view.heartbeats.get("drafter-0", {}).get("step", 0) >= 1:
            break
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(1)
    assert view.running and view.state() == "running"
    assert view.lock_pid == proc.pid, "the supervisor holds job.lock"
    assert view.manifest and view.manifest["format"] == RUN_FORMAT and view.manifest["config"]
    assert {"drafter-0", "target-0"} <= set(view.heartbeats)
    assert (
        view.heartbeats["drafter-0"]["role"] == "drafter" and view.heartbeats["target-0"]["device"] == "cpu"
    )
    m = view.latest
    assert m is not None and {"step", "tok_s", "q_pre", "q_hs"} <= set(m)
    assert any(e["event"] == "launched" for e in view.events)
    # A torn last line, as a writer killed mid-write leaves it, is skipped.
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 99999, "tok_')
    assert all(r.get("step") != 99999 for r in read_run(loc).metrics)
    proc.terminate()
    proc.communicate(timeout=240)
    done = read_run(loc)
    assert not done.running and done.state() == "stopped" and done.stop_reason() == "signal SIGTERM"
