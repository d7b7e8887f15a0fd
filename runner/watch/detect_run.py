"""Detectors over the run's events and the monitor's own state: degraded kernels, cold compiles,
restarts, a stopped job, a failed or silent sampler or source, a missing run directory, damaged run
files."""

from __future__ import annotations

from collections.abc import Sequence

from runner.rundir import clean_stop, layout
from runner.watch.findings import Finding, Severity
from runner.watch.signals import fmt_duration
from runner.watch.snapshot import Snapshot
from runner.watch.thresholds import Thresholds
from runner.watch.timeline import cost, last_restart

DEGRADED_WORDS = {
    "unfused_flex": "flex attention runs unfused (the slow fallback, not the compiled kernel)",
    "recompile_limit": "dynamo hit its recompile limit (8 per code object): later shapes run uncompiled",
    "force_compile_during_fx_trace": (
        "torch._dynamo.config.force_compile_during_fx_trace is on: the crash workaround that cost the "
        "field's run 80% of its throughput"
    ),
}


def degraded_events(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    seen: dict[tuple[str, str], dict] = {}
    for e in snap.events:
        if e.get("event") == "degraded":
            seen.setdefault((str(e.get("worker", "?")), str(e.get("kind", "?"))), dict(e))
    out = []
    for (worker, kind), e in sorted(seen.items()):
        words = DEGRADED_WORDS.get(kind, kind)
        detail = f" ({e['detail']})" if e.get("detail") else ""
        out.append(
            Finding(
                severity="warning",
                kind="degraded_kernels",
                subject=worker,
                message=f"{worker}: degraded kernels: {words}{detail}",
                advice=(
                    "restore the compile cache artifact for this fingerprint (dflashctl cache restore) instead "
                    "of a workaround; with attention.strict_kernels the job stops rather than run slow"
                ),
                numbers={"kind": kind, "t": e.get("t")},
            )
        )
    return out


def cold_compiles(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """`cache_miss` events, and compiles with misses and no hits where run.json names a restored artifact."""
    snap = history[-1]
    artifact = snap.manifest.get("cache_artifact")
    out: dict[tuple[str, str], Finding] = {}
    for e in snap.events:
        worker = str(e.get("worker", "?"))
        if e.get("event") == "cache_miss" and ("cache_miss", worker) not in out:
            out[("cache_miss", worker)] = Finding(
                severity="warning",
                kind="cache_miss",
                subject=worker,
                message=(
                    f"{worker}: a warm compile cache was expected but inductor compiled cold "
                    f"({e.get('fxgraph_misses', '?')} FX graph misses)"
                ),
                advice="restore the artifact for this fingerprint (dflashctl cache restore) or warm one (dflashctl warm-cache)",
                numbers={"fxgraph_misses": e.get("fxgraph_misses"), "cache_dir": e.get("cache_dir")},
            )
        misses, hits = e.get("misses"), e.get("hits")
        if (
            artifact
            and e.get("event") == "compiled"
            and isinstance(misses, int)
            and misses > 0
            and hits == 0
            and ("cold_compile", worker) not in out
        ):
            out[("cold_compile", worker)] = Finding(
                severity="warning",
                kind="cold_compile",
                subject=worker,
                message=(
                    f"{worker} compiled cold ({misses} misses, 0 hits, {e.get('seconds', '?')} s) although "
                    f"artifact {str(artifact)[:16]} was restored: the cache does not fit this environment or config"
                ),
                advice="compare the artifact's fingerprint with this host's (dflashctl cache show / doctor)",
                numbers={"misses": misses, "hits": hits, "artifact": artifact, "seconds": e.get("seconds")},
            )
    return list(out.values())


def restarts(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    group = [e for e in snap.events if e.get("event") == "restart" and e.get("role") == "drafter-group"]
    targets = [e for e in snap.events if e.get("event") == "restart" and e.get("role") == "target"]
    out = []
    if group:
        allowed = snap.config("pipeline", "max_restarts", default=None)
        left = None if allowed is None else max(0, int(allowed) - len(group))
        if left == 0:
            rest = "; no restarts left: the next drafter death stops the job"
        else:
            rest = "" if left is None else f"; {left} left"
        generation = group[-1].get("generation")
        # The newest restart may not have trained its first step yet: then the cost is an earlier one's.
        tl = last_restart(snap.events)
        slow = tl.slowest()[0] if tl is not None and tl.phases else None
        if tl is None:
            took = ""
        elif tl.generation == generation:
            took = f"; it took {cost(tl)}"
        else:
            took = f"; generation {tl.generation} took {cost(tl)}"
        out.append(
            Finding(
                severity="warning" if left == 0 else "info",
                kind="restarts",
                subject="drafter-group",
                message=f"the drafter group restarted {len(group)} time(s) (generation {generation}){took}{rest}",
                advice=f"the drafter findings and {layout.group_log(0)} say why they died",
                numbers={
                    "restarts": len(group),
                    "left": left,
                    "timed_generation": None if tl is None else tl.generation,
                    "restart_s": None if tl is None else tl.total_s,
                    "slowest_phase": None if slow is None else slow.name,
                    "slowest_phase_s": None if slow is None else slow.seconds,
                    "rolled_back_steps": None if tl is None else tl.rolled_back_steps,
                },
            )
        )
    for e in targets:
        out.append(
            Finding(
                severity="info",
                kind="restarts",
                subject=str(e.get("worker", "target")),
                message=f"{e.get('worker', 'a target')} was restarted (pid {e.get('pid')})",
                advice=f"read {layout.log(str(e.get('worker', 'target-0')))} for why it died",
                numbers={"pid": e.get("pid")},
            )
        )
    return out


def job_state(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    snap = history[-1]
    if not snap.run_dir_exists:
        return [
            Finding(
                severity="critical",
                kind="run_dir_missing",
                subject="run",
                message=f"the run directory {snap.run_dir} does not exist on {snap.host}",
                advice="check the run's host and path (dflashctl ps)",
                numbers={},
            )
        ]
    if snap.job.get("lock_held") is not False:
        return []  # running, or cannot tell
    stops = [e for e in snap.events if e.get("event") == "stopped"]
    stop = stops[-1] if stops else {}
    reason = str(stop.get("reason", ""))
    drafter_code = stop.get("drafter_exit_code")
    died_in_stop = clean_stop(reason) and reason != "completed" and drafter_code not in (0, None)
    # A stop that was asked for (a signal) and ended cleanly is news, not a problem.
    severity: Severity = "info" if clean_stop(reason) and not died_in_stop else "warning"
    advice = "start it again with the same --run-dir: it resumes from its newest checkpoint"
    if reason == "completed":
        message, advice = "the job completed", ""
    elif died_in_stop:
        message = (
            f"the job stopped ({reason}), but the drafter group exited with code {drafter_code}: a drafter "
            "died while it stopped, so its final checkpoint may be missing"
        )
        advice = f"read {layout.DRAFTER_LOGS}; " + advice + " (the newest complete one)"
    elif clean_stop(reason):
        done = [e for e in snap.events if e.get("event") == "drafters_done" and e.get("stopped_by_signal")]
        step = done[-1].get("step") if done else None
        at = f", the drafters' final step {step} checkpointed" if isinstance(step, int) and step > 0 else ""
        message = f"the job was stopped on request ({reason}){at}"
    else:
        message = (
            f"the job stopped: {reason}" if reason else "the job is not running: no process holds job.lock"
        )
    return [
        Finding(
            severity=severity,
            kind="job_stopped",
            subject="run",
            message=message,
            advice=advice,
            numbers={"reason": reason or None, "drafter_exit_code": drafter_code},
        )
    ]


SAMPLER_ADVICE = (
    "a live watch starts the sampler again every {every}; if it keeps failing, check the host and the "
    "connection (`ssh HOST python3 -V`) and the sampler's last words in the message"
)


def sampler_state(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """watch is never blind in silence: a sampler that failed, exited or went quiet is critical, named
    by host, with what it said last; the first seconds before any sample are only `info`."""
    snap = history[-1]
    host = snap.host or "the host"
    said = f" (its last output: {snap.sampler_noise[:300]})" if snap.sampler_noise else ""
    age = fmt_duration(snap.sample_age_s)
    if snap.source == "failed":
        message = (
            f"the sampler on {host} exited before its first sample{said}: watch sees nothing of this run"
        )
    elif snap.source == "ended":
        message = (
            f"the sampler on {host} exited {age} ago{said}: watch is blind; the readings below are its last"
        )
    elif snap.source == "silent" and snap.gpus == () and not snap.workers and not snap.manifest:
        message = f"no sample from {host} in {age}{said}: watch sees nothing of this run"
    elif snap.source == "silent" or snap.sample_age_s > th.sampler_silent_s:
        message = f"no sample from {host} for {age}{said}: watch is blind; the readings below are old"
    elif snap.source == "starting":
        return [
            Finding(
                severity="info",
                kind="sampler",
                subject=f"sampler on {host}",
                message=f"waiting for the first sample from {host} ({age} so far)",
                advice="nothing yet: the sampler starts (over ssh this takes a connection)",
                numbers={"sample_age_s": snap.sample_age_s},
            )
        ]
    else:
        return []
    if snap.sampler_restarts:
        message += f"; started again {snap.sampler_restarts} time(s)"
    return [
        Finding(
            severity="critical",
            kind="sampler",
            subject=f"sampler on {host}",
            message=message,
            advice=SAMPLER_ADVICE.format(every=fmt_duration(th.sampler_silent_s)),
            numbers={"sample_age_s": snap.sample_age_s, "restarts": snap.sampler_restarts},
        )
    ]


def source_failed(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """A source the sampler could not read this line (it went on without it): what it holds is not judged."""
    snap = history[-1]
    host = snap.host or "the host"
    return [
        Finding(
            severity="critical",
            kind="source_failed",
            subject=f"{source} on {host}",
            message=f"the sampler on {host} could not read {source}: {error}; the findings below are "
            "judged without it",
            advice="what it holds (GPUs, workers, records) is not seen by watch: fix the file or device "
            "named; the sampler tries again every line",
            numbers={},
        )
        for source, error in snap.source_errors
    ]


def damaged_files(history: Sequence[Snapshot], th: Thresholds) -> list[Finding]:
    """What the sampler's readers skipped: a damaged run.json or heartbeat, records of the wrong
    shape in metrics.jsonl or events.jsonl. The rest is judged without them, so say so."""
    snap = history[-1]
    if not snap.damage:
        return []
    return [
        Finding(
            severity="warning",
            kind="damaged_files",
            subject="run",
            message=f"{len(snap.damage)} damaged file(s) in the run directory, judged without them: "
            + "; ".join(snap.damage),
            advice="the findings above do not see what those files held; the job rewrites a heartbeat or "
            "run.json, so a damage that stays is a writer other than the job, or a full or failing disk",
            numbers={"files": len(snap.damage)},
        )
    ]
