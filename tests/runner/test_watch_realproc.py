"""Real processes, real signals: a tiny worker writes its heartbeat like the job does; the sampler
runs as a subprocess fed its self-contained program (the ssh form, without ssh); the Watcher reads
its lines. SIGKILL must read as dead within 5 s, SIGSTOP as hung (frozen), a worker that keeps its
heartbeat but stops stepping while its input waits as hung, and SIGCONT as recovered."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_watch_fakes import append_jsonl

from runner.watch.bundle import sampler_argv
from runner.watch.detectors import Finding, Thresholds
from runner.watch.watcher import Watcher, start_sampler

WORKER = r"""
import fcntl, json, os, socket, sys, time
run, name, mode = sys.argv[1], sys.argv[2], sys.argv[3]
lock = os.open(os.path.join(run, "job.lock"), os.O_RDWR | os.O_CREAT)
fcntl.flock(lock, fcntl.LOCK_EX)
os.pwrite(lock, f"{os.getpid()}\n".encode(), 0)
role, _, index = name.rpartition("-")
path = os.path.join(run, "workers", name + ".json")
started = last = time.time()
step = 0
while True:
    now = time.time()
    if mode == "progress" or now - started < 1.0:  # "stall": a few steps, then none
        step, last = step + 1, now
    hb = {"pid": os.getpid(), "host": socket.gethostname(), "role": role, "index": int(index),
          "rank": int(index), "device": "cpu", "step": step, "state": "computing",
          "last_progress_at": last, "updated_at": now, "started_at": started}
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(hb))
    os.replace(path + ".tmp", path)  # atomic, as dflash.rundir.Heartbeat writes it
    time.sleep(0.2)
"""

TH = Thresholds(stale_s=2.0, hung_s=3.0, idle_window_s=2.0, sampler_silent_s=5.0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    (tmp_path / "workers").mkdir()
    return tmp_path


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            p.kill()
        p.wait()


def start_worker(
    procs: list[subprocess.Popen], run_dir: Path, name: str, mode: str = "progress"
) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(run_dir), name, mode])
    procs.append(p)
    return p


def start_watch(procs: list[subprocess.Popen], run_dir: Path) -> Watcher:
    sampler = start_sampler(sampler_argv(run_dir, interval_s=0.5, python=sys.executable))
    procs.append(sampler)
    return Watcher(sampler.stdout, TH)


def wait_for(
    watcher: Watcher, pred: Callable[[list[Finding]], bool], timeout: float
) -> tuple[float, list[Finding]]:
    t0 = time.monotonic()
    findings: list[Finding] = []
    while time.monotonic() - t0 < timeout:
        _, findings = watcher.refresh(timeout=0.5)
        if pred(findings):
            return time.monotonic() - t0, findings
    raise AssertionError(f"not within {timeout} s; last findings: {[f.message for f in findings]}")


def about(kind: str, subject: str) -> Callable[[list[Finding]], bool]:
    return lambda fs: any(f.kind == kind and f.subject == subject for f in fs)


def healthy(watcher: Watcher, name: str) -> None:
    def ok(fs: list[Finding]) -> bool:
        w = watcher.history.latest.worker(name) if watcher.history.latest else None
        return w is not None and w.alive is True and (w.step or 0) > 0 and not fs

    wait_for(watcher, ok, 20)


def test_sigkill_reads_as_dead_within_5_s(run_dir: Path, procs: list[subprocess.Popen]) -> None:
    worker = start_worker(procs, run_dir, "drafter-1")
    watcher = start_watch(procs, run_dir)
    healthy(watcher, "drafter-1")
    worker.send_signal(signal.SIGKILL)
    worker.wait()  # reaped, as its parent (torchrun) would
    took, findings = wait_for(watcher, about("dead_worker", "drafter-1"), 5.0)
    dead = next(f for f in findings if f.kind == "dead_worker")
    assert dead.severity == "critical" and f"pid {worker.pid}" in dead.message
    assert any(f.kind == "job_stopped" for f in findings), "the job lock went with the process"
    print(f"SIGKILL reported as dead after {took:.1f} s")


def test_sigstop_reads_as_hung_and_sigcont_as_recovered(run_dir: Path, procs: list[subprocess.Popen]) -> None:
    worker = start_worker(procs, run_dir, "drafter-0")
    watcher = start_watch(procs, run_dir)
    healthy(watcher, "drafter-0")
    os.kill(worker.pid, signal.SIGSTOP)
    took, findings = wait_for(watcher, about("hung_worker", "drafter-0"), TH.stale_s + 5.0)
    hung = next(f for f in findings if f.kind == "hung_worker")
    assert "frozen" in hung.message and "SIGSTOP" in hung.message and hung.numbers["proc_state"] == "stopped"
    assert not any(f.kind == "dead_worker" for f in findings), "a stopped process is not a dead one"
    os.kill(worker.pid, signal.SIGCONT)
    wait_for(watcher, lambda fs: not fs, 10.0)
    print(f"SIGSTOP reported as hung after {took:.1f} s")


def test_alive_but_not_stepping_while_input_waits_reads_as_hung(
    run_dir: Path, procs: list[subprocess.Popen]
) -> None:
    start_worker(procs, run_dir, "drafter-0", mode="stall")
    watcher = start_watch(procs, run_dir)
    append_jsonl(
        run_dir / "metrics.jsonl", {"t": time.time(), "elapsed_s": 600.0, "q_pre": [50], "q_hs": [3]}
    )
    (run_dir / "run.json").write_text(json.dumps({"config": {"run": {"status_interval_s": 60.0}}}))
    took, findings = wait_for(watcher, about("hung_worker", "drafter-0"), TH.hung_s + 10.0)
    hung = next(f for f in findings if f.kind == "hung_worker")
    assert "no progress for" in hung.message and "q_hs=[3]" in hung.message
    print(f"a stalled worker reported as hung after {took:.1f} s")
