"""Detectors over the pipeline's numbers (q_pre, q_hs, b/s, tok/s, ETA) beside the GPUs.

Reading the queues (docs/run-directory.md): data is cheap, so q_pre is full in a healthy run too.
What tells a blocked pipeline from a slow one is what the targets do. Every target's q_pre full,
q_hs near empty and the target GPUs idle means the targets cannot publish although nothing waits
for the drafters: the transport's slots are held by drafters that are dead or stuck (the field's
incident). With the target GPUs busy instead, the target forward is simply the slower half.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from runner.rundir import layout
from runner.watch.findings import Finding, Severity
from runner.watch.signals import (
    fmt_clock,
    fmt_duration,
    fmt_pct,
    fmt_range,
    fmt_tok,
    idle_share,
    job_stopped,
    median,
    single_process,
    util_max,
    util_now,
)
from runner.watch.snapshot import Pipeline, Snapshot, WorkerView
from runner.watch.steady import world_of
from runner.watch.thresholds import Thresholds


def _targets_busy(history: Sequence[Snapshot], th: Thresholds) -> tuple[bool | None, float | None]:
    """(busy?, median target GPU utilization, each its highest over the idle window: a GPU between
    two batches reads low for a moment). Without GPU readings, the target heartbeats' states."""
    snap = history[-1]
    targets = snap.role("target")
    utils = [u for u in (util_max(history, w.gpu_index, th.idle_window_s) for w in targets) if u is not None]
    if utils:
        return median(utils) >= th.targets_busy_util_pct, median(utils)
    states = [w.state for w in targets if w.alive]
    if states:
        return sum(s == "computing" for s in states) > len(states) / 2, None
    return None, None


def _rates(p: Pipeline) -> str:
    tgt = "n/a" if p.tgt_bps is None else f"{p.tgt_bps:.2f}"
    dft = "n/a" if p.dft_bps is None else f"{p.dft_bps:.2f}"
    return f"tgt={tgt} b/s, dft={dft} b/s, {fmt_tok(p.tok_s)}"


def _waiting_half(
    history: Sequence[Snapshot], th: Thresholds, waiting: str, slow: str
) -> tuple[Severity, str, dict[str, object]]:
    """How idle the waiting half's GPUs are (those of role `waiting` that hold no `slow` worker):
    idle idle_share_warn of the time or more makes the slower-half finding a warning. Returns the
    severity, the words for the message and the numbers."""
    snap = history[-1]
    slow_gpus = {w.gpu_index for w in snap.role(slow)}
    gpus = sorted({w.gpu_index for w in snap.role(waiting) if w.gpu_index is not None} - slow_gpus)
    share = idle_share(history, gpus, th.idle_share_window_s)
    numbers: dict[str, object] = {
        "idle_share": share,
        "idle_gpus": gpus,
        "idle_window_s": th.idle_share_window_s,
    }
    if share is None:
        return "info", "", numbers
    words = (
        f" The {waiting} GPUs ({', '.join(map(str, gpus))}) were idle {fmt_pct(100 * share)} of the last "
        f"{fmt_duration(th.idle_share_window_s)}."
    )
    return ("warning" if share >= th.idle_share_warn else "info"), words, numbers


def bottleneck(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    p = snap.pipeline
    if p is None or not p.q_pre or not p.q_hs or single_process(snap) or job_stopped(snap):
        return []
    pre_full = all(q >= th.queue_full_frac * p.prefetch_depth for q in p.q_pre)
    pre_empty = all(q <= th.queue_empty_frac * p.prefetch_depth for q in p.q_pre)
    hs_cap = p.queue_depth * len(p.q_hs)
    hs_empty = sum(p.q_hs) <= th.queue_empty_frac * hs_cap
    hs_full = sum(p.q_hs) >= th.queue_full_frac * hs_cap
    busy, target_util = _targets_busy(history, th)
    queues = f"q_pre={list(p.q_pre)} of {p.prefetch_depth}, q_hs={list(p.q_hs)} of {p.queue_depth}"
    numbers = {
        "q_pre": list(p.q_pre),
        "q_hs": list(p.q_hs),
        "prefetch_depth": p.prefetch_depth,
        "queue_depth": p.queue_depth,
        "tgt_bps": p.tgt_bps,
        "dft_bps": p.dft_bps,
        "tok_s": p.tok_s,
        "target_util_median": target_util,
    }
    if pre_full and hs_empty and busy is not True:
        idle = []
        for w in snap.role("drafter"):
            u = util_max(history, w.gpu_index, th.idle_window_s)
            if u is not None and u <= th.idle_util_pct:
                idle.append((w.gpu_index, w.name, u))
        idle_words = ", ".join(
            f"GPU {g} ({n}, {u:.0f}%)" for g, n, u in sorted(idle, key=lambda x: x[0] or 0)
        )
        targets = "idle" if target_util is None else f"at {fmt_pct(target_util)} (median)"
        drafters = snap.role("drafter")
        # Every drafter alive, stepping, heartbeating and (where NVML reads it) busy: they are merely
        # the slower half of a healthy pipeline. Critical is for drafters that are dead, stuck, frozen
        # (a heartbeat older than stale_s: hung_worker's "frozen", which comes before hung_s) or idle.
        working = (
            bool(drafters)
            and not idle
            and all(
                w.alive
                and w.progress_age_s is not None
                and w.progress_age_s <= th.hung_s
                and (w.age_s is None or w.age_s <= th.stale_s)
                for w in drafters
            )
        )
        extra: dict[str, object] = {}
        if working:
            severity: Severity
            severity, idle_said, extra = _waiting_half(history, th, "target", "drafter")
            message = (
                f"drafters are the slower half: the targets' prefetch queues are full and hidden "
                f"states are taken as soon as they are ready ({queues}); every drafter is stepping.{idle_said} "
                f"{_rates(p)}"
            )
            advice = (
                "more drafter GPUs (pipeline.drafters) would raise throughput; or fewer targets "
                "(pipeline.targets) for the same throughput, freeing their GPUs"
            )
        else:
            severity = "critical"
            message = (
                f"drafters are the bottleneck: every target's prefetch queue is full and no hidden states "
                f"are waiting ({queues}) while the target GPUs are {targets}: the targets are blocked, "
                f"not slow. Idle drafter GPUs: {idle_words or 'none'}. {_rates(p)}"
            )
            advice = (
                "a dead or stuck drafter holds the transport's slots: see the drafter findings; restarting "
                "the drafter group releases them and keeps the targets"
            )
        return [
            Finding(
                severity=severity,
                kind="drafters_bottleneck",
                subject="pipeline",
                message=message,
                advice=advice,
                numbers={**numbers, **extra, "idle_drafter_gpus": [g for g, _, _ in idle]},
            )
        ]
    drafters_waiting = any(w.state == "waiting_input" for w in snap.role("drafter"))
    if hs_empty and busy is True and drafters_waiting:
        severity, idle_said, extra = _waiting_half(history, th, "drafter", "target")
        return [
            Finding(
                severity=severity,
                kind="targets_bottleneck",
                subject="pipeline",
                message=(
                    f"targets are the bottleneck: drafters wait for hidden states ({queues}) while the target "
                    f"GPUs are busy ({fmt_pct(target_util)} median).{idle_said} {_rates(p)}"
                ),
                advice="add target workers (pipeline.targets) or move a drafter GPU to the targets",
                numbers={**numbers, **extra},
            )
        ]
    if hs_full and any(w.state == "waiting_output" for w in snap.role("target")):
        severity, idle_said, extra = _waiting_half(history, th, "target", "drafter")
        return [
            Finding(
                severity=severity,
                kind="drafters_slower",
                subject="pipeline",
                message=f"drafters are slower than the targets: hidden states pile up ({queues}).{idle_said} "
                f"{_rates(p)}",
                advice="add drafter workers (pipeline.drafters) or give the targets fewer GPUs",
                numbers={**numbers, **extra},
            )
        ]
    if pre_empty and any(w.state == "waiting_input" for w in snap.role("target")):
        severity, idle_said, extra = _waiting_half(history, th, "target", "data")
        return [
            Finding(
                severity=severity,
                kind="data_bottleneck",
                subject="pipeline",
                message=f"data loading is the bottleneck: the targets wait for batches ({queues}).{idle_said} "
                f"{_rates(p)}",
                advice="pre-tokenize the data (data.cache_dir) or put it on a faster disk",
                numbers={**numbers, **extra},
            )
        ]
    return []


def busy_gpu(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """The one GPU of a role that works while its peers idle: says which worker sits on it (the
    field's GPU 3 at 100% whose role nobody established)."""
    snap = history[-1]
    out = []
    for role in sorted({w.role for w in snap.workers}):
        placed: list[tuple[WorkerView, float]] = []
        for w in snap.role(role):
            u = util_now(snap, w.gpu_index)
            if u is not None:
                placed.append((w, u))
        busy = [(w, u) for w, u in placed if u >= th.busy_util_pct]
        rest = [(w, u) for w, u in placed if u < th.busy_util_pct]
        if len(busy) != 1 or not rest or any(u > th.idle_util_pct for _, u in rest):
            continue
        w, u = busy[0]
        out.append(
            Finding(
                severity="info",
                kind="busy_gpu",
                subject=f"GPU {w.gpu_index}",
                message=(
                    f"GPU {w.gpu_index} is the only busy {role} GPU: {w.label} at {u:.0f}% while "
                    f"{', '.join(x.name for x, _ in rest)} are at {fmt_range([x for _, x in rest])}"
                ),
                advice=f"if the pipeline is stuck, {w.name} is the one still computing: read {layout.log(w.name)}",
                numbers={"gpu": w.gpu_index, "worker": w.name, "pid": w.pid, "util_gpu": u},
            )
        )
    return out


def _past_warmup(snap: Snapshot, key: str, th: Thresholds) -> list[Mapping[str, Any]]:
    """Metrics records past the warm-up with a number in `key`, oldest first."""
    out = []
    for m in snap.metrics:
        v, elapsed = m.get(key), m.get("elapsed_s")
        if isinstance(v, (int, float)) and isinstance(elapsed, (int, float)) and elapsed >= th.warmup_s:
            out.append(m)
    return out


def _steady(snap: Snapshot, key: str, th: Thresholds) -> list[float]:
    """Values of a metrics field past the warm-up, oldest first."""
    return [float(m[key]) for m in _past_warmup(snap, key, th)]


def throughput_vs_baseline(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    base = snap.baseline_tok_s
    recent = _steady(snap, "tok_s", th)[-th.throughput_window :]
    if not base or not recent:
        return []
    now = median(recent)
    if now >= th.degraded_frac * base:
        return []
    return [
        Finding(
            severity="warning",
            kind="slow_kernels",
            subject="run",
            message=(
                f"throughput {fmt_tok(now)} is {now / base:.0%} of the baseline {fmt_tok(base)} stored for this "
                "environment fingerprint and config: kernels or the environment degraded"
            ),
            advice=(
                "look for degraded events (unfused flex, recompile limit, force_compile_during_fx_trace) and "
                "cold compiles below; run `dflashctl doctor` against the environment that was fast"
            ),
            numbers={"tok_s": now, "baseline_tok_s": base, "fraction": now / base},
        )
    ]


STEADY_BAND = 0.9
"""A record at or above this share of the steady reference is still steady: the slide began after
the last such record."""


def eta_blowup(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """The run slowed down: its newest `slowdown_records` records all run `eta_blowup` times below the
    run's steady reference (runner.watch.steady), so its ETA is that many times what the steady rate
    gives. Judged against the best sustained rate, which a slide cannot drag along, and on a few
    records, so a sudden drop is seen within seconds of records."""
    snap = history[-1]
    ref = snap.reference
    if ref is None:
        return []
    recs = [
        m
        for m in _past_warmup(snap, "tok_s", th)
        if world_of(m) == ref.world and isinstance(m.get("t"), (int, float))
    ]
    newest = recs[-th.slowdown_records :]
    if len(newest) < th.slowdown_records or newest[0]["t"] <= ref.t:
        return []
    now_tok = max(float(m["tok_s"]) for m in newest)
    if now_tok <= 0 or ref.tok_s < th.eta_blowup * now_tok:
        return []
    factor = ref.tok_s / now_tok
    since_ref = [m for m in recs if m["t"] > ref.t]
    # The first record after the last steady one (the newest are all slow, so there is one).
    began = since_ref[
        max((i + 1 for i, m in enumerate(since_ref) if m["tok_s"] >= STEADY_BAND * ref.tok_s), default=0)
    ]
    last = newest[-1]
    span = float(last["t"]) - float(began["t"])
    eta = last.get("eta_s")
    eta_part = ""
    if isinstance(eta, (int, float)) and eta > 0:
        eta_part = f"; ETA {fmt_duration(eta)} is {factor:.1f}x the {fmt_duration(eta / factor)} the steady rate gives"
    steps = ""
    if isinstance(began.get("step"), int) and isinstance(last.get("step"), int):
        steps = f", steps {began['step']}-{last['step']}"
    return [
        Finding(
            severity="warning",
            kind="eta_blowup",
            subject="run",
            message=(
                f"throughput fell to {fmt_tok(now_tok)} from this run's steady {fmt_tok(ref.tok_s)} "
                f"({now_tok / ref.tok_s:.0%}) over {fmt_duration(span)}, from {fmt_clock(began['t'])} "
                f"to {fmt_clock(last['t'])}{steps}{eta_part}: it slowed down"
            ),
            advice="the findings above say where; if none does, compare tok/s and the GPU rows with earlier",
            numbers={
                "tok_s": now_tok,
                "steady_tok_s": ref.tok_s,
                "steady_t": ref.t,
                "steady_step": ref.step,
                "factor": factor,
                "slide_start_t": float(began["t"]),
                "now_t": float(last["t"]),
                "span_s": span,
                "eta_s": eta,
            },
        )
    ]


def record_cadence(snap: Snapshot) -> tuple[float, float, float | None]:
    """(cadence, status interval, step seconds): how often this run writes a metrics record. The
    job writes one after the step that ends a status interval, so a run whose steps are longer than
    the interval writes one a step: the cadence is the larger of the interval, the median gap
    between its recent records and the newest record's step time (1 / dft_bps)."""
    interval = float(snap.config("run", "status_interval_s", default=10.0))
    ts = [float(m["t"]) for m in snap.metrics[-11:] if isinstance(m.get("t"), (int, float))]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b > a]
    bps = snap.metrics[-1].get("dft_bps") if snap.metrics else None
    step_s = 1.0 / bps if isinstance(bps, (int, float)) and bps > 0 else None
    return max([interval, median(gaps) if gaps else 0.0, step_s or 0.0]), interval, step_s


def metrics_stale(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    p = snap.pipeline
    if p is None or p.age_s is None or snap.job.get("lock_held") is False:
        return []
    if any(w.state in ("compiling", "checkpointing") for w in snap.role("drafter")):
        return []  # a cold compile of a new shape bucket can take minutes without a record
    cadence, interval, step_s = record_cadence(snap)
    if p.age_s <= th.metrics_stale_intervals * cadence:
        return []
    why = f"status interval {interval:.0f} s" + ("" if step_s is None else f", steps of {step_s:.1f} s")
    return [
        Finding(
            severity="warning",
            kind="metrics_stale",
            subject="run",
            message=(
                f"no metrics record for {fmt_duration(p.age_s)} (this run writes one every {cadence:.0f} s: "
                f"{why}): the worker that writes them (drafter rank 0) is stuck or gone"
            ),
            advice=f"see the drafter findings; read {layout.log('drafter-0')}",
            numbers={
                "metrics_age_s": p.age_s,
                "status_interval_s": interval,
                "cadence_s": cadence,
                "step_s": step_s,
            },
        )
    ]
