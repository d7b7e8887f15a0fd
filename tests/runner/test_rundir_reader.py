"""runner/rundir/reader.py on real files: the job.lock holder from /proc/locks, run.json's format."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest

from runner.errors import RunnerError
from runner.rundir import RUN_FORMAT, RunLocation, read_run
from runner.rundir.reader import _lock_holder


def _stat_line(path: Path) -> str:
    st = os.stat(path)
    return f"{st.st_ino} {st.st_dev}"


def test_lock_holder_of_a_real_flock(tmp_path: Path) -> None:
    lock = tmp_path / "job.lock"
    lock.write_text("1\n")  # what the file says does not matter: the kernel's table does
    locks = Path("/proc/locks").read_text
    assert _lock_holder(_stat_line(lock), locks()) is None
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert _lock_holder(_stat_line(lock), locks()) == os.getpid()
        assert read_run(RunLocation(str(tmp_path))).lock_pid == os.getpid()
    finally:
        os.close(fd)
    assert _lock_holder(_stat_line(lock), locks()) is None
    assert not read_run(RunLocation(str(tmp_path))).running


def test_lock_holder_skips_waiters_and_bad_input() -> None:
    dev = os.makedev(0xFE, 0)
    line = f"77 {dev}"
    locks = (
        "1: FLOCK  ADVISORY  WRITE 2660 fe:00:77 0 EOF\n1: -> FLOCK  ADVISORY  WRITE 2661 fe:00:77 0 EOF\n"
    )
    assert _lock_holder(line, locks) == 2660
    assert _lock_holder(line, locks.splitlines()[1]) is None, "a waiter holds nothing"
    assert _lock_holder("", locks) is None and _lock_holder("x y", locks) is None


def test_reader_sees_the_host_clock_and_a_missing_dir(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"format": RUN_FORMAT}))
    view = read_run(RunLocation(str(tmp_path)))
    assert view.exists and abs(view.clock_offset) <= 1, "this machine is the host"
    assert not read_run(RunLocation(str(tmp_path / "absent"))).exists


def test_a_newer_run_format_is_refused_with_advice(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"format": RUN_FORMAT + 1, "run_id": "x"}))
    with pytest.raises(
        RunnerError, match=rf"format {RUN_FORMAT + 1}, newer than this dflashctl reads.*upgrade"
    ):
        read_run(RunLocation(str(tmp_path)))
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "x"}))  # before `format`: read as 0
    assert read_run(RunLocation(str(tmp_path))).manifest == {"run_id": "x"}


def test_lock_held_by_another_process(tmp_path: Path) -> None:
    lock = tmp_path / "job.lock"
    lock.touch()
    holder = subprocess.Popen(["flock", str(lock), "sleep", "300"])
    try:
        for _ in range(100):
            if read_run(RunLocation(str(tmp_path))).lock_pid is not None:
                break
            subprocess.run(["sleep", "0.05"])
        assert read_run(RunLocation(str(tmp_path))).lock_pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
