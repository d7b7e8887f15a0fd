"""Detectors about single workers: dead, hung (frozen or stuck), likely OOM / broken CUDA context."""

from __future__ import annotations

from collections.abc import Sequence

from runner.rundir import layout
from runner.watch.findings import Finding, Severity
from runner.watch.signals import (
    PAUSED_STATES,
    fmt_duration,
    fmt_gib,
    fmt_pct,
    single_process,
    util_max,
    worker_idle,
)
from runner.watch.snapshot import Snapshot, WorkerView
from runner.watch.thresholds import Thresholds


def _where(w: WorkerView) -> str:
    return f" on GPU {w.gpu_index}" if w.gpu_index is not None else ""


def _restart_advice(w: WorkerView) -> str:
    log = layout.log(w.name)
    if w.role == "drafter":
        return (
            "the job restarts its drafter group by itself (targets kept); watch with --restart turns a "
            f"hung drafter into a dead one so that happens. If no restart follows, read {log}"
        )
    return (
        f"a target is restarted only with pipeline.restart_targets (or when asked); read {log} for the cause"
    )


def dead_worker(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    out = []
    for w in snap.workers:
        if w.state == "stopped":
            continue  # it finished and said so
        if w.alive is False:
            what = f"its process is gone (pid {w.pid})"
        elif w.alive is None and w.age_s is not None and w.age_s > th.stale_s:
            what = "its heartbeat stopped and its process cannot be checked"
        else:
            continue
        out.append(
            Finding(
                severity="critical",
                kind="dead_worker",
                subject=w.name,
                message=(
                    f"{w.name}{_where(w)} is dead: {what}; last heartbeat {fmt_duration(w.age_s)} ago "
                    f"in state {w.state}, step {w.step}"
                ),
                advice=_restart_advice(w),
                numbers={"pid": w.pid, "heartbeat_age_s": w.age_s, "step": w.step, "gpu": w.gpu_index},
            )
        )
    return out


def _input_waiting(snap: Snapshot, w: WorkerView) -> tuple[bool, str]:
    """Whether work is queued for the worker, and the words that say so."""
    p = snap.pipeline
    if single_process(snap):
        return True, "its data is local (one process)"
    if w.role == "drafter":
        if p is None or not p.q_hs:
            return False, ""
        return sum(p.q_hs) > 0, f"{sum(p.q_hs)} hidden-state batches wait (q_hs={list(p.q_hs)})"
    q_pre = w.heartbeat.get("q_pre")
    if w.state == "waiting_output" or not isinstance(q_pre, int):
        return False, ""  # a target blocked on a full q_hs is waiting, not hung
    return q_pre > 0, f"{q_pre} data batches wait in its prefetch queue"


def _full_and_idle(history: Sequence[Snapshot], gpu_index: int | None, th: Thresholds) -> bool:
    g = history[-1].gpu(gpu_index)
    util = util_max(history, gpu_index, th.idle_window_s)
    frac = None if g is None else g.mem_frac
    return frac is not None and frac >= th.mem_full_frac and util is not None and util <= th.oom_util_pct


def hung_worker(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    dead_peers = {w.role for w in snap.workers if w.alive is False and w.state != "stopped"}
    named_by_oom = {n for f in likely_oom(history, th) for n in f.numbers["workers"]}
    out = []
    for w in snap.workers:
        if w.alive is not True or w.state == "stopped":
            continue
        if w.age_s is not None and w.age_s > th.stale_s:
            why = " (the process is stopped: SIGSTOP or a debugger)" if w.proc_state == "stopped" else ""
            message = (
                f"{w.name}{_where(w)} is frozen: its process (pid {w.pid}, {w.proc_state}) exists but its "
                f"heartbeat is {fmt_duration(w.age_s)} old{why}"
            )
        else:
            if w.state in PAUSED_STATES or w.progress_age_s is None or w.progress_age_s < th.hung_s:
                continue
            if w.step in (0, None) and (w.uptime_s or 0) < th.warmup_s:
                continue  # loading a model, joining the group: no first step yet
            waiting, queued = _input_waiting(snap, w)
            if not waiting or worker_idle(history, w, th.idle_util_pct, th.idle_window_s) is False:
                continue
            if w.name in named_by_oom:
                continue  # likely_oom names it, with the memory numbers
            util = util_max(history, w.gpu_index, th.idle_window_s)
            use = (
                f"its GPU is at {fmt_pct(util)}"
                if util is not None
                else f"its CPU use is {fmt_pct(w.cpu_percent)}"
            )
            peer = (
                " (a peer is dead: it may be waiting for it in a collective)" if w.role in dead_peers else ""
            )
            message = (
                f"{w.name}{_where(w)} is hung: no progress for {fmt_duration(w.progress_age_s)} while "
                f"{queued}; {use}, state {w.state}{peer}"
            )
        out.append(
            Finding(
                severity="critical",
                kind="hung_worker",
                subject=w.name,
                message=message,
                advice=_restart_advice(w),
                numbers={
                    "pid": w.pid,
                    "heartbeat_age_s": w.age_s,
                    "progress_age_s": w.progress_age_s,
                    "proc_state": w.proc_state,
                    "gpu": w.gpu_index,
                },
            )
        )
    return out


def likely_oom(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """Memory full, utilization ~0 and no progress. Not while a worker on the GPU compiles or warms
    up: the first compile's memory spike looks the same for a while."""
    snap = history[-1]
    out = []
    for g in snap.gpus:
        if not _full_and_idle(history, g.index, th):
            continue
        ws = [w for w in (snap.worker(n) for n in g.workers) if w is not None and w.state != "stopped"]
        if not ws or any(w.state == "compiling" or (w.uptime_s or 0) < th.warmup_s for w in ws):
            continue
        stalled = [w for w in ws if w.progress_age_s is not None and w.progress_age_s >= th.oom_no_progress_s]
        if len(stalled) < len(ws):
            continue
        names = ", ".join(w.label for w in stalled)
        util = util_max(history, g.index, th.idle_window_s)
        assert g.mem_frac is not None
        out.append(
            Finding(
                severity="critical",
                kind="likely_oom",
                subject=f"GPU {g.index}",
                message=(
                    f"GPU {g.index} ({names}): likely out of memory or a broken CUDA context: memory "
                    f"{fmt_gib(g.mem_used_mb)} of {fmt_gib(g.mem_total_mb)} GiB ({g.mem_frac:.0%}) at "
                    f"{fmt_pct(util)} utilization, no progress for {fmt_duration(min(w.progress_age_s or 0 for w in stalled))}"
                ),
                advice=(
                    f"read {layout.log(stalled[0].name)} for 'out of memory' or 'illegal memory access'; restart "
                    "the worker (a drafter: watch --restart does it); if it recurs, lower train.token_budget "
                    "or train.max_batch_size"
                ),
                numbers={
                    "gpu": g.index,
                    "mem_used_mb": g.mem_used_mb,
                    "mem_total_mb": g.mem_total_mb,
                    "util_gpu": util,
                    "workers": [w.name for w in stalled],
                },
            )
        )
    return out


def _span(s: float) -> str:
    """Seconds below ten minutes (a limit of 160 s and an age of 200 s both read "3 min" otherwise)."""
    return f"{s:.0f} s" if s < 600 else fmt_duration(s)


COMPILE_LIMIT_FLOOR_S = 120.0
"""A limit from the run's own compiles never goes below this (a run of quick compiles so far)."""


def compile_limit(snap: Snapshot, th: Thresholds) -> tuple[float, str]:
    """How long a compile may take in this run, and where that comes from: compile_history_factor
    times the run's longest compile so far (its `compiled` events), else compile_limit_s."""
    seconds = [
        float(e["seconds"])
        for e in snap.events
        if e.get("event") == "compiled" and isinstance(e.get("seconds"), (int, float)) and e["seconds"] > 0
    ]
    if not seconds:
        return (
            th.compile_limit_s,
            f"compile_limit_s ({fmt_duration(th.compile_limit_s)}: no compile of this run yet)",
        )
    longest = max(seconds)
    limit = max(COMPILE_LIMIT_FLOOR_S, th.compile_history_factor * longest)
    return limit, (
        f"{th.compile_history_factor:g}x this run's longest compile so far ({_span(longest)}, "
        f"{len(seconds)} compile(s))"
    )


_WAITS_FOR = {
    "waiting_input": "its input (the other half, or the data)",
    "waiting_output": "room to publish (the drafters)",
}


def stuck_state(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """Every busy or waiting state has a time limit: a worker `starting`, `compiling` or
    `checkpointing` past its limit is stuck (critical) whatever its GPU shows, since those states
    excuse it from the other detectors; one waiting on a queue past wait_limit_s is a warning."""
    snap = history[-1]
    out = []
    for w in snap.workers:
        if w.alive is not True or w.state_age_s is None or w.state in (None, "stopped", "computing"):
            continue
        if w.age_s is not None and w.age_s > th.stale_s:
            continue  # frozen: hung_worker says so
        severity: Severity = "critical"
        if w.state == "compiling":
            limit, why = compile_limit(snap, th)
            advice = (
                f"a compile this long is stuck or thrashing (recompiles): read {layout.log(w.name)}; a restored "
                f"compile cache (dflashctl cache restore / run --warm) makes it a load. {_restart_advice(w)}"
            )
        elif w.state == "starting":
            limit, why = th.starting_limit_s, "starting_limit_s"
            advice = f"loading its model or joining its group has stalled: read {layout.log(w.name)}. {_restart_advice(w)}"
        elif w.state == "checkpointing":
            limit, why = th.checkpoint_limit_s, "checkpoint_limit_s"
            advice = (
                f"the checkpoint write has stalled: check the runs root's disk (space, a hung mount) and "
                f"{layout.log(w.name)}. {_restart_advice(w)}"
            )
        elif w.state in _WAITS_FOR:
            limit, why = th.wait_limit_s, "wait_limit_s"
            severity = "warning"
            advice = (
                f"it waits for {_WAITS_FOR[w.state]}: the findings about that side say why; if none do, "
                f"read {layout.log(w.name)}"
            )
        else:
            continue
        if w.state_age_s <= limit:
            continue
        util = util_max(history, w.gpu_index, th.idle_window_s)
        use = f"; its GPU is at {fmt_pct(util)}" if util is not None else ""
        out.append(
            Finding(
                severity=severity,
                kind="stuck_worker",
                subject=w.name,
                message=(
                    f"{w.name}{_where(w)} has been {w.state} for {_span(w.state_age_s)}, past its "
                    f"limit of {_span(limit)} ({why}){use}, step {w.step}"
                ),
                advice=advice,
                numbers={
                    "state": w.state,
                    "state_age_s": w.state_age_s,
                    "limit_s": limit,
                    "pid": w.pid,
                    "gpu": w.gpu_index,
                    "util_gpu": util,
                },
            )
        )
    return out
