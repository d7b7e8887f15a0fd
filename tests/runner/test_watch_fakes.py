"""Builders the watch tests share (a synthetic /proc, heartbeats, sampler lines), and tests of
FakeNVML itself: the one fake, standing in for the GPUs this machine lacks."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from runner.watch.fakenvml import FakeGPU, FakeNVML, FakeNVMLError

TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# ---- a synthetic /proc ---------------------------------------------------------------------------


def proc_root(tmp: Path, btime: float) -> Path:
    root = tmp / "proc"
    root.mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text(f"cpu  1 2 3 4\nbtime {int(btime)}\n")
    (root / "locks").write_text("")
    return root


def add_proc(
    root: Path,
    pid: int,
    *,
    start: float,
    state: str = "S",
    nspid: tuple[int, ...] | None = None,
    comm: str = "python",
    cpu_s: float = 0.0,
    rss_mb: float = 100.0,
) -> None:
    """/proc/<pid>/{stat,status} as the kernel writes them (only the fields ProcFS reads are real)."""
    btime = int((root / "stat").read_text().split("btime ")[1].split()[0])
    ticks = round((start - btime) * TICK)
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    f = ["0"] * 50
    f[0] = state
    f[11], f[12] = str(round(cpu_s * TICK)), "0"
    f[19] = str(ticks)
    f[21] = str(int(rss_mb * 2**20 / PAGE))
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(f)}\n")
    ns = "\t".join(str(x) for x in (nspid or (pid,)))
    (d / "status").write_text(f"Name:\t{comm}\nState:\t{state}\nPid:\t{pid}\nNSpid:\t{ns}\n")


def hold_lock(root: Path, lock: Path, pid: int) -> None:
    """A /proc/locks line saying `pid` holds an flock on `lock`."""
    st = lock.stat()
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    (root / "locks").write_text(f"1: FLOCK  ADVISORY  WRITE {pid} {ident} 0 EOF\n")


# ---- the run directory ---------------------------------------------------------------------------


def own_start_time() -> float:
    """When this process started: a heartbeat names its process by (pid, started_at), and started_at
    is written just after a worker starts. The pytest process can be older than watch's tolerance
    (30 min) when the whole suite runs, so `now` would name a different process."""
    import psutil

    return psutil.Process().create_time() + 1.0


def write_heartbeat(run_dir: Path, name: str, **fields: Any) -> dict[str, Any]:
    role, _, index = name.rpartition("-")
    now = time.time()
    if fields.get("pid", os.getpid()) == os.getpid():
        fields.setdefault("started_at", own_start_time())
    hb = {
        "pid": os.getpid(),
        "host": "gpu-host",
        "role": role,
        "index": int(index),
        "rank": int(index) if role == "drafter" else None,
        "device": "cpu",
        "step": 0,
        "state": "computing",
        "last_progress_at": now,
        "updated_at": now,
        "started_at": now,
    }
    hb.update(fields)
    (run_dir / "workers").mkdir(parents=True, exist_ok=True)
    (run_dir / "workers" / f"{name}.json").write_text(json.dumps(hb))
    return hb


def append_jsonl(path: Path, *records: dict[str, Any]) -> None:
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def manifest(prefetch_depth: int = 50, queue_depth: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "run_id": "field-20261201-000000",
        "config": {
            "run": {"name": "field", "status_interval_s": 10.0},
            "pipeline": {
                "targets": 5,
                "drafters": 3,
                "prefetch_depth": prefetch_depth,
                "queue_depth": queue_depth,
            },
            "train": {"token_budget": 49152, "max_batch_size": 64},
        },
        "cache_artifact": None,
        **extra,
    }


# ---- sampler lines, built directly (for the detector tests) --------------------------------------


def gpu(
    index: int, *, used: float = 60000.0, total: float = 97887.0, util: float = 95, **kw: Any
) -> dict[str, Any]:
    g = {
        "index": index,
        "name": "NVIDIA RTX PRO 6000 Blackwell",
        "uuid": f"GPU-{index}",
        "mem_used_mb": used,
        "mem_total_mb": total,
        "util_gpu": util,
        "util_mem": 30,
        "temp_c": 60,
        "power_w": 400.0,
        "sm_clock_mhz": 2400,
        "throttle": ["power cap"],
        "ecc_mode": True,
        "ecc_uncorrected": 0,
        "ecc_corrected": 0,
        "procs": [{"pid": 1000 + index, "mem_mb": used - 500}],
        "faults": {},
    }
    g.update(kw)
    return g


def worker(name: str, gpu_index: int | None, **kw: Any) -> dict[str, Any]:
    role, _, index = name.rpartition("-")
    w = {
        "pid": 1000 + (gpu_index if gpu_index is not None else 90 + int(index)),
        "host": "gpu-host",
        "role": role,
        "index": int(index),
        "device": "cpu" if gpu_index is None else f"cuda:{gpu_index}",
        "step": 500,
        "state": "computing",
        "age_s": 0.5,
        "progress_age_s": 0.5,
        "uptime_s": 3600.0,
        "alive": True,
        "proc_state": "running",
        "cpu_percent": 100.0,
        "rss_mb": 4000.0,
        "gpu_index": gpu_index,
        "gpu_mem_mb": 59500.0,
        "gpu_match": "pid",
    }
    w["host_pid"] = w["pid"]
    w.update(kw)
    return w


def metric(t: float, **kw: Any) -> dict[str, Any]:
    m = {
        "t": t,
        "elapsed_s": 3600.0,
        "step": 500,
        "loss": 3.2,
        "acc": 0.4,
        "tgt_bps": 2.0,
        "dft_bps": 2.0,
        "tok_s": 20000.0,
        "q_pre": [50, 50],
        "q_hs": [3],
        "epoch": 0.3,
        "eta_s": 8 * 86400.0,
    }
    m.update(kw)
    return m


def healthy_sample(t: float, **kw: Any) -> dict[str, Any]:
    """2 targets on GPUs 0-1 and 2 drafters on GPUs 2-3, all busy; the queues balanced."""
    s = {
        "v": 1,
        "t": t,
        "host": "gpu-host",
        "run_dir": "/runs/healthy",
        "run_dir_exists": True,
        "interval_s": 1.0,
        "nvml": "ok",
        "gpus": [gpu(0, util=97), gpu(1, util=95), gpu(2, util=90), gpu(3, util=92)],
        "xid": [],
        "workers": {
            "target-0": worker("target-0", 0, q_pre=50),
            "target-1": worker("target-1", 1, q_pre=50),
            "drafter-0": worker("drafter-0", 2),
            "drafter-1": worker("drafter-1", 3),
        },
        "metrics": [metric(t - 1)],
        "events": [],
        "job": {"lock_pid": 999, "lock_held": True},
        "manifest": manifest(targets=2),
    }
    s.update(kw)
    return s


# ---- FakeNVML ------------------------------------------------------------------------------------


def test_fake_follows_pynvml_error_shape_and_init() -> None:
    fake = FakeNVML([FakeGPU()])
    with pytest.raises(FakeNVMLError) as e:
        fake.nvmlDeviceGetCount()
    assert e.value.value == 1  # uninitialised, as the real library answers
    fake.nvmlInit()
    assert fake.nvmlDeviceGetCount() == 1
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert fake.nvmlDeviceGetMemoryInfo(h).total == int(143771 * 2**20)
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == 1


def test_fake_from_spec_and_missing_functions() -> None:
    fake = FakeNVML.from_spec(
        {
            "gpus": [{"mem_used_mb": 10, "procs": [[7, 5.0]], "not_supported": ["nvmlDeviceGetPowerUsage"]}],
            "missing": ["nvmlDeviceGetComputeRunningProcesses_v3"],
            "xids": [[0, 79]],
        }
    )
    fake.nvmlInit()
    h = fake.nvmlDeviceGetHandleByIndex(0)
    assert getattr(fake, "nvmlDeviceGetComputeRunningProcesses_v3", None) is None
    assert [p.pid for p in fake.nvmlDeviceGetComputeRunningProcesses_v2(h)] == [7]
    with pytest.raises(FakeNVMLError) as e:
        fake.nvmlDeviceGetPowerUsage(h)
    assert e.value.value == 3
    assert fake.nvmlEventSetWait(None, 0).eventData == 79
