"""`dflashctl report`: one PNG of a run over time and a short text summary, from the run directory
alone: metrics.jsonl, events.jsonl, run.json, and watch/samples.jsonl where `dflashctl watch` ran.

    summary = build_report(run_dir, run_dir / "report.png")
    print("\\n".join(summary.lines))

Panels: tok/s, loss, acc, streak, q_pre (a line per target), q_hs, GPU utilization and GPU memory
(a line per GPU); on every panel vertical markers for drafter-group restarts, watch's actions, watch's
findings (colored by severity) and the job's stops. Below them, where the job wrote `generation_start`
events, one row per start of a worker generation (the drafter group's and the targets', first starts
and restarts) with one bar per phase, from the death (or the launch) to the first step; the text
gives each start's cost and its slowest phases. Torn last lines (a writer killed mid-write, or
still writing) are skipped in every file.

matplotlib is imported inside build_report: it pulls in numpy, which no runner module may import when
it is loaded (tests/test_import_rules.py), and a laptop's `dflashctl --help` should not pay for it.
It draws through the Agg canvas, never pyplot: no display, no global figure state.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.errors import RunnerError
from runner.rundir import last_lifecycle, layout, tau_series
from runner.rundir.schema import (
    EVENTS,
    METRICS,
    RUN_JSON,
    SAMPLE,
    Schema,
    Tally,
    parse_lines,
    read_record_file,
)
from runner.watch.signals import fmt_duration, fmt_tok
from runner.watch.timeline import StartTimeline, cost, secs, starts

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_POINTS = 4000
"""Points per line drawn; longer series are thinned (every k-th point), which a 1600-pixel-wide panel
cannot tell apart. The summary's numbers use every record."""
SEVERITY_COLOR = {"info": "tab:blue", "warning": "tab:orange", "critical": "tab:red"}
NO_METRICS = (
    "no metrics yet: metrics.jsonl has no records (the job writes one every run.status_interval_s "
    "once its first step is done)"
)
NO_METRICS_PANEL = "no metrics yet\n(metrics.jsonl has no records)"
NO_SAMPLES = "no watch samples\n(GPU readings are kept while `dflashctl watch RUN` runs)"
NO_GPUS = "no GPU readings in the watch samples\n(a CPU run, or NVML was unavailable on the host)"


def read_jsonl(path: Path, kind: Schema = EVENTS, tally: Tally | None = None) -> list[dict[str, Any]]:
    """The records of a JSON Lines file of the right shape, in order (runner.rundir.schema: a torn,
    garbled or misshapen line is skipped, and counted in `tally`); a missing file is empty."""
    try:
        return parse_lines(kind, path.read_bytes(), tally)
    except OSError:
        return []


def _num(x: Any) -> float | None:
    """A finite number, else None (the sampler's "n/a", null, a bool)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


@dataclass(slots=True)
class GpuSeries:
    index: int
    t: list[float] = field(default_factory=list)
    util: list[float | None] = field(default_factory=list)
    mem_gib: list[float | None] = field(default_factory=list)
    total_gib: float | None = None
    workers: list[str] = field(default_factory=list)
    """The workers last seen on this GPU."""

    @property
    def label(self) -> str:
        return f"GPU {self.index}" + (f" {','.join(self.workers)}" if self.workers else "")


@dataclass(kw_only=True, slots=True)
class RunData:
    run_dir: Path
    manifest: dict[str, Any]
    metrics: list[dict[str, Any]]
    events: list[dict[str, Any]]
    gpus: dict[int, GpuSeries]
    samples: int
    sample_t: list[float]
    damage: list[str] = field(default_factory=list)
    """A line per damaged file or file with records skipped (runner.rundir.schema)."""

    @property
    def run_id(self) -> str:
        return str(self.manifest.get("run_id") or self.run_dir.name)


def load_run(run_dir: Path) -> RunData:
    if not run_dir.is_dir():
        raise RunnerError(
            f"{run_dir} is not a directory; give a run directory or a run id (dflashctl ps --all)"
        )
    manifest, why = read_record_file(run_dir / layout.RUN_JSON, RUN_JSON)
    damage = [why] if why else []
    tallies = {name: Tally() for name in (layout.METRICS, layout.EVENTS, layout.SAMPLES)}
    gpus: dict[int, GpuSeries] = {}
    samples = 0
    sample_t: list[float] = []
    for s in read_jsonl(run_dir / layout.SAMPLES, SAMPLE, tallies[layout.SAMPLES]):
        t = _num(s.get("t"))
        if t is None or not isinstance(s.get("gpus"), list):
            continue
        samples += 1
        sample_t.append(t)
        on_gpu: dict[int, list[str]] = {}
        workers = s.get("workers")
        if isinstance(workers, Mapping):
            for name, w in sorted(workers.items()):
                if isinstance(w, Mapping) and isinstance(w.get("gpu_index"), int):
                    on_gpu.setdefault(w["gpu_index"], []).append(str(name))
        for g in s["gpus"]:
            if not isinstance(g, Mapping) or not isinstance(g.get("index"), int):
                continue
            series = gpus.setdefault(g["index"], GpuSeries(g["index"]))
            used, total = _num(g.get("mem_used_mb")), _num(g.get("mem_total_mb"))
            series.t.append(t)
            series.util.append(_num(g.get("util_gpu")))
            series.mem_gib.append(None if used is None else used / 1024)
            if total is not None:
                series.total_gib = total / 1024
            if g["index"] in on_gpu:
                series.workers = on_gpu[g["index"]]
    metrics = read_jsonl(run_dir / layout.METRICS, METRICS, tallies[layout.METRICS])
    events = [
        e
        for e in read_jsonl(run_dir / layout.EVENTS, EVENTS, tallies[layout.EVENTS])
        if _num(e.get("t")) is not None
    ]
    damage += [t.line(str(run_dir / name)) for name, t in tallies.items() if t.skipped]
    return RunData(
        run_dir=run_dir,
        manifest=manifest or {},
        damage=damage,
        metrics=metrics,
        events=events,
        gpus=dict(sorted(gpus.items())),
        samples=samples,
        sample_t=sample_t,
    )


# ---- the summary -----------------------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ReportSummary:
    run_id: str
    run_dir: str
    png: str
    started_at: float | None
    ended_at: float | None
    duration_s: float | None
    metrics_records: int
    steps: int | None
    loss: float | None
    acc: float | None
    streak: float | None
    tok_s_mean: float | None
    tok_s_last: float | None
    restarts: int
    """Drafter-group restarts (`restart` events with role drafter-group)."""
    generation: int | None
    target_restarts: int
    findings: dict[str, int]
    """watch's `finding` events, by kind."""
    findings_by_severity: dict[str, int]
    actions: dict[str, int]
    """watch's `action` events, by "action subject"."""
    job_events: dict[str, int]
    """degraded (by kind) and cache_miss events."""
    stop_reason: str | None
    """The newest lifecycle event's reason if it is `stopped`; None while running (or killed hard)."""
    stopped_at_step: int | None
    watch_samples: int
    gpus: int
    starts: list[dict[str, Any]]
    """Each start of a worker generation, phase by phase (runner.watch.timeline.StartTimeline)."""
    lines: list[str]
    taus: list[dict[str, Any]] = field(default_factory=list)
    """The job's tau measurements ({step, tau, acc, drafter}), by step: acceptance under speculative
    decoding; `python -m dflash.eval DRAFTER` repeats one."""
    damage: list[str] = field(default_factory=list)
    """A line per damaged file, or file with records skipped for their shape (RunData.damage)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _last_num(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    for r in reversed(records):
        v = _num(r.get(key))
        if v is not None:
            return v
    return None


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def _bounds(data: RunData) -> tuple[float | None, float | None]:
    times = [m["t"] for m in data.metrics] + [e["t"] for e in data.events] + data.sample_t
    started = _num(data.manifest.get("started_at"))
    start = started if started is not None else (min(times) if times else None)
    end = max(times) if times else None
    if start is not None and end is not None and end < start:
        end = start
    return start, end


def _stop(events: Sequence[dict[str, Any]]) -> Mapping[str, Any] | None:
    """The newest started/launched/stopped event, if it is a stop (a resume starts again)."""
    last = last_lifecycle(events)
    return last if last is not None and last.get("event") == "stopped" else None


def summarize(data: RunData, png: Path) -> ReportSummary:
    start, end = _bounds(data)
    m = data.metrics
    tok = [v for v in (_num(r.get("tok_s")) for r in m) if v is not None]
    step = _last_num(m, "step")
    group = [e for e in data.events if e.get("event") == "restart" and e.get("role") != "target"]
    targets = [e for e in data.events if e.get("event") == "restart" and e.get("role") == "target"]
    generation = _last_num(group, "generation")
    findings = [e for e in data.events if e.get("event") == "finding"]
    by_kind = Counter(str(e.get("kind", "?")) for e in findings)
    by_sev = Counter(str(e.get("severity", "?")) for e in findings)
    actions = Counter(
        f"{e.get('action', '?')} {e.get('subject', '')}".strip()
        for e in data.events
        if e.get("event") == "action"
    )
    job_events = Counter(
        f"degraded {e.get('kind', '?')}" if e.get("event") == "degraded" else "cache_miss"
        for e in data.events
        if e.get("event") in ("degraded", "cache_miss")
    )
    stop = _stop(data.events)
    stop_step = _num(stop.get("step")) if stop else None
    tls = starts(data.events)
    s = ReportSummary(
        run_id=data.run_id,
        run_dir=str(data.run_dir),
        png=str(png),
        started_at=start,
        ended_at=end,
        duration_s=None if start is None or end is None else end - start,
        metrics_records=len(m),
        steps=None if step is None else int(step),
        loss=_last_num(m, "loss"),
        acc=_last_num(m, "acc"),
        streak=_last_num(m, "streak"),
        tok_s_mean=statistics.fmean(tok) if tok else None,
        tok_s_last=_last_num(m, "tok_s"),
        restarts=len(group),
        generation=None if generation is None else int(generation),
        target_restarts=len(targets),
        findings=dict(by_kind),
        findings_by_severity=dict(by_sev),
        actions=dict(actions),
        job_events=dict(job_events),
        stop_reason=None if stop is None else str(stop.get("reason", "?")),
        stopped_at_step=None if stop_step is None else int(stop_step),
        watch_samples=data.samples,
        gpus=len(data.gpus),
        starts=[tl.to_dict() for tl in tls],
        lines=[],
        damage=list(data.damage),
        taus=[
            {"step": e["step"], "tau": e["tau"], "acc": e.get("acc"), "drafter": e.get("drafter")}
            for e in tau_series(data.events)
        ],
    )
    s.lines = _lines(s, findings_total=len(findings), actions_total=sum(actions.values()), tls=tls)
    return s


def start_lines(tls: Sequence[StartTimeline], run_start: float | None) -> list[str]:
    """A line per start of a worker generation: when, its cost and its slowest phases."""
    out = []
    for tl in tls:
        when = "" if tl.t is None or run_start is None else f" at {fmt_duration(max(0.0, tl.t - run_start))}"
        out.append(f"  {tl.label}{when}: {cost(tl, slowest=3)}")
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _lines(
    s: ReportSummary, *, findings_total: int, actions_total: int, tls: Sequence[StartTimeline]
) -> list[str]:
    when = (
        ""
        if s.started_at is None
        else f" from {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(s.started_at))}"
    )
    lines = [f"run {s.run_id} ({s.run_dir})", f"duration {fmt_duration(s.duration_s)}{when}"]
    if s.metrics_records == 0:
        lines.append(NO_METRICS)
    else:
        held_out = (
            f", tau {s.taus[-1]['tau']:.2f} on held-out prompts (step {s.taus[-1]['step']})" if s.taus else ""
        )
        lines += [
            f"steps {s.steps if s.steps is not None else 'n/a'} ({s.metrics_records} metrics records)",
            f"final loss {_fmt(s.loss, '.4f')}, acc {_fmt(s.acc, '.3f')}, streak {_fmt(s.streak, '.2f')}"
            + held_out,
            f"throughput mean {fmt_tok(s.tok_s_mean)}, last {fmt_tok(s.tok_s_last)}",
        ]
    if s.taus:
        first, last = s.taus[0], s.taus[-1]
        trend = f" (first {first['tau']:.2f} at step {first['step']})" if len(s.taus) > 1 else ""
        lines.append(
            f"tau {last['tau']:.2f} tokens per target verification at step {last['step']}{trend}: "
            f"{len(s.taus)} measurement(s) under speculative decoding"
        )
    if s.restarts or s.target_restarts:
        gen = "" if s.generation is None else f" (last generation {s.generation})"
        tgt = f", {s.target_restarts} target restart(s)" if s.target_restarts else ""
        lines.append(f"restarts: {s.restarts} of the drafter group{gen}{tgt}")
    else:
        lines.append("restarts: none")
    if tls:
        lines.append("starts (origin -> first step or batch, slowest phases):")
        lines += start_lines(tls, s.started_at)
    if findings_total:
        sev = ", ".join(
            f"{s.findings_by_severity[k]} {k}"
            for k in ("critical", "warning", "info")
            if s.findings_by_severity.get(k)
        )
        lines.append(f"findings: {findings_total} ({_counts(Counter(s.findings))}); {sev}")
    else:
        lines.append("findings: none recorded by watch")
    lines.append(
        f"actions: {actions_total} ({_counts(Counter(s.actions))})" if actions_total else "actions: none"
    )
    if s.job_events:
        lines.append(f"job events: {_counts(Counter(s.job_events))}")
    if s.stop_reason is None:
        lines.append("stop: none recorded (still running, or ended without a stop event)")
    else:
        at = "" if s.stopped_at_step is None else f" at step {s.stopped_at_step}"
        lines.append(f"stopped: {s.stop_reason}{at}")
    lines.append(
        f"watch samples: {s.watch_samples} over {s.gpus} GPU(s)"
        if s.watch_samples
        else "watch samples: none (GPU readings are kept while `dflashctl watch RUN` runs)"
    )
    lines += [f"damaged: {line}" for line in s.damage]
    lines.append(f"png: {s.png}")
    return lines


# ---- the figure ------------------------------------------------------------------------------------


def _unit(span_s: float) -> tuple[float, str]:
    if span_s < 600:
        return 1.0, "s"
    if span_s < 3 * 3600:
        return 60.0, "min"
    if span_s < 72 * 3600:
        return 3600.0, "h"
    return 86400.0, "d"


def _thin(n: int) -> int:
    return max(1, math.ceil(n / MAX_POINTS))


def _gapped(ts: Sequence[float], ys: Sequence[float | None]) -> tuple[list[float], list[float]]:
    """NaN (a break in the line) where a value is unknown and where the records pause for much longer
    than their usual interval (watch not running, the job down between a stop and a resume)."""
    k = _thin(len(ts))
    ts, ys = ts[::k], ys[::k]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b > a]
    limit = max(5 * statistics.median(gaps), 30.0) if gaps else math.inf
    out_t: list[float] = []
    out_y: list[float] = []
    for i, (t, y) in enumerate(zip(ts, ys, strict=True)):
        if i and t - ts[i - 1] > limit:
            out_t.append((t + ts[i - 1]) / 2)
            out_y.append(math.nan)
        out_t.append(t)
        out_y.append(math.nan if y is None else y)
    return out_t, out_y


def _empty(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="0.35", transform=ax.transAxes)


def _metric_panel(ax: Axes, data: RunData, key: str, title: str, x: Any, scale: float = 1.0) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    pts = [(r["t"], _num(r.get(key))) for r in data.metrics]
    if not any(v is not None for _, v in pts):
        _empty(ax, NO_METRICS_PANEL if not data.metrics else f"no {key} in metrics.jsonl")
        return
    t, y = _gapped([p[0] for p in pts], [None if v is None else v / scale for _, v in pts])
    ax.plot(x(t), y, lw=1.2, color="tab:green")


def _tau_overlay(ax: Axes, data: RunData, x: Any) -> None:
    """tau (the job's `tau` events) beside the teacher-forced accuracy, on its own axis."""
    taus = tau_series(data.events)
    if not taus:
        return
    ax.set_title("accuracy (top-1, green) and tau (purple, right axis)", fontsize=10, loc="left")
    twin = ax.twinx()
    twin.plot(x([float(e["t"]) for e in taus]), [float(e["tau"]) for e in taus], "o-", lw=1.2,
              color="tab:purple", gid="tau")  # fmt: skip
    twin.set_ylabel("tau (tokens per verification)", fontsize=8)
    twin.tick_params(labelsize=8)


def _queue_panel(
    ax: Axes, data: RunData, key: str, title: str, name: str, capacity: int | None, x: Any
) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    rows: list[tuple[float, list[Any]]] = [
        (r["t"], r[key]) for r in data.metrics if isinstance(r.get(key), list)
    ]
    width = max((len(v) for _, v in rows), default=0)
    if width == 0:
        _empty(
            ax, NO_METRICS_PANEL if not data.metrics else f"no {key} in metrics.jsonl (a single-process run)"
        )
        return
    for i in range(width):
        ys = [_num(v[i]) if i < len(v) else None for _, v in rows]
        t, y = _gapped([r[0] for r in rows], ys)
        ax.plot(x(t), y, lw=1.0, label=f"{name} {i}")
    if capacity:
        ax.axhline(capacity, color="0.5", lw=0.8, ls="--", label=f"capacity {capacity}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, ncol=min(4, width + 1), loc="best")


def _gpu_panel(ax: Axes, data: RunData, what: str, x: Any) -> None:
    ax.set_title(
        "GPU utilization (%)" if what == "util" else "GPU memory used (GiB)", fontsize=10, loc="left"
    )
    if not data.gpus:
        _empty(ax, NO_GPUS if data.samples else NO_SAMPLES)
        return
    totals = set()
    for g in data.gpus.values():
        t, y = _gapped(g.t, g.util if what == "util" else g.mem_gib)
        ax.plot(x(t), y, lw=1.0, label=g.label)
        if g.total_gib is not None:
            totals.add(round(g.total_gib, 1))
    if what == "util":
        ax.set_ylim(-3, 103)
    else:
        ax.set_ylim(bottom=0)
    for total in sorted(totals) if what == "mem" else ():
        ax.axhline(total, color="0.5", lw=0.8, ls="--", label=f"total {total:g} GiB")
    ax.legend(fontsize=7, ncol=2, loc="best")


@dataclass(frozen=True, slots=True)
class _Marker:
    t: float
    kind: str
    """restart | target_restart | action | finding:<severity> | stopped"""


MARKER_STYLE: dict[str, dict[str, Any]] = {
    "restart": {"color": "tab:purple", "ls": "--", "lw": 1.3, "label": "drafter-group restart"},
    "target_restart": {"color": "tab:brown", "ls": "--", "lw": 1.3, "label": "target restart"},
    "action": {"color": "black", "ls": ":", "lw": 1.4, "label": "watch action"},
    "finding:info": {
        "color": SEVERITY_COLOR["info"],
        "ls": "-",
        "lw": 0.8,
        "alpha": 0.6,
        "label": "finding (info)",
    },
    "finding:warning": {
        "color": SEVERITY_COLOR["warning"],
        "ls": "-",
        "lw": 0.9,
        "alpha": 0.7,
        "label": "finding (warning)",
    },
    "finding:critical": {
        "color": SEVERITY_COLOR["critical"],
        "ls": "-",
        "lw": 1.0,
        "alpha": 0.8,
        "label": "finding (critical)",
    },
    "stopped": {"color": "black", "ls": "-", "lw": 2.0, "label": "job stopped"},
}


def markers(events: Sequence[Mapping[str, Any]]) -> list[_Marker]:
    out = []
    for e in events:
        kind = None
        ev = e.get("event")
        if ev == "restart":
            kind = "target_restart" if e.get("role") == "target" else "restart"
        elif ev == "action":
            kind = "action"
        elif ev == "finding":
            sev = e.get("severity")
            kind = f"finding:{sev}" if sev in SEVERITY_COLOR else "finding:warning"
        elif ev == "stopped":
            kind = "stopped"
        if kind is not None:
            out.append(_Marker(float(e["t"]), kind))
    return out


def make_figure(data: RunData, summary: ReportSummary) -> Figure:
    """The report's figure: 4 x 2 panels sharing one time axis. Marker lines carry their kind as gid."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as e:
        raise RunnerError(
            "dflashctl report needs matplotlib: pip install 'matplotlib>=3.7' into dflashctl's environment"
        ) from e

    start = summary.started_at or 0.0
    span = summary.duration_s or 0.0
    scale, unit = _unit(span)

    def x(ts: Sequence[float]) -> list[float]:
        return [(t - start) / scale for t in ts]

    tls = starts(data.events)
    fig = Figure(figsize=(16, 13 + (0.6 + 0.35 * len(tls) if tls else 0)), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    if tls:
        grid = fig.add_gridspec(5, 2, height_ratios=[1, 1, 1, 1, max(0.6, 0.18 * len(tls))])
        first = fig.add_subplot(grid[0, 0])
        axes = [
            [first if (r, c) == (0, 0) else fig.add_subplot(grid[r, c], sharex=first) for c in (0, 1)]
            for r in range(4)
        ]
        _starts_panel(fig.add_subplot(grid[4, :]), tls)
    else:
        axes = fig.subplots(4, 2, sharex=True)
    pipe = (
        data.manifest.get("config", {}).get("pipeline", {})
        if isinstance(data.manifest.get("config"), dict)
        else {}
    )
    _metric_panel(axes[0][0], data, "tok_s", "tokens/s (thousands)", x, scale=1000.0)
    _metric_panel(axes[0][1], data, "loss", "loss", x)
    _metric_panel(axes[1][0], data, "acc", "accuracy (top-1)", x)
    _tau_overlay(axes[1][0], data, x)
    _metric_panel(axes[1][1], data, "streak", "streak (expected accepted length)", x)
    _queue_panel(
        axes[2][0],
        data,
        "q_pre",
        "q_pre: data batches waiting per target",
        "target",
        pipe.get("prefetch_depth"),
        x,
    )
    _queue_panel(
        axes[2][1], data, "q_hs", "q_hs: hidden-state batches ready", "q_hs", pipe.get("queue_depth"), x
    )
    _gpu_panel(axes[3][0], data, "util", x)
    _gpu_panel(axes[3][1], data, "mem", x)
    marks = markers(data.events)
    for row in axes:
        for ax in row:
            ax.grid(True, lw=0.3, alpha=0.5)
            ax.tick_params(labelsize=8)
            for mk in marks:
                style = {k: v for k, v in MARKER_STYLE[mk.kind].items() if k != "label"}
                ax.axvline((mk.t - start) / scale, gid=mk.kind, **style)
    for ax in axes[-1]:
        ax.set_xlabel(f"time since start ({unit})", fontsize=9)
    if span > 0:
        axes[0][0].set_xlim(0, span / scale)
    used = sorted({mk.kind for mk in marks}, key=list(MARKER_STYLE).index)
    if used:
        handles = [
            Line2D([], [], **{k: v for k, v in MARKER_STYLE[k2].items() if k != "alpha"}) for k2 in used
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    head = (
        f"{summary.run_id}: {summary.steps} steps over {fmt_duration(summary.duration_s)}"
        if summary.steps is not None
        else f"{summary.run_id}: no metrics yet"
    )
    if summary.stop_reason is not None:
        head += f", stopped: {summary.stop_reason}"
    fig.suptitle(head, fontsize=12)
    return fig


STARTS_TITLE = "starts: phases from the death (restart) or the launch to the first step (s)"


def _starts_panel(ax: Axes, tls: Sequence[StartTimeline]) -> None:
    """One row per start of a worker generation, one bar per phase at its offset from the origin;
    the phases' colors are shared by every row (one legend), the row ends with its total."""
    from matplotlib import colormaps
    from matplotlib.patches import Patch

    names = list(dict.fromkeys(p.name for tl in tls for p in tl.phases))
    palette = colormaps["tab20"]
    color = {n: palette(i % 20) for i, n in enumerate(names)}
    for row, tl in enumerate(tls):
        for p in tl.phases:
            ax.barh(row, p.seconds, left=p.offset_s, height=0.6, color=color[p.name], gid=f"phase:{p.name}")
        end = max((p.offset_s + p.seconds for p in tl.phases), default=0.0)
        if tl.total_s is not None:
            ax.text(end, row, f" {secs(tl.total_s)} s", va="center", fontsize=8)
    ax.set_yticks(range(len(tls)), [tl.label for tl in tls], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(STARTS_TITLE, loc="left", fontsize=10)
    ax.set_xlabel("seconds since the death (restart) or the launch (first start)", fontsize=9)
    ax.grid(True, axis="x", lw=0.3, alpha=0.5)
    ax.tick_params(labelsize=8)
    handles = [Patch(color=color[n], label=n) for n in names]
    ax.legend(handles=handles, fontsize=7, ncol=min(7, max(1, len(names))), loc="lower right", framealpha=0.8)


def write_png(fig: Figure, out: Path) -> None:
    """Temp file beside `out` + rename: a reader (a browser, an image viewer) sees the old report or
    the new one, never half of one; a failed write leaves the old one and no temp file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_report(run_dir: Path, out: Path) -> ReportSummary:
    """Read the run directory, write the PNG at `out` (temp file + rename) and return the summary."""
    data = load_run(Path(run_dir))
    summary = summarize(data, Path(out))
    try:
        write_png(make_figure(data, summary), Path(out))
    except OSError as e:
        raise RunnerError(f"cannot write the report to {out}: {e.strerror or e}; pass --out elsewhere") from e
    return summary
