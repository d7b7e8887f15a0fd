"""A SIGTERM/SIGINT that reaches `python -m dflash.launch` while it is still opening the run
directory, preparing data or making the hidden-state queue (before any worker starts) stops it in
order: a `stopped` event with the signal as reason, the queue's shared-memory segment unlinked, exit
status 0 as for any signalled stop. Before, the default handler killed the supervisor there."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from jobs import start_job

from dflash.pipeline.transport import name_for_run, segment_path
from dflash.rundir import RunDir


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_before_the_workers_start_stops_in_order(repo: Path, tmp_path: Path, signum: int) -> None:
    run_dir = tmp_path / "run"
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, "--set", "attention.compile=false")
    lock = run_dir / "job.lock"
    deadline = time.monotonic() + 120
    while not lock.exists():  # the run directory is held: open_run_dir is under way or just done
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the job never took its run directory"
        time.sleep(0.005)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    stopped = RunDir(run_dir).read_events("stopped")
    assert [e["reason"] for e in stopped] == [f"signal {signal.Signals(signum).name}"], out
    assert RunDir(run_dir).read_events("launched") == [], "no worker started"
    segment = segment_path(f"{name_for_run(run_dir)}-n0")
    leftovers = sorted(p.name for p in segment.parent.glob(f"{name_for_run(run_dir)}*"))
    assert leftovers == [], leftovers
