"""runner/exec/proc.py on real processes: start-time identity (a reused pid is not the recorded
process), kill-tree of a real process tree, and the script form a host runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runner.exec import proc
from runner.exec.proc import ProcId, flock_holders, signal_trees, start_time, started_within, wait_gone

# A parent that starts a child, which starts a grandchild in a session of its own (as torchrun's
# workers are): all three pids printed, then they sleep.
TREE = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import subprocess, sys, time
g = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(g.pid, flush=True)
time.sleep(300)
'''], stdout=subprocess.PIPE, text=True)
grandchild = child.stdout.readline().strip()
print(child.pid, grandchild, flush=True)
time.sleep(300)
"""


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def test_start_time_of_a_real_process(sleeper: subprocess.Popen[bytes]) -> None:
    started = start_time(sleeper.pid)
    assert started is not None and abs(started - time.time()) < 5
    assert start_time(os.getpid()) is not None and start_time(2**22 + 1) is None


def test_a_reused_pid_is_not_the_recorded_process(sleeper: subprocess.Popen[bytes]) -> None:
    now = time.time()
    assert ProcId.recorded(sleeper.pid, now).alive(), "recorded just after it started: the same process"
    assert ProcId(sleeper.pid).alive(), "no start time recorded: the pid is trusted"
    assert not ProcId.recorded(sleeper.pid, now - 60).alive(), "recorded before it existed: a stranger"
    assert not ProcId(sleeper.pid, now + 60, None).alive(), "the run began after this process"
    assert not ProcId.recorded(sleeper.pid, now + proc.START_LEAD_S + 60).alive(), "too long before"
    sleeper.kill()
    sleeper.wait()
    assert not ProcId.recorded(sleeper.pid, now).alive(), "gone"


def test_start_window_tolerance() -> None:
    assert started_within(100.0, 100.0, 100.0)
    assert started_within(101.9, None, 100.0) and not started_within(102.1, None, 100.0)
    assert started_within(98.1, 100.0, None) and not started_within(97.9, 100.0, None)
    assert ProcId.from_json([5, 1000.0]) == ProcId(5, 1000.0 - proc.START_LEAD_S, 1000.0)
    assert ProcId.from_json([5, None]) == ProcId(5) and ProcId.from_json([5, 1.0, None]) == ProcId(5, 1.0)


def test_zombie_is_not_alive() -> None:
    p = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while proc.stat_fields(p.pid) and proc.stat_fields(p.pid)[0] != "Z":  # type: ignore[index]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not ProcId(p.pid).alive(), "exited but not reaped"
    p.wait()


def test_kill_tree_reaches_a_grandchild_in_its_own_session() -> None:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child, grandchild = (int(x) for x in parent.stdout.readline().split())
    assert sorted(proc.children(parent.pid)) == sorted([child, grandchild])
    ids = [ProcId.recorded(parent.pid, time.time())]
    sent = signal_trees(ids, signal.SIGKILL)
    assert sent == sorted([parent.pid, child, grandchild])
    parent.wait(timeout=10)
    assert wait_gone([ProcId(child), ProcId(grandchild)], timeout=10) == []


def test_a_stranger_is_not_signalled(sleeper: subprocess.Popen[bytes]) -> None:
    assert signal_trees([ProcId.recorded(sleeper.pid, time.time() - 120)], signal.SIGKILL) == []
    assert sleeper.poll() is None


def test_script_form_fed_on_stdin(sleeper: subprocess.Popen[bytes]) -> None:
    """What control.proc_tool runs on a host: `python3 -` with the file's source on stdin."""
    source = Path(proc.__file__).read_bytes()

    def tool(*argv: str) -> dict[str, list[int]]:
        out = subprocess.run([sys.executable, "-", *argv], input=source, capture_output=True, check=True)
        return json.loads(out.stdout)

    now = time.time()
    ids = [[sleeper.pid, now], [sleeper.pid, now - 60, now - 30]]
    assert tool("alive", json.dumps(ids)) == {"alive": [sleeper.pid]}
    assert tool("signal-one", "SIGTERM", json.dumps([[sleeper.pid, now - 60]])) == {"signalled": []}
    assert tool("signal-one", "SIGTERM", json.dumps([[sleeper.pid, now]])) == {"signalled": [sleeper.pid]}
    assert sleeper.wait(timeout=10) == -signal.SIGTERM


def test_flock_holders_from_proc_locks_text() -> None:
    dev = os.makedev(0xFE, 1)
    locks = (
        "1: FLOCK  ADVISORY  WRITE 2660 fe:01:1466913 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 2700 fe:01:1466913 0 EOF\n"
        "2: POSIX  ADVISORY  WRITE 2800 fe:01:1466913 0 EOF\n"
        "3: FLOCK  ADVISORY  WRITE 2900 fe:01:99 0 EOF\n"
    )
    assert flock_holders(locks, dev, 1466913) == [2660], (
        "the holder; not the waiter, a POSIX lock, another file"
    )
    assert flock_holders("", dev, 1466913) == []


def test_the_watch_sampler_agrees_with_the_runner_on_identity_and_lock_holders(tmp_path: Path) -> None:
    """runner/watch/procinfo.py must travel alone in the sampler bundle (standard library, no runner
    package on the GPU host), so it cannot import this module; until the bundle carries this module
    too, the two must give the same answers."""
    import fcntl

    from runner.watch.procinfo import ProcessProbe, lock_holder_pids

    probe = ProcessProbe()
    assert (probe.start_slack_s, probe.max_start_lead_s) == (proc.START_SLACK_S, proc.START_LEAD_S)
    info = probe.fs.read(os.getpid())
    assert info is not None and info.start_time == pytest.approx(start_time(os.getpid()))
    for offset in (-proc.START_LEAD_S - 5, -proc.START_LEAD_S + 5, -1.0, 1.5, 2.5, 60.0):
        at = info.start_time - offset
        assert probe._fits(info, at) == proc.matches_record(info.start_time, at), offset

    lock = tmp_path / "job.lock"
    lock.touch()
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        st = os.stat(lock)
        holders = flock_holders(Path("/proc/locks").read_text(), st.st_dev, st.st_ino)
        assert holders == lock_holder_pids(lock) == [os.getpid()]
    finally:
        os.close(fd)
