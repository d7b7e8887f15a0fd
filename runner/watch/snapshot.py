"""One frozen Snapshot per refresh, built from the newest sampler line plus a bounded History (recent
metrics records for rates, sparklines and ETA history; events; XIDs; earlier snapshots). Detectors
and the dashboard read only Snapshots. Unknown values (the sampler's "n/a") are None here."""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.watch.steady import Reference, SteadyRate, world_of

NA_TEXT = "n/a"
DEFAULT_PREFETCH_DEPTH = 50
DEFAULT_QUEUE_DEPTH = 8


def _v(x: Any) -> Any:
    return None if x == NA_TEXT else x


def _num(x: Any) -> float | None:
    x = _v(x)
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


@dataclass(frozen=True, slots=True)
class GpuView:
    index: int
    name: str | None = None
    uuid: str | None = None
    mem_used_mb: float | None = None
    mem_total_mb: float | None = None
    util_gpu: float | None = None
    util_mem: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    throttle: tuple[str, ...] | None = None
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    procs: tuple[tuple[int, float | None], ...] | None = None
    faults: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    """Names of the workers that sit on this GPU (by pid, gpu_uuid or device)."""

    @property
    def mem_frac(self) -> float | None:
        if self.mem_used_mb is None or not self.mem_total_mb:
            return None
        return self.mem_used_mb / self.mem_total_mb


@dataclass(frozen=True, slots=True)
class WorkerView:
    name: str
    role: str
    index: int | None
    pid: int | None
    host_pid: int | None
    device: str | None
    state: str | None
    step: int | None
    alive: bool | None
    """None: could not be checked (a heartbeat without pid)."""
    proc_state: str | None
    age_s: float | None
    """Seconds since the heartbeat was rewritten."""
    progress_age_s: float | None
    """Seconds since the worker last made progress (a step, a published batch)."""
    uptime_s: float | None
    cpu_percent: float | None
    rss_mb: float | None
    gpu_index: int | None
    gpu_mem_mb: float | None
    gpu_match: str | None
    heartbeat: Mapping[str, Any] = field(default_factory=dict)
    state_age_s: float | None = None
    """Seconds in its current state (the heartbeat's state_since); None from a job that predates it."""

    @property
    def label(self) -> str:
        return f"{self.name} pid {self.pid}" if self.pid is not None else self.name


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The newest metrics record, with the queue capacities from run.json."""

    t: float | None
    age_s: float | None
    step: int | None
    elapsed_s: float | None
    q_pre: tuple[int, ...]
    q_hs: tuple[int, ...]
    prefetch_depth: int
    queue_depth: int
    tgt_bps: float | None
    dft_bps: float | None
    tok_s: float | None
    eta_s: float | None
    epoch: float | None
    loss: float | None
    acc: float | None


@dataclass(frozen=True, slots=True)
class Snapshot:
    t: float
    host: str
    nvml: str
    gpus: tuple[GpuView, ...]
    workers: tuple[WorkerView, ...]
    pipeline: Pipeline | None
    metrics: tuple[Mapping[str, Any], ...]
    """Recent metrics records, oldest first (bounded)."""
    events: tuple[Mapping[str, Any], ...]
    """Events seen since watch started (plus the backlog), oldest first (bounded)."""
    xids: tuple[Mapping[str, Any], ...]
    """XID events seen recently, oldest first; empty also when unsupported (see xid_supported)."""
    xid_supported: bool
    manifest: Mapping[str, Any]
    job: Mapping[str, Any]
    run_dir: str = ""
    run_dir_exists: bool = True
    baseline_tok_s: float | None = None
    """This fingerprint's and config's healthy tok/s (runner.watch.baseline), if one is stored."""
    reference: Reference | None = None
    """This run's best sustained tok/s at the newest record's world size (runner.watch.steady)."""
    sample_age_s: float = 0.0
    """Seconds since the sampler's newest line arrived (the sampler may be silent)."""
    source: str = "ok"
    """ok | starting | silent | ended | failed: the sampler's own health (runner.watch.watcher)."""
    damage: tuple[str, ...] = ()
    """The sampler's readers' lines: damaged files, records skipped for their shape (runner.rundir.schema)."""
    source_errors: tuple[tuple[str, str], ...] = ()
    """(source, error) for each of the sampler's sources that raised on this line (NVML, a run-directory
    file, the process probe): the sampler went on without it."""
    nvml_stuck: tuple[tuple[int | None, str, float], ...] = ()
    """(GPU index or None, function, seconds) for each NVML call that has not returned."""
    sampler_noise: str = ""
    """The sampler's newest non-JSON output (a traceback's last line, an ssh error)."""
    sampler_restarts: int = 0
    """How often watch started this host's sampler again."""

    def gpu(self, index: int | None) -> GpuView | None:
        return next((g for g in self.gpus if g.index == index), None)

    def worker(self, name: str) -> WorkerView | None:
        return next((w for w in self.workers if w.name == name), None)

    def role(self, role: str) -> list[WorkerView]:
        return [w for w in self.workers if w.role == role]

    def config(self, *path: str, default: Any = None) -> Any:
        node: Any = self.manifest.get("config", {})
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                return default
            node = node[key]
        return node

    def series(self, key: str, last_s: float | None = None) -> list[tuple[float, float]]:
        """(t, value) of a numeric metrics field, oldest first, within the last `last_s` seconds."""
        out = []
        for m in self.metrics:
            t, v = _num(m.get("t")), _num(m.get(key))
            if t is not None and v is not None and (last_s is None or t >= self.t - last_s):
                out.append((t, v))
        return out


def _gpu_view(g: Mapping[str, Any], workers: Sequence[WorkerView]) -> GpuView:
    procs = _v(g.get("procs"))
    throttle = _v(g.get("throttle"))
    return GpuView(
        index=int(g["index"]),
        name=_v(g.get("name")),
        uuid=_v(g.get("uuid")),
        mem_used_mb=_num(g.get("mem_used_mb")),
        mem_total_mb=_num(g.get("mem_total_mb")),
        util_gpu=_num(g.get("util_gpu")),
        util_mem=_num(g.get("util_mem")),
        temp_c=_num(g.get("temp_c")),
        power_w=_num(g.get("power_w")),
        sm_clock_mhz=_num(g.get("sm_clock_mhz")),
        throttle=None if throttle is None else tuple(throttle),
        ecc_uncorrected=_v(g.get("ecc_uncorrected")),
        ecc_corrected=_v(g.get("ecc_corrected")),
        procs=None if procs is None else tuple((int(p["pid"]), _num(p.get("mem_mb"))) for p in procs),
        faults=tuple(sorted(set((g.get("faults") or {}).values()))),
        workers=tuple(w.name for w in workers if w.gpu_index == g["index"]),
    )


def _worker_view(name: str, w: Mapping[str, Any]) -> WorkerView:
    role, _, idx = name.rpartition("-")
    index = w.get("index", int(idx) if idx.isdigit() else None)
    alive = _v(w.get("alive"))
    return WorkerView(
        name=name,
        role=w.get("role") or role or name,
        index=index if isinstance(index, int) else None,
        pid=w.get("pid") if isinstance(w.get("pid"), int) else None,
        host_pid=w.get("host_pid"),
        device=w.get("device"),
        state=w.get("state"),
        step=w.get("step") if isinstance(w.get("step"), int) else None,
        alive=alive if isinstance(alive, bool) else None,
        proc_state=_v(w.get("proc_state")),
        age_s=_num(w.get("age_s")),
        progress_age_s=_num(w.get("progress_age_s")),
        uptime_s=_num(w.get("uptime_s")),
        cpu_percent=_num(w.get("cpu_percent")),
        rss_mb=_num(w.get("rss_mb")),
        gpu_index=w.get("gpu_index") if isinstance(w.get("gpu_index"), int) else None,
        gpu_mem_mb=_num(w.get("gpu_mem_mb")),
        gpu_match=w.get("gpu_match"),
        heartbeat=dict(w),
        state_age_s=_num(w.get("state_age_s")),
    )


def _ints(xs: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in xs if isinstance(x, (int, float))) if isinstance(xs, list) else ()


def pipeline_of(m: Mapping[str, Any] | None, manifest: Mapping[str, Any], now: float) -> Pipeline | None:
    if m is None:
        return None
    pipe = (
        manifest.get("config", {}).get("pipeline", {}) if isinstance(manifest.get("config"), Mapping) else {}
    )
    t = _num(m.get("t"))
    return Pipeline(
        t=t,
        age_s=None if t is None else max(0.0, now - t),
        step=m.get("step") if isinstance(m.get("step"), int) else None,
        elapsed_s=_num(m.get("elapsed_s")),
        q_pre=_ints(m.get("q_pre")),
        q_hs=_ints(m.get("q_hs")),
        prefetch_depth=int(pipe.get("prefetch_depth", DEFAULT_PREFETCH_DEPTH)),
        queue_depth=int(pipe.get("queue_depth", DEFAULT_QUEUE_DEPTH)),
        tgt_bps=_num(m.get("tgt_bps")),
        dft_bps=_num(m.get("dft_bps")),
        tok_s=_num(m.get("tok_s")),
        eta_s=_num(m.get("eta_s")),
        epoch=_num(m.get("epoch")),
        loss=_num(m.get("loss")),
        acc=_num(m.get("acc")),
    )


class History:
    """What outlives one sampler line: run.json, recent metrics, events, XIDs and snapshots."""

    def __init__(
        self,
        *,
        max_snapshots: int = 900,
        max_metrics: int = 720,
        max_events: int = 2000,
        max_xids: int = 256,
        baseline_tok_s: float | None = None,
    ) -> None:
        self.snapshots: collections.deque[Snapshot] = collections.deque(maxlen=max_snapshots)
        self.metrics: collections.deque[Mapping[str, Any]] = collections.deque(maxlen=max_metrics)
        self.events: collections.deque[Mapping[str, Any]] = collections.deque(maxlen=max_events)
        self.xids: collections.deque[Mapping[str, Any]] = collections.deque(maxlen=max_xids)
        self.manifest: Mapping[str, Any] = {}
        self.baseline_tok_s = baseline_tok_s
        self.steady = SteadyRate()

    @property
    def latest(self) -> Snapshot | None:
        return self.snapshots[-1] if self.snapshots else None

    def ingest(self, sample: Mapping[str, Any]) -> Snapshot:
        """Fold one sampler line in and return the Snapshot it makes."""
        if isinstance(sample.get("manifest"), Mapping):
            self.manifest = sample["manifest"]
        for m in sample.get("metrics", []):
            if isinstance(m, Mapping):
                self.metrics.append(m)
                self.steady.add(m)
        self.events.extend(e for e in sample.get("events", []) if isinstance(e, Mapping))
        xid = sample.get("xid")
        if isinstance(xid, list):
            self.xids.extend(xid)
        now = float(sample.get("t") or time.time())
        workers = tuple(_worker_view(n, w) for n, w in sorted((sample.get("workers") or {}).items()))
        snap = Snapshot(
            t=now,
            host=str(sample.get("host", "")),
            nvml=str(sample.get("nvml", "unavailable: no sample")),
            gpus=tuple(_gpu_view(g, workers) for g in sample.get("gpus", [])),
            workers=workers,
            pipeline=pipeline_of(self.metrics[-1] if self.metrics else None, self.manifest, now),
            metrics=tuple(self.metrics),
            events=tuple(self.events),
            xids=tuple(self.xids),
            xid_supported=isinstance(xid, list),
            manifest=self.manifest,
            job={**dict(sample.get("job") or {}), "watch_lock": sample.get("watch_lock", "off")},
            run_dir=str(sample.get("run_dir", "")),
            run_dir_exists=bool(sample.get("run_dir_exists", True)),
            baseline_tok_s=self.baseline_tok_s,
            reference=self.steady.reference(world_of(self.metrics[-1]) if self.metrics else None),
            damage=tuple(str(d) for d in sample.get("damage") or () if isinstance(d, str)),
            nvml_stuck=tuple(
                (
                    e["gpu"] if isinstance(e.get("gpu"), int) else None,
                    str(e.get("call")),
                    _num(e.get("for_s")) or 0.0,
                )
                for e in sample.get("nvml_stuck") or ()
                if isinstance(e, Mapping)
            ),
            source_errors=tuple(
                (str(e.get("source")), str(e.get("error")))
                for e in sample.get("source_errors") or ()
                if isinstance(e, Mapping)
            ),
        )
        self.snapshots.append(snap)
        return snap
