"""`dflashctl demo` on the foreground path: the job waited on in the main thread (where its signal
handlers must be installed), watch beside it in a thread."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
from run_cli import Cli, events

from runner.commands.demo import foreground_with_watch
from runner.launch import foreground
from runner.launch.plan import HostPlan
from runner.launch.registry import HostRecord, RunRecord
from runner.watch.session import WatchSession

STUB_JOB = """
import fcntl, json, os, time
fd = os.open("job.lock", os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("step=1", flush=True)
time.sleep(1.5)
with open("events.jsonl", "a") as f:
    f.write(json.dumps({"t": time.time(), "event": "stopped", "reason": "completed"}) + "\\n")
raise SystemExit(int(os.environ.get("STUB_EXIT", "0")))
"""


def stub_host(run: Path, exit_code: int = 0) -> HostPlan:
    """A stand-in supervisor: holds job.lock for 1.5 s, then records a completed stop."""
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "config": {}}))
    return HostPlan(node_rank=0, host=None, run_dir=str(run), runs_root=str(run.parent), cwd=str(run),
                    config_path="", argv=[sys.executable, "-c", STUB_JOB], env={"STUB_EXIT": str(exit_code)},
                    cache_dir="", cache_key=None, cache_action="none", shm_bytes=None, gpus=False)  # fmt: skip


def test_foreground_job_in_the_main_thread_with_watch_beside_it(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "demo-stub"
    hp = stub_host(run)
    spec = tmp_path / "nvml.json"
    spec.write_text(json.dumps({"gpus": []}))
    rec = RunRecord(run_id=run.name, name="demo", backend="foreground", created_at=0.0, config="",
                    hosts=[HostRecord(node_rank=0, host=None, run_dir=str(run))])  # fmt: skip
    session = WatchSession(rec, interval_s=0.1, fake_nvml=str(spec))
    try:
        assert foreground_with_watch([hp], session, None) == 0
    finally:
        session.close()
    assert session.finished(), "watch saw the job finish"
    assert "step=1" in (run / "logs" / "supervisor.log").read_text(), "the job was waited on"
    # watch started judging once the job held job.lock: no "not running" finding from before it.
    assert [e["kind"] for e in events(run, "finding")] == []


def test_foreground_run_off_the_main_thread_leaves_signals_alone(tmp_path: Path) -> None:
    hp = stub_host(tmp_path / "run", exit_code=3)
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(foreground.run([hp], on_line=lambda p, line: None)))
    t.start()
    t.join(timeout=30)
    assert got == [3], "the job's exit code, not a ValueError from signal.signal"


@pytest.mark.slow
def test_demo_without_tmux_runs_in_the_foreground(tmp_path: Path) -> None:
    """The whole demo, scaled down (10 steps, no fault): ~4 min on 2 cores with a cold compile
    cache, ~2 min warm. Opt-in (DFLASH_SLOW=1)."""
    bin_dir = tmp_path / "bin"  # this PATH without tmux
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        for exe in Path(d).glob("*") if Path(d).is_dir() else ():
            if exe.name != "tmux" and not (bin_dir / exe.name).exists():
                (bin_dir / exe.name).symlink_to(exe)
    cli = Cli(tmp_path, PATH=str(bin_dir))
    cli.seed_runs_root()
    out = cli("demo", "--steps", "10", "--no-fault", "--runs-root", str(cli.runs), timeout=900)
    assert "launch in foreground" in out.stdout and "demo done: trained 10 steps" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    # Nothing on the first screen that a new user cannot act on (warn() writes "warning: ..." to stderr).
    assert "warning" not in out.stdout.split("2. watch")[0].lower(), out.stdout
    assert not [line for line in out.stderr.splitlines() if line.lower().startswith("warning")], out.stderr
    (row,) = cli.ps()
    run = Path(row["run_dirs"][0])
    assert row["backend"] == "foreground" and events(run, "stopped")[-1]["reason"] == "completed"
    assert (run / "report.png").is_file()
