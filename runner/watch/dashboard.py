"""The dashboard: a Rich renderable of one Snapshot and its findings (for rich.live.Live or a plain
print), and the same content as a dict for `watch --once --json`.

Readable without color and off a tty: every state is a word (DEAD, FROZEN, idle), bars are
characters, colors only repeat what the words say.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from runner.watch.findings import Finding, exit_code
from runner.watch.signals import fmt_duration, fmt_gib, fmt_tok
from runner.watch.snapshot import GpuView, Snapshot, WorkerView
from runner.watch.timeline import cost, last_restart

SPARKS = "▁▂▃▄▅▆▇█"
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
SPARK_WINDOW_S = 900.0
"""The tok/s sparkline covers the last 15 minutes of metrics records."""


def sparkline(values: Sequence[float], width: int = 30) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi <= lo:
        return SPARKS[len(SPARKS) // 2] * len(vals)
    return "".join(SPARKS[round((v - lo) / (hi - lo) * (len(SPARKS) - 1))] for v in vals)


def bar(frac: float | None, width: int = 10) -> str:
    if frac is None:
        return "·" * width
    full = max(0, min(width, round(frac * width)))
    return "█" * full + "░" * (width - full)


def _worker_state(w: WorkerView, stale_s: float) -> Text:
    if w.alive is False and w.state != "stopped":
        return Text("DEAD", style="bold red")
    if w.alive and w.age_s is not None and w.age_s > stale_s:
        return Text(f"FROZEN ({w.proc_state})", style="bold red")
    return Text(w.state or "n/a")


def _step_age(w: WorkerView) -> str:
    return f"{fmt_duration(w.progress_age_s)}, step {w.step if w.step is not None else 'n/a'}"


def _label(w: WorkerView) -> str:
    """nvidia-smi shows host pids: a worker in a container shows both."""
    host = f"\n  host pid {w.host_pid}" if w.host_pid is not None and w.host_pid != w.pid else ""
    return f"{w.label}{host}"


def _cell(x: str | Text) -> Text:
    """Plain text, never markup: findings and lists are full of brackets."""
    return x if isinstance(x, Text) else Text(x)


def columns(title: str, header: Sequence[str], rows: Sequence[Sequence[str | Text]]) -> Text:
    """Fixed-width columns as one Text, cropped (not wrapped) on a narrow terminal. A rich Table
    would cost ~15 ms of CPU a refresh at 8 GPUs; this costs well under one."""
    table = [[_cell(c).split("\n") for c in row] for row in [list(header), *rows]]
    widths = [max(line.cell_len for cell in col for line in cell) for col in zip(*table, strict=True)]
    out = Text(title + "\n", no_wrap=True, overflow="crop")
    for r, row in enumerate(table):
        for i in range(max(len(cell) for cell in row)):
            line = Text()
            for j, cell in enumerate(row):
                piece = cell[i] if i < len(cell) else Text()
                line.append_text(piece)
                line.append(" " * (widths[j] - piece.cell_len + 2))
            line.rstrip()
            out.append_text(line)
            out.append("\n")
        if r == 0:
            out.append("-" * (sum(widths) + 2 * (len(widths) - 1)) + "\n")
    out.rstrip()
    return out


def _gpu_row(g: GpuView, snap: Snapshot, stale_s: float) -> list[str | Text]:
    ws = [w for w in (snap.worker(n) for n in g.workers) if w is not None]
    who = "\n".join(_label(w) for w in ws) or "-"
    mem = f"{bar(g.mem_frac)} {fmt_gib(g.mem_used_mb)}/{fmt_gib(g.mem_total_mb)} GiB"
    util = "n/a" if g.util_gpu is None else f"{g.util_gpu:.0f}%"
    temp = "n/a" if g.temp_c is None else f"{g.temp_c:.0f} C"
    power = "n/a" if g.power_w is None else f"{g.power_w:.0f} W"
    reasons = [r for r in (g.throttle or ()) if r != "idle"]
    throttle = "n/a" if g.throttle is None else ", ".join(reasons) or "-"
    if g.faults:
        throttle = ", ".join(g.faults)
    states = Text("\n").join(_worker_state(w, stale_s) for w in ws) if ws else Text("-")
    ages = "\n".join(_step_age(w) for w in ws) or "-"
    return [str(g.index), who, mem, util, f"{temp} {power}", throttle, states, ages]


def gpu_table(snap: Snapshot, stale_s: float = 10.0) -> Text:
    header = ("GPU", "worker", "memory", "util", "temp/power", "throttling", "state", "step age")
    rows = [_gpu_row(g, snap, stale_s) for g in snap.gpus]
    return columns(f"GPUs on {snap.host or '?'} (NVML {snap.nvml})", header, rows)


def worker_table(workers: Sequence[WorkerView], stale_s: float = 10.0) -> Text:
    header = ("worker", "pid", "device", "state", "step age", "heartbeat", "cpu", "rss")
    rows = [
        (
            w.name,
            str(w.pid),
            w.device or "n/a",
            _worker_state(w, stale_s),
            _step_age(w),
            f"{fmt_duration(w.age_s)} ago",
            "n/a" if w.cpu_percent is None else f"{w.cpu_percent:.0f}%",
            "n/a" if w.rss_mb is None else f"{w.rss_mb / 1024:.1f} GiB",
        )
        for w in workers
    ]
    return columns("workers without a GPU reading", header, rows)


def pipeline_panel(snap: Snapshot) -> Panel:
    p = snap.pipeline
    restart = last_restart(snap.events)
    tail = [] if restart is None else [f"last restart (gen {restart.generation}): {cost(restart)}"]
    if p is None:
        return Panel(Text("\n".join(["no metrics record yet", *tail])), title="pipeline", title_align="left")
    tok = [v for _, v in snap.series("tok_s", SPARK_WINDOW_S)]
    eta = "n/a" if p.eta_s is None else fmt_duration(p.eta_s)
    base = "" if snap.baseline_tok_s is None else f"   baseline {fmt_tok(snap.baseline_tok_s)}"
    lines = [
        f"q_pre {list(p.q_pre)} of {p.prefetch_depth}   q_hs {list(p.q_hs)} of {p.queue_depth}",
        (
            f"tgt {'n/a' if p.tgt_bps is None else f'{p.tgt_bps:.2f}'} b/s   "
            f"dft {'n/a' if p.dft_bps is None else f'{p.dft_bps:.2f}'} b/s   {fmt_tok(p.tok_s)} "
            f"{sparkline(tok)}{base}"
        ),
        (
            f"step {p.step}   epoch {'n/a' if p.epoch is None else f'{p.epoch:.2f}'}   ETA {eta}   "
            f"metrics {fmt_duration(p.age_s)} old"
        ),
        *tail,
    ]
    return Panel(Text("\n".join(lines)), title="pipeline", title_align="left")


def findings_panel(findings: Sequence[Finding]) -> Panel:
    body = Text()
    if not findings:
        body.append("healthy: no findings")
    for i, f in enumerate(findings):
        if i:
            body.append("\n")
        body.append(f"{f.severity.upper():<8}", style=SEVERITY_STYLE[f.severity])
        body.append(f" {f.message}")
        if f.advice:
            body.append(f"\n         -> {f.advice}")
    return Panel(body, title="findings", title_align="left")


def render_dashboard(
    snapshot: Snapshot, findings: Sequence[Finding], *, stale_s: float = 10.0
) -> RenderableType:
    counts = {s: sum(f.severity == s for f in findings) for s in ("critical", "warning", "info")}
    # Two lines: a run directory's path is long, and the counts must not wrap at 80 columns.
    head = Text(
        f"{snapshot.run_dir or 'run'} on {snapshot.host or '?'}\n"
        f"{counts['critical']} critical, {counts['warning']} warning, {counts['info']} info   "
        f"sample {fmt_duration(snapshot.sample_age_s)} old ({snapshot.source})"
    )
    parts: list[RenderableType] = [head]
    if snapshot.gpus:
        parts.append(gpu_table(snapshot, stale_s))
    shown = {n for g in snapshot.gpus for n in g.workers}
    rest = [w for w in snapshot.workers if w.name not in shown]
    if rest:
        parts.append(worker_table(rest, stale_s))
    parts += [pipeline_panel(snapshot), findings_panel(findings)]
    return Group(*parts)


def snapshot_json(snapshot: Snapshot, findings: Sequence[Finding]) -> dict[str, Any]:
    """What `watch --once --json` prints: the snapshot without its history, and the findings."""
    return {
        "t": snapshot.t,
        "host": snapshot.host,
        "run_dir": snapshot.run_dir,
        "nvml": snapshot.nvml,
        "source": snapshot.source,
        "sample_age_s": snapshot.sample_age_s,
        "exit_code": exit_code(findings),
        "gpus": [dataclasses.asdict(g) for g in snapshot.gpus],
        "workers": [
            {k: v for k, v in dataclasses.asdict(w).items() if k != "heartbeat"} for w in snapshot.workers
        ],
        "pipeline": None if snapshot.pipeline is None else dataclasses.asdict(snapshot.pipeline),
        "tok_s_history": [v for _, v in snapshot.series("tok_s", SPARK_WINDOW_S)],
        "baseline_tok_s": snapshot.baseline_tok_s,
        "last_restart": None if (tl := last_restart(snapshot.events)) is None else tl.to_dict(),
        "xid_supported": snapshot.xid_supported,
        "findings": [f.to_dict() for f in findings],
    }
