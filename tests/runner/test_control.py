"""control.stop against real processes in a hand-made run directory: which recorded pids it signals
(start times checked), what it reports, and that the library prints nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from run_cli import alive

from runner.launch.control import recorded_processes, stop
from runner.launch.registry import HostRecord, RunRecord
from runner.rundir import RunLocation, read_run

# A stand-in supervisor: handles SIGTERM and holds job.lock as the job does, records `launched`, and
# on SIGTERM records `stopped` and exits; with a delay first, it is a job still starting.
SUPERVISOR = r"""
import fcntl, json, os, signal, sys, time
run, delay = sys.argv[1], float(sys.argv[2])
def event(name, **f):
    with open(os.path.join(run, "events.jsonl"), "a") as out:
        out.write(json.dumps({"t": time.time(), "event": name, "pid": os.getpid(), **f}) + "\n")
def on_term(*_):
    event("stopped", reason="signal SIGTERM")
    sys.exit(0)
time.sleep(delay)
signal.signal(signal.SIGTERM, on_term)  # before the lock, as the job does
fd = os.open(os.path.join(run, "job.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
event("launched", targets={}, drafter_group_pid=None)
while True:
    time.sleep(0.1)
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


def _sleeper(procs: list[subprocess.Popen[bytes]]) -> int:
    p = subprocess.Popen(["sleep", "300"])
    procs.append(p)
    return p.pid


def _record(run_dir: Path, created_at: float) -> RunRecord:
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"format": 1, "command_lines": ["x"]}))
    return RunRecord(
        run_id="ctl-1",
        name="ctl",
        backend="foreground",
        created_at=created_at,
        config="c.toml",
        hosts=[HostRecord(node_rank=0, host=None, run_dir=str(run_dir))],
    )


def _append(run_dir: Path, **rec: object) -> None:
    with (run_dir / "events.jsonl").open("a") as f:
        f.write(json.dumps(rec) + "\n")


def _heartbeat(run_dir: Path, name: str, pid: int, started_at: float) -> None:
    hb = {"pid": pid, "started_at": started_at, "state": "computing"}
    (run_dir / "workers" / f"{name}.json").write_text(json.dumps(hb))


def test_force_stop_spares_a_pid_reused_by_a_stranger(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    created = time.time() - 300
    rec = _record(tmp_path / "run", created)
    run_dir = tmp_path / "run"
    worker = _sleeper(procs)
    _heartbeat(run_dir, "drafter-0", worker, time.time())
    # The run recorded target-0 long ago; that number now belongs to a process started since.
    stranger = _sleeper(procs)
    _append(run_dir, t=created + 10, event="launched", pid=1, targets={"target-0": stranger})
    _append(run_dir, t=created + 20, event="stopped", reason="signal SIGKILL")
    ids = {p.pid: p for p in recorded_processes(read_run(RunLocation(str(run_dir))), created_at=created)}
    assert ids[stranger].latest == created + 10 and not ids[stranger].alive()
    assert ids[worker].alive()

    result = stop(rec, force=True, timeout=0)
    procs[0].wait(timeout=10)
    assert not alive(worker), "the recorded worker is killed"
    assert alive(stranger), "a process that started after its pid was recorded is not the run's"
    assert result.forced and not result.graceful and result.left == {}
    assert capsys.readouterr().out == "", "library code prints nothing"


def test_lock_holder_that_started_before_the_run_is_not_signalled(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(run_dir), "0"])
    procs.append(holder)
    _wait(lambda: read_run(RunLocation(str(run_dir))).running)
    rec = _record(run_dir, time.time() + 60)  # the run was made after this process started
    [ident] = [p for p in recorded_processes(read_run(RunLocation(str(run_dir))), created_at=rec.created_at)]
    assert ident.pid == holder.pid and not ident.alive()
    result = stop(rec, force=True, timeout=0)
    assert holder.poll() is None, "a lock holder older than the run is not killed"
    assert not result.graceful


def test_stop_waits_for_a_starting_supervisor_then_stops_it_cleanly(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    run_dir = tmp_path / "run"
    rec = _record(run_dir, time.time())
    (run_dir / "run.json").write_text(json.dumps({"format": 1}))  # the job has not filled it in yet
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(run_dir), "3"])
    procs.append(sup)
    said: list[str] = []
    result = stop(rec, timeout=60, progress=said.append)
    assert sup.wait(timeout=10) == 0, "the supervisor got SIGTERM once it could handle it"
    assert result.signalled == ["local"] and result.graceful and result.state == "stopped", result
    assert "still starting" in said[0]


def test_stop_of_a_run_that_already_ended_is_not_graceful(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    rec = _record(run_dir, time.time() - 60)
    _append(run_dir, t=time.time() - 30, event="stopped", reason="drafter group failed")
    result = stop(rec, timeout=30)
    assert result.missed == ["local"] and result.signalled == []
    assert not result.graceful and not result.forced and result.state == "failed"


def _wait(cond: object, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_stop_of_a_stale_run_kills_what_it_left_behind(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """The supervisor was killed hard (no lock holder, no `stopped`), a worker lives on."""
    run_dir = tmp_path / "run"
    rec = _record(run_dir, time.time() - 60)
    worker = _sleeper(procs)
    _heartbeat(run_dir, "target-0", worker, time.time())
    _append(run_dir, t=time.time(), event="launched", pid=1, targets={"target-0": worker})
    result = stop(rec, timeout=30)
    procs[0].wait(timeout=10)
    assert result.missed == ["local"] and result.forced and not result.graceful
    assert result.left == {} and result.state == "stale"
