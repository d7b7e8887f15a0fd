"""Readings the detectors share: a GPU's utilization over a window, whether the run is a single
process, and numbers written the way the findings quote them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

from runner.watch.snapshot import Snapshot, WorkerView

PAUSED_STATES = ("starting", "compiling", "checkpointing", "stopped")
"""States in which a worker legitimately makes no progress."""


def window(history: Sequence[Snapshot], seconds: float) -> list[Snapshot]:
    """The snapshots of the last `seconds`, newest last (at least the newest one)."""
    now = history[-1].t
    recent = [s for s in history if s.t >= now - seconds]
    return recent or [history[-1]]


def util_max(history: Sequence[Snapshot], gpu_index: int | None, seconds: float) -> float | None:
    """The highest utilization a GPU showed over the window; None if any sample lacks it."""
    if gpu_index is None:
        return None
    values = []
    for snap in window(history, seconds):
        g = snap.gpu(gpu_index)
        if g is None or g.util_gpu is None:
            return None
        values.append(g.util_gpu)
    return max(values)


def idle_share(history: Sequence[Snapshot], gpus: Sequence[int], seconds: float) -> float | None:
    """The share of the window these GPUs spent idle: 1 - utilization (NVML's share of time a kernel
    ran), averaged over the window's samples and the GPUs; None without a reading."""
    values = [
        1.0 - g.util_gpu / 100.0
        for snap in window(history, seconds)
        for g in (snap.gpu(i) for i in gpus)
        if g is not None and g.util_gpu is not None
    ]
    return sum(values) / len(values) if values else None


def util_now(snap: Snapshot, gpu_index: int | None) -> float | None:
    g = snap.gpu(gpu_index)
    return None if g is None else g.util_gpu


def worker_idle(history: Sequence[Snapshot], w: WorkerView, idle_pct: float, seconds: float) -> bool | None:
    """Whether the worker's GPU stayed idle over the window; for a worker without a GPU reading, its
    CPU use (a CPU job, or NVML unavailable). None: nothing to tell."""
    util = util_max(history, w.gpu_index, seconds)
    if util is not None:
        return util <= idle_pct
    if w.cpu_percent is not None:
        return w.cpu_percent <= idle_pct
    return None


def job_stopped(snap: Snapshot) -> bool:
    """The job's newest lifecycle event is `stopped`: its last queue readings describe a pipeline that
    has wound down (targets done, drafters gone), not one that is blocked."""
    for e in reversed(snap.events):
        if e.get("event") in ("launched", "started", "stopped"):
            return e.get("event") == "stopped"
    return False


def single_process(snap: Snapshot) -> bool:
    """`python -m dflash.train`: target and drafter in one process, so there are no queues to read."""
    for e in reversed(snap.events):
        if e.get("event") == "started":
            return e.get("mode") == "single-process"
    pids = {w.pid for w in snap.workers if w.pid is not None}
    return len(snap.workers) >= 2 and len(pids) == 1


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def fmt_duration(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 120:
        return f"{s:.0f} s"
    if s < 600:  # minutes and seconds: 160 s is "2 min 40 s", not "3 min"
        m, sec = divmod(round(s), 60)
        return f"{m} min {sec} s" if sec else f"{m} min"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def fmt_clock(t: float) -> str:
    """A wall-clock time as the run's records and events carry it, in UTC."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(t))


def fmt_tok(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1000:.1f}K tok/s"


def fmt_gib(mib: float | None) -> str:
    return "n/a" if mib is None else f"{mib / 1024:.1f}"


def fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0f}%"


def fmt_range(values: Sequence[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.0f}%" if lo == hi else f"{lo:.0f}-{hi:.0f}%"
