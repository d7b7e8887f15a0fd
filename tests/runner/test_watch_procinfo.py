"""Which process a heartbeat names: pid namespaces (NSpid), reused pids, zombies; CPU and RSS; the
job lock's holder. A synthetic /proc for the container cases, the real one for the rest."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import pytest
from test_watch_fakes import add_proc, hold_lock, own_start_time, proc_root

from runner.watch.procinfo import ProcessProbe, ProcFS, lock_holder_pids

NOW = time.time()
BOOT = NOW - 86400


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return proc_root(tmp_path, BOOT)


def test_procfs_reads_stat_status_and_nspid(proc: Path) -> None:
    add_proc(proc, 41007, start=NOW - 60, comm="pt_main (thread) x", nspid=(41007, 7), cpu_s=12.5, rss_mb=512)
    info = ProcFS(proc).read(41007)
    assert info is not None
    assert info.state == "sleeping" and info.nspid == (41007, 7)
    assert abs(info.start_time - (NOW - 60)) < 1.0
    assert info.cpu_s == pytest.approx(12.5, abs=0.02) and info.rss_bytes == pytest.approx(
        512 * 2**20, rel=0.01
    )
    assert ProcFS(proc).innermost_pid(41007) == 7
    assert ProcFS(proc).read(1) is None


def test_same_namespace_pid(proc: Path) -> None:
    add_proc(proc, 500, start=NOW - 30)
    probe = ProcessProbe(proc, hostname="gpu-host")
    assert probe.resolve(500, NOW - 20, "gpu-host") == 500


def test_container_pid_found_through_nspid_of_gpu_processes(proc: Path) -> None:
    """The worker inside a container reports pid 7; NVML on the host reports 41007."""
    add_proc(proc, 7, start=BOOT + 5)  # the host's own pid 7: a kernel thread from boot
    add_proc(proc, 41007, start=NOW - 60, nspid=(41007, 7))
    probe = ProcessProbe(proc, hostname="gpu-host")
    assert probe.resolve(7, NOW - 50, "c0ffee12", candidates=[41007]) == 41007
    assert probe.resolve(7, NOW - 50, "c0ffee12") == 41007  # cached, and re-checked


def test_container_pid_found_by_scanning_when_not_on_a_gpu(proc: Path) -> None:
    add_proc(proc, 41020, start=NOW - 60, nspid=(41020, 1, 9))  # nested twice: the last field counts
    add_proc(proc, 41021, start=NOW - 60, nspid=(41021, 9, 1))
    probe = ProcessProbe(proc, hostname="gpu-host")
    assert probe.resolve(9, NOW - 50, "c0ffee12") == 41020


def test_two_containers_with_the_same_inner_pid_told_apart_by_start(proc: Path) -> None:
    add_proc(proc, 41001, start=NOW - 7200, nspid=(41001, 7))  # an older container's worker
    add_proc(proc, 41002, start=NOW - 60, nspid=(41002, 7))
    probe = ProcessProbe(proc, hostname="gpu-host", max_start_lead_s=1800)
    assert probe.resolve(7, NOW - 50, "c2", candidates=[41001, 41002]) == 41002


def test_reused_pid_zombie_and_vanished_are_not_alive(proc: Path) -> None:
    add_proc(proc, 600, start=NOW - 5)  # started after the heartbeat: a stranger reusing the pid
    add_proc(proc, 601, start=NOW - 60, state="Z")
    probe = ProcessProbe(proc, hostname="gpu-host")
    assert probe.resolve(600, NOW - 50, "gpu-host") is None
    assert probe.resolve(601, NOW - 50, "gpu-host") is None
    add_proc(proc, 602, start=NOW - 60)
    assert probe.resolve(602, NOW - 50, "gpu-host") == 602
    (proc / "602" / "stat").unlink()
    assert probe.resolve(602, NOW - 50, "gpu-host") is None
    add_proc(proc, 602, start=NOW - 1)  # the number comes back on another process
    assert probe.resolve(602, NOW - 50, "gpu-host") is None


def test_measure_cpu_percent_and_rss_from_procfs(proc: Path) -> None:
    add_proc(proc, 700, start=NOW - 60, cpu_s=1.0, rss_mb=256)
    probe = ProcessProbe(proc)
    first = probe.measure(700)
    assert first == {
        "alive": True,
        "proc_state": "sleeping",
        "cpu_percent": None,
        "rss_mb": pytest.approx(256, abs=0.1),
    }
    time.sleep(0.2)
    add_proc(proc, 700, start=NOW - 60, cpu_s=1.1, rss_mb=256)
    assert 20 <= probe.measure(700)["cpu_percent"] <= 60
    assert probe.measure(12345)["alive"] is False


@pytest.mark.parametrize("use_psutil", [True, False])
def test_real_process_with_and_without_psutil(use_psutil: bool) -> None:
    probe = ProcessProbe(use_psutil=use_psutil)
    assert probe.uses_psutil is use_psutil
    me = probe.resolve(os.getpid(), own_start_time(), "")
    assert me == os.getpid()
    m = probe.measure(os.getpid())
    assert m["alive"] is True and m["proc_state"] in ("running", "sleeping") and m["rss_mb"] > 10
    sum(i * i for i in range(300_000))  # some CPU between the two readings
    assert probe.measure(os.getpid())["cpu_percent"] > 0


def test_lock_holder_from_proc_locks(tmp_path: Path) -> None:
    lock = tmp_path / "job.lock"
    lock.write_text("123\n")
    assert lock_holder_pids(lock) == []
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert lock_holder_pids(lock) == [os.getpid()]
    finally:
        os.close(fd)
    assert lock_holder_pids(lock) == []
    assert lock_holder_pids(tmp_path / "absent.lock") is None


def test_lock_holder_in_a_synthetic_proc(tmp_path: Path, proc: Path) -> None:
    lock = tmp_path / "job.lock"
    lock.write_text("7\n")
    hold_lock(proc, lock, 41007)
    assert lock_holder_pids(lock, proc) == [41007]
