"""Detectors of GPU faults: XID events, clock slowdowns, ECC errors, lost GPUs, NVML itself."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from runner.watch.findings import Finding, Severity
from runner.watch.signals import fmt_duration
from runner.watch.snapshot import Snapshot
from runner.watch.thresholds import Thresholds

XIDS: dict[int, tuple[Severity, str]] = {
    13: ("warning", "graphics engine exception (often the application's own error)"),
    31: ("warning", "GPU memory page fault (an illegal address in a kernel)"),
    43: ("warning", "GPU stopped processing (the application was stopped)"),
    45: ("warning", "preemptive cleanup (a process was killed mid-kernel)"),
    48: ("critical", "double-bit ECC error"),
    61: ("critical", "internal micro-controller breakpoint"),
    62: ("critical", "internal micro-controller halt"),
    63: ("warning", "ECC page retirement or row remapping recorded"),
    64: ("critical", "ECC page retirement or row remapping failed"),
    74: ("critical", "NVLink error"),
    79: ("critical", "GPU has fallen off the bus"),
    92: ("warning", "high single-bit ECC error rate"),
    94: ("warning", "contained ECC error"),
    95: ("critical", "uncontained ECC error"),
    119: ("critical", "GSP RPC timeout"),
    120: ("critical", "GSP error"),
}
SLOWDOWNS = ("hw slowdown", "hw thermal", "sw thermal", "power brake")
"""Clock-event reasons that slow a GPU below what it should run at (power cap under load is normal)."""


def gpu_xid(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    seen: dict[tuple[int, int], int] = {}
    for x in snap.xids:
        t, gpu, xid = x.get("t"), x.get("gpu"), x.get("xid")
        if isinstance(xid, int) and isinstance(t, (int, float)) and t >= snap.t - th.xid_window_s:
            key = (gpu if isinstance(gpu, int) else -1, xid)
            seen[key] = seen.get(key, 0) + 1
    names = {x.get("gpu"): x.get("name") for x in snap.xids if isinstance(x.get("name"), str)}
    out = []
    for (gpu, xid), count in sorted(seen.items()):
        severity, words = XIDS.get(xid, ("warning", "see NVIDIA's XID catalog"))
        g = snap.gpu(gpu)
        name = (g.name if g is not None else None) or names.get(gpu)
        who = ", ".join(x for x in (name, *(g.workers if g is not None else ())) if x)
        where = f"GPU {gpu}" if gpu >= 0 else "a GPU NVML could not name"
        out.append(
            Finding(
                severity=severity,
                kind="gpu_xid",
                subject=f"GPU {gpu}" if gpu >= 0 else "GPU ?",
                message=f"{where}{f' ({who})' if who else ''}: XID {xid} x{count}: {words}",
                advice=(
                    f"a hardware fault: {DRAIN}"
                    if severity == "critical"
                    else "an application XID: read the log "
                    "of the worker on that GPU; if it recurs with no application error, check the GPU (nvidia-smi -q, dmesg)"
                ),
                numbers={"gpu": gpu, "name": name, "xid": xid, "count": count},
            )
        )
    return out


DRAIN = (
    "drain the GPU: stop the run (dflashctl stop RUN), reset it (nvidia-smi -r) or reboot the host, check "
    "dmesg and nvidia-smi -q (RMA if it recurs), then relaunch without it (pipeline.target_devices / "
    "drafter_devices) or on another host; watch does not restart a worker onto it"
)
HARDWARE_KINDS = ("gpu_xid", "gpu_fault", "gpu_ecc")


def faulted_gpus(findings: Sequence[Finding]) -> dict[int, str]:
    """GPU index -> what is wrong with it, for each GPU with a hardware fault among the findings
    (a critical XID, a GPU NVML reports lost or failing, uncorrected ECC errors)."""
    out: dict[int, str] = {}
    for f in findings:
        gpu = f.numbers.get("gpu")
        if f.kind in HARDWARE_KINDS and f.severity == "critical" and isinstance(gpu, int) and gpu >= 0:
            out.setdefault(gpu, f.message)
    return out


def _gpu_label(snap: Snapshot, index: int | None) -> str:
    """GPU N (its name), as findings name a GPU; "no one GPU" for None."""
    if index is None:
        return "no one GPU"
    g = snap.gpu(index)
    return f"GPU {index}" + (f" ({g.name})" if g is not None and g.name else "")


def fault_precedence(snap: Snapshot, findings: list[Finding]) -> list[Finding]:
    """A GPU hardware fault comes before the worker on it: a dead, hung, stuck or out-of-memory
    worker on a faulted GPU gets the drain advice (a restart onto the GPU fails again), with the
    GPU's index and name in its numbers."""
    faulted = faulted_gpus(findings)
    if not faulted:
        return findings
    on_gpu = {w.name: w.gpu_index for w in snap.workers}
    out = []
    for f in findings:
        gpu = on_gpu.get(f.subject)
        if f.kind == "likely_oom":
            gpu = f.numbers.get("gpu")
        if f.kind not in HARDWARE_KINDS and isinstance(gpu, int) and gpu in faulted:
            g = snap.gpu(gpu)
            name = g.name if g is not None else None
            f = dataclasses.replace(
                f,
                advice=f"{_gpu_label(snap, gpu)} has a hardware fault ({faulted[gpu]}): {DRAIN}",
                numbers={**f.numbers, "gpu": gpu, "gpu_name": name, "gpu_fault": faulted[gpu]},
            )
        out.append(f)
    return out


def gpu_health(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    out = []
    for g in snap.gpus:
        who = f" ({', '.join(g.workers)})" if g.workers else ""
        named = f" [{g.name}]" if g.name else ""
        if g.faults:
            out.append(
                Finding(
                    severity="critical",
                    kind="gpu_fault",
                    subject=f"GPU {g.index}",
                    message=f"GPU {g.index}{named}{who}: NVML reports {', '.join(g.faults)}",
                    advice=DRAIN,
                    numbers={"gpu": g.index, "name": g.name, "faults": list(g.faults)},
                )
            )
        if g.ecc_uncorrected:
            out.append(
                Finding(
                    severity="critical",
                    kind="gpu_ecc",
                    subject=f"GPU {g.index}",
                    message=f"GPU {g.index}{named}{who}: {g.ecc_uncorrected} uncorrected ECC errors since the driver loaded",
                    advice=f"results computed on it may be wrong: {DRAIN}",
                    numbers={"gpu": g.index, "name": g.name, "ecc_uncorrected": g.ecc_uncorrected},
                )
            )
        slow = [r for r in (g.throttle or ()) if r in SLOWDOWNS]
        if slow:
            out.append(
                Finding(
                    severity="warning",
                    kind="gpu_throttle",
                    subject=f"GPU {g.index}",
                    message=(
                        f"GPU {g.index}{who} is slowed down: {', '.join(slow)} (SM clock "
                        f"{'n/a' if g.sm_clock_mhz is None else f'{g.sm_clock_mhz:.0f} MHz'}, "
                        f"{'n/a' if g.temp_c is None else f'{g.temp_c:.0f} C'})"
                    ),
                    advice="check cooling and power delivery (nvidia-smi -q -d PERFORMANCE,TEMPERATURE)",
                    numbers={
                        "gpu": g.index,
                        "reasons": slow,
                        "sm_clock_mhz": g.sm_clock_mhz,
                        "temp_c": g.temp_c,
                    },
                )
            )
    return out


def nvml_state(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    on_gpu = any((w.device or "").startswith("cuda") for w in snap.workers)
    stuck = "; ".join(
        f"{call} on {_gpu_label(snap, gpu)} for {fmt_duration(s)}" for gpu, call, s in snap.nvml_stuck
    )
    if snap.nvml == "not answering":
        return [
            Finding(
                severity="warning",
                kind="nvml",
                subject="nvml",
                message=(
                    f"NVML on {snap.host} is not answering"
                    + (f" (not returned: {stuck})" if stuck else "")
                    + ": a GPU may be failing; GPU readings are n/a"
                ),
                advice="look for XID lines in `dmesg` and run `nvidia-smi`; if it hangs too, the GPU needs a reset",
                numbers={"stuck": [{"gpu": g, "call": c, "for_s": t} for g, c, t in snap.nvml_stuck]},
            )
        ]
    hung = [
        Finding(
            severity="warning",
            kind="nvml_hung",
            subject=f"GPU {gpu}",
            message=(
                f"NVML's {call} on {_gpu_label(snap, gpu)} has not returned for "
                f"{fmt_duration(stuck_s)}: its readings are n/a until it does; the other GPUs are read as usual"
            ),
            advice=(
                f"a GPU whose NVML calls hang is failing: look for its XID lines in `dmesg`, run "
                f"`nvidia-smi -i {gpu}`; if that hangs too, drain GPU {gpu} and reset it"
            ),
            numbers={"gpu": gpu, "call": call, "stuck_s": stuck_s},
        )
        for gpu, call, stuck_s in snap.nvml_stuck
        if gpu is not None
    ]
    if hung:
        return hung
    if snap.nvml.startswith("unavailable") and on_gpu:
        return [
            Finding(
                severity="info",
                kind="nvml",
                subject="nvml",
                message=f"NVML {snap.nvml} on {snap.host}: no GPU readings, workers are judged by heartbeats only",
                advice="install nvidia-ml-py where the sampler runs, or run it where the driver is visible",
                numbers={},
            )
        ]
    return []
