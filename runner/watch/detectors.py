"""The detectors: pure functions (snapshot history, thresholds) -> findings, run together by detect().

Each reads `history[-1]` (the newest Snapshot) and, where a moment can mislead (a GPU's
utilization), the snapshots of a short window before it. Adding one: write it in the detect_*
module of its signals and list it here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from runner.watch.detect_gpus import fault_precedence, gpu_health, gpu_xid, nvml_state
from runner.watch.detect_pipeline import (
    bottleneck,
    busy_gpu,
    eta_blowup,
    metrics_stale,
    throughput_vs_baseline,
)
from runner.watch.detect_run import (
    cold_compiles,
    damaged_files,
    degraded_events,
    job_state,
    restarts,
    sampler_state,
    source_failed,
)
from runner.watch.detect_tau import tau_findings
from runner.watch.detect_workers import dead_worker, hung_worker, likely_oom, stuck_state
from runner.watch.findings import Finding, exit_code, sort_findings
from runner.watch.snapshot import Snapshot
from runner.watch.thresholds import Thresholds

Detector = Callable[[Sequence[Snapshot], Thresholds], list[Finding]]

DETECTORS: tuple[Detector, ...] = (
    dead_worker,
    hung_worker,
    likely_oom,
    stuck_state,
    bottleneck,
    busy_gpu,
    throughput_vs_baseline,
    degraded_events,
    cold_compiles,
    eta_blowup,
    metrics_stale,
    gpu_xid,
    gpu_health,
    nvml_state,
    restarts,
    tau_findings,
    job_state,
    sampler_state,
    source_failed,
    damaged_files,
)

__all__ = ["DETECTORS", "Finding", "Thresholds", "detect", "exit_code"]


def detect(history: Sequence[Snapshot], thresholds: Thresholds | None = None) -> list[Finding]:
    """Every detector's findings for the newest snapshot, most severe first."""
    if not history:
        return []
    th = thresholds or Thresholds()
    out: list[Finding] = []
    for d in DETECTORS:
        try:
            out.extend(d(history, th))
        except Exception as e:  # noqa: BLE001 - one check that breaks must not blind the others
            out.append(
                Finding(
                    severity="critical",
                    kind="watch_error",
                    subject=d.__name__,
                    message=f"watch's {d.__name__} check failed on this sample ({type(e).__name__}: {e}): "
                    "what it looks for is not judged",
                    advice="the other checks still run; this is a bug in watch: report it with the message above",
                    numbers={},
                )
            )
    return sort_findings(fault_precedence(history[-1], out))
