"""Every detector fires on its fault and stays quiet on a healthy run (sampler lines built directly)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from test_watch_fakes import healthy_sample, metric

from runner.errors import RunnerError
from runner.watch.detectors import Finding, Thresholds, detect, exit_code
from runner.watch.snapshot import History

T0 = 1_800_000_000.0


def run(
    *samples: dict[str, Any], baseline: float | None = None, th: Thresholds | None = None
) -> list[Finding]:
    history = History(baseline_tok_s=baseline)
    for s in samples:
        history.ingest(s)
    return detect(history.snapshots, th)


def kinds(findings: list[Finding]) -> list[tuple[str, str, str]]:
    return [(f.severity, f.kind, f.subject) for f in findings]


def sample(t: float = T0, **kw: Any) -> dict[str, Any]:
    s = healthy_sample(t)
    s.update(kw)
    return s


def with_worker(s: dict[str, Any], name: str, **fields: Any) -> dict[str, Any]:
    s = copy.deepcopy(s)
    s["workers"][name].update(fields)
    return s


def with_gpu(s: dict[str, Any], index: int, **fields: Any) -> dict[str, Any]:
    s = copy.deepcopy(s)
    s["gpus"][index].update(fields)
    return s


def seconds_of(base: dict[str, Any], n: int, **gpu_fields: Any) -> list[dict[str, Any]]:
    """n one-second samples ending at base's time, with base's readings (and GPU changes)."""
    out = []
    for i in range(n):
        s = copy.deepcopy(base)
        s["t"] = base["t"] - (n - 1 - i)
        if i:
            s.pop("manifest", None)
            s["metrics"] = []
        out.append(s)
    return out


def test_healthy_run_has_no_findings() -> None:
    findings = run(*seconds_of(sample(), 15), baseline=20500)
    assert findings == [] and exit_code(findings) == 0


# ---- workers -------------------------------------------------------------------------------------


def test_dead_worker() -> None:
    f = run(with_worker(sample(), "drafter-1", alive=False, proc_state="gone", age_s=3.0))
    assert ("critical", "dead_worker", "drafter-1") in kinds(f)
    assert "drafter-1 on GPU 3 is dead" in f[0].message and "drafter group" in f[0].advice


def test_dead_worker_by_stale_heartbeat_when_the_pid_cannot_be_checked() -> None:
    f = run(with_worker(sample(), "drafter-1", alive="n/a", age_s=30.0))
    assert ("critical", "dead_worker", "drafter-1") in kinds(f)


def test_stopped_worker_is_not_dead() -> None:
    assert run(with_worker(sample(), "drafter-1", alive=False, state="stopped")) == []


def test_frozen_worker_heartbeat_stale_but_process_there() -> None:
    f = run(with_worker(sample(), "drafter-0", age_s=25.0, proc_state="stopped"))
    assert kinds(f) == [("critical", "hung_worker", "drafter-0")]
    assert "frozen" in f[0].message and "SIGSTOP" in f[0].message


def _stuck(s: dict[str, Any], **fields: Any) -> list[dict[str, Any]]:
    s = with_worker(s, "drafter-1", **{"progress_age_s": 45.0, **fields})
    return seconds_of(with_gpu(s, 3, util_gpu=1), 12)


def test_hung_worker_no_progress_while_input_waits_and_gpu_idle() -> None:
    f = run(*_stuck(sample()))
    assert ("critical", "hung_worker", "drafter-1") in kinds(f)
    hung = next(x for x in f if x.kind == "hung_worker")
    assert "no progress for 45 s" in hung.message and "q_hs=[3]" in hung.message and "1%" in hung.message


@pytest.mark.parametrize("state", ["compiling", "checkpointing", "starting"])
def test_hung_worker_quiet_while_compiling_or_checkpointing(state: str) -> None:
    assert "hung_worker" not in [f.kind for f in run(*_stuck(sample(), state=state))]


def test_hung_worker_quiet_when_nothing_waits_or_gpu_busy() -> None:
    empty = sample()
    empty["metrics"] = [metric(T0 - 1, q_hs=[0])]
    assert "hung_worker" not in [f.kind for f in run(*_stuck(empty))]
    busy = with_worker(sample(), "drafter-1", progress_age_s=45.0)
    assert "hung_worker" not in [f.kind for f in run(*seconds_of(busy, 12))]


def test_hung_single_process_job() -> None:
    s = sample(events=[{"event": "started", "mode": "single-process"}])
    s["gpus"] = s["gpus"][:1]
    s["workers"] = {
        "target-0": s["workers"]["target-0"],
        "drafter-0": dict(s["workers"]["target-0"], role="drafter", index=0, progress_age_s=45.0),
    }
    s = with_gpu(s, 0, util_gpu=0)
    f = run(*seconds_of(s, 12))
    assert ("critical", "hung_worker", "drafter-0") in kinds(f)
    assert "its data is local" in next(x.message for x in f if x.subject == "drafter-0")


def test_hung_worker_on_cpu_judged_by_cpu_use() -> None:
    s = sample()
    s["gpus"] = []
    s = with_worker(s, "drafter-1", gpu_index=None, device="cpu", progress_age_s=45.0, cpu_percent=0.5)
    assert ("critical", "hung_worker", "drafter-1") in kinds(run(s))
    assert run(with_worker(s, "drafter-1", cpu_percent=180.0)) == []


def _full_idle(s: dict[str, Any], **worker: Any) -> list[dict[str, Any]]:
    s = with_gpu(s, 2, mem_used_mb=97000.0, util_gpu=0)
    return seconds_of(with_worker(s, "drafter-0", **{"progress_age_s": 600.0, **worker}), 12)


def test_likely_oom_memory_full_idle_no_progress() -> None:
    f = run(*_full_idle(sample()))
    assert ("critical", "likely_oom", "GPU 2") in kinds(f)
    oom = next(x for x in f if x.kind == "likely_oom")
    assert "drafter-0" in oom.message and "99%" in oom.message and "0% utilization" in oom.message
    assert "hung_worker" not in [x.kind for x in f], "one finding per stuck worker"


def test_likely_oom_not_fooled_by_the_first_compile() -> None:
    assert "likely_oom" not in [f.kind for f in run(*_full_idle(sample(), state="compiling"))]
    assert "likely_oom" not in [f.kind for f in run(*_full_idle(sample(), uptime_s=120.0))]  # warm-up
    progressing = _full_idle(sample(), progress_age_s=2.0)
    assert "likely_oom" not in [f.kind for f in run(*progressing)]


# ---- pipeline ------------------------------------------------------------------------------------


def _queues(s: dict[str, Any], q_pre: list[int], q_hs: list[int]) -> dict[str, Any]:
    s = copy.deepcopy(s)
    s["metrics"] = [metric(s["t"] - 1, q_pre=q_pre, q_hs=q_hs, tgt_bps=0.1, dft_bps=0.1, tok_s=4000.0)]
    return s


def test_starved_pipeline_drafters_are_the_bottleneck() -> None:
    s = _queues(sample(), [50, 46], [0])
    for i, u in ((0, 4), (1, 6), (2, 0), (3, 2)):
        s = with_gpu(s, i, util_gpu=u)
    f = run(s)
    starved = next(x for x in f if x.kind == "drafters_bottleneck")
    assert starved.severity == "critical"
    assert "drafters are the bottleneck" in starved.message and "q_pre=[50, 46] of 50" in starved.message
    assert "q_hs=[0] of 8" in starved.message and "GPU 2 (drafter-0, 0%)" in starved.message
    assert starved.numbers["idle_drafter_gpus"] == [2, 3]


def test_a_frozen_drafter_is_not_called_stepping() -> None:
    """A drafter whose heartbeat went stale (SIGSTOP: the demo's fault) before its progress age
    reaches hung_s: hung_worker already calls it frozen, so the bottleneck is critical, not "every
    drafter is stepping" (the demo of 2026-12-03 showed both at once)."""
    s = _queues(sample(), [50, 46], [0])
    for i, u in ((0, 4), (1, 6), (2, 97), (3, 99)):  # blocked targets, busy drafters
        s = with_gpu(s, i, util_gpu=u)
    slower = run(s)
    assert kinds(slower) == [("warning", "drafters_bottleneck", "pipeline")], "busy drafters: the slower half"
    assert "The target GPUs (0, 1) were idle 95% of the last 60 s" in slower[0].message, "idle targets warn"
    s = with_worker(s, "drafter-0", age_s=12.0, progress_age_s=12.0, proc_state="stopped")
    f = run(s)
    assert ("critical", "hung_worker", "drafter-0") in kinds(f)
    starved = next(x for x in f if x.kind == "drafters_bottleneck")
    assert starved.severity == "critical" and "every drafter is stepping" not in starved.message


def test_a_stopped_job_s_last_queue_readings_are_no_bottleneck() -> None:
    """After the job stops its last metrics still read q_pre full and q_hs empty (the targets are done,
    the drafters gone): no finding. Relaunched, the same readings are the bottleneck again."""
    s = _queues(sample(), [50, 46], [0])
    for i, u in ((0, 4), (1, 6), (2, 0), (3, 2)):
        s = with_gpu(s, i, util_gpu=u)
    s["events"] = [{"event": "launched"}, {"event": "stopped", "reason": "completed"}]
    assert "drafters_bottleneck" not in [f.kind for f in run(s)]
    s["events"].append({"event": "launched"})
    assert "drafters_bottleneck" in [f.kind for f in run(s)]


def test_a_target_gpu_between_two_batches_is_still_busy() -> None:
    s = _queues(sample(), [50, 50], [0])
    earlier = seconds_of(s, 10)
    now = copy.deepcopy(earlier[-1])
    now["t"] += 1
    for i in range(4):
        now = with_gpu(now, i, util_gpu=3)  # one low reading
    assert "drafters_bottleneck" not in [f.kind for f in run(*earlier, now)]


def test_targets_busy_with_drafters_waiting_is_the_targets_bottleneck() -> None:
    s = _queues(sample(), [50, 50], [0])
    s = with_worker(with_worker(s, "drafter-0", state="waiting_input"), "drafter-1", state="waiting_input")
    f = run(s)
    assert kinds(f) == [("info", "targets_bottleneck", "pipeline")]
    assert "targets are the bottleneck" in f[0].message


def test_slow_targets_leaving_drafter_gpus_idle_a_third_of_the_time_warn_and_reach_events() -> None:
    """The field's other case: the target half is the slow one and the drafter GPUs idle a third of
    the time. That is a warning with the share and the advice, and the acting watch writes it."""
    from runner.watch.actions import Actor, Policy

    samples = []
    for k in range(
        30
    ):  # a minute of samples, the drafter GPUs at 60-72%, 66% on average (idle a third of it)
        s = _queues(sample(T0 - 58 + 2 * k), [50, 50], [0])
        s = with_worker(
            with_worker(s, "drafter-0", state="waiting_input"), "drafter-1", state="waiting_input"
        )
        s = with_gpu(with_gpu(s, 2, util_gpu=60.0 + (k % 2) * 12), 3, util_gpu=66.0)
        samples.append(s)
    f = run(*samples)
    assert kinds(f) == [("warning", "targets_bottleneck", "pipeline")]
    assert "The drafter GPUs (2, 3) were idle 34% of the last 60 s" in f[0].message
    assert f[0].numbers["idle_gpus"] == [2, 3] and abs(f[0].numbers["idle_share"] - 0.34) < 1e-9
    assert "pipeline.targets" in f[0].advice and exit_code(f) == 1
    logged: list[tuple[str, dict[str, Any]]] = []
    actor = Actor(Policy(restart=False), signal_host=lambda *a: None, relaunch=None,
                  log_event=lambda event, **fields: logged.append((event, fields)))  # fmt: skip
    history = History()
    for x in samples:
        history.ingest(x)
    actor.report(history.snapshots[-1], f)
    assert [(e, x["kind"], x["severity"]) for e, x in logged] == [
        ("finding", "targets_bottleneck", "warning")
    ]
    # Busy drafters (idle 9%): the same bottleneck stays info, and is not written.
    quiet = _queues(sample(), [50, 50], [0])
    quiet = with_worker(
        with_worker(quiet, "drafter-0", state="waiting_input"), "drafter-1", state="waiting_input"
    )
    assert kinds(run(quiet)) == [("info", "targets_bottleneck", "pipeline")]
    # Without GPU readings there is no share to judge: info.
    blind = dict(quiet, gpus=[])
    assert ("info", "targets_bottleneck", "pipeline") in kinds(run(blind))


def test_every_busy_or_waiting_state_has_a_limit() -> None:
    """A drafter "compiling" 20 minutes with a full GPU at 2% was "healthy": the state excused it."""
    stuck = with_gpu(sample(), 2, util_gpu=2.0, mem_used_mb=140_000.0)
    stuck = with_worker(stuck, "drafter-0", state="compiling", state_age_s=1200.0, progress_age_s=1200.0)
    f = [x for x in run(stuck) if x.severity != "info"]  # (GPU 3, the one busy drafter GPU: info)
    assert kinds(f) == [("critical", "stuck_worker", "drafter-0")]
    assert "compiling for 20 min, past its limit of 15 min (compile_limit_s" in f[0].message
    assert "its GPU is at 2%" in f[0].message and exit_code(f) == 2
    # The run's own compiles set the limit where it has them: 4x its longest (40 s), at least 120 s.
    history = dict(
        stuck, events=[{"t": T0 - 900, "event": "compiled", "worker": "drafter-0", "seconds": 40.0}]
    )
    quick = with_worker(history, "drafter-0", state="compiling", state_age_s=200.0, progress_age_s=200.0)
    f = [x for x in run(quick) if x.severity != "info"]
    assert kinds(f) == [("critical", "stuck_worker", "drafter-0")]
    assert (
        "past its limit of 160 s (4x this run's longest compile so far (40 s, 1 compile(s)))" in f[0].message
    )
    within = run(with_worker(quick, "drafter-0", state_age_s=100.0))
    assert [x for x in within if x.severity != "info"] == [], "within the run's own limit"
    # The other busy states are critical past their limits; waiting on a queue is a warning.
    for state, age, severity in (("checkpointing", 700.0, "critical"), ("starting", 1000.0, "critical"),
                                 ("waiting_input", 700.0, "warning"), ("waiting_output", 700.0, "warning")):  # fmt: skip
        s = with_worker(sample(), "drafter-1", state=state, state_age_s=age)
        got = [x for x in run(s) if x.kind == "stuck_worker"]
        assert [(x.severity, x.subject) for x in got] == [(severity, "drafter-1")], (state, got)
        assert run(with_worker(sample(), "drafter-1", state=state, state_age_s=age / 2 - 60)) == [], state
    # A healthy run, and a job whose heartbeats predate state_since, stay quiet.
    assert run(sample()) == []
    assert run(with_worker(sample(), "drafter-0", state="compiling", state_age_s=None)) == []


def test_hidden_states_piling_up_means_slower_drafters() -> None:
    s = _queues(sample(), [50, 50], [8])
    s = with_worker(with_worker(s, "target-0", state="waiting_output"), "target-1", state="waiting_output")
    assert kinds(run(s)) == [("info", "drafters_slower", "pipeline")]


def test_empty_prefetch_queues_with_waiting_targets_is_the_data() -> None:
    s = _queues(sample(), [0, 1], [3])
    s = with_worker(s, "target-0", state="waiting_input")
    assert kinds(run(s)) == [("info", "data_bottleneck", "pipeline")]


def test_pipeline_detectors_quiet_for_a_single_process_job() -> None:
    s = _queues(sample(), [0], [0])
    s["events"] = [{"event": "started", "mode": "single-process"}]
    assert run(s) == []


def test_the_one_busy_gpu_is_named_with_its_worker() -> None:
    s = with_gpu(with_gpu(sample(), 0, util_gpu=100), 1, util_gpu=3)
    f = [x for x in run(s) if x.kind == "busy_gpu"]
    assert len(f) == 1 and f[0].subject == "GPU 0" and "target-0 pid 1000 at 100%" in f[0].message


def _records(tok_s: list[float], eta_s: list[float] | None = None) -> dict[str, Any]:
    s = sample()
    s["metrics"] = [
        metric(T0 - 10 * (len(tok_s) - i), tok_s=v, eta_s=(eta_s or [8 * 86400.0] * len(tok_s))[i])
        for i, v in enumerate(tok_s)
    ]
    return s


def test_throughput_below_the_baseline_of_this_fingerprint() -> None:
    f = run(_records([4600.0] * 5), baseline=20800)
    slow = next(x for x in f if x.kind == "slow_kernels")
    assert slow.severity == "warning" and "4.6K tok/s is 22% of the baseline 20.8K tok/s" in slow.message
    assert run(_records([19800.0] * 5), baseline=20800) == []
    assert run(_records([4600.0] * 5)) == [], "no baseline stored: nothing to compare with"


def test_throughput_not_judged_during_warm_up() -> None:
    s = _records([4600.0] * 5)
    for m in s["metrics"]:
        m["elapsed_s"] = 120.0
    assert run(s, baseline=20800) == []


def _slowdown(f: list[Finding]) -> Finding | None:
    return next((x for x in f if x.kind == "eta_blowup"), None)


def test_a_sudden_slowdown_is_seen_within_three_records() -> None:
    day = 86400.0
    tok = [20000.0] * 8 + [4600.0] * 3
    f = run(_records(tok, [8 * day] * 8 + [34.8 * day] * 3))
    assert kinds(f) == [("warning", "eta_blowup", "run")]
    msg = f[0].message
    assert "fell to 4.6K tok/s from this run's steady 20.0K tok/s (23%)" in msg, msg
    assert "ETA 34.8 d is 4.3x the 8.0 d the steady rate gives" in msg, msg
    n = f[0].numbers
    assert n["slide_start_t"] == T0 - 30 and n["now_t"] == T0 - 10 and n["span_s"] == 20
    assert run(_records(tok[:-1])) == [], "two slow records are not yet a slowdown"
    assert run(_records([20000.0] * 8 + [4600.0, 20000.0, 4600.0])) == [], "one fast record among them: no"


def test_a_slow_steady_slide_is_measured_from_where_it_began() -> None:
    # 3% slower every record: a median of recent records follows it down and never sees it.
    tok = [20000.0] * 6 + [20000.0 * 0.97**i for i in range(1, 40)]
    recs = _records(tok)
    t_of = [m["t"] for m in recs["metrics"]]
    f = _slowdown(run(recs))
    assert f is not None, "a slide to 30% of the steady rate went unnoticed"
    # The slide left the steady band (90%) after 18.3K tok/s, the 4th slower record.
    assert f.numbers["slide_start_t"] == t_of[6 + 3] and f.numbers["steady_tok_s"] == 20000.0
    assert f.numbers["span_s"] == t_of[-1] - t_of[6 + 3]
    # Halfway down (0.97^22 = 51%) it is not yet twice as slow; one record later it is.
    assert _slowdown(run(_records(tok[: 6 + 22]))) is None
    assert _slowdown(run(_records(tok[: 6 + 25]))) is not None


def test_the_steady_reference_outlives_the_record_window() -> None:
    tok = [20000.0] * 6 + [20000.0 * 0.97**i for i in range(1, 40)]
    history = History(max_metrics=10)  # the steady records scroll out long before the end
    for i, m in enumerate(_records(tok)["metrics"]):
        s = sample(t=m["t"] + 1)
        s["metrics"] = [m]
        if i:
            s.pop("manifest", None)
        history.ingest(s)
    f = _slowdown(detect(history.snapshots))
    assert f is not None and f.numbers["steady_tok_s"] == 20000.0


def test_healthy_noise_a_dip_and_a_smaller_group_are_no_slowdown() -> None:
    noisy = [20000.0 * (1 + 0.15 * ((i * 7) % 5 - 2) / 2) for i in range(40)]
    assert _slowdown(run(_records(noisy))) is None
    assert _slowdown(run(_records([20000.0] * 10 + [6000.0] + [20000.0] * 5))) is None
    s = _records([20000.0] * 8 + [9000.0] * 4)
    for m in s["metrics"]:
        m["world_size"] = 2 if m["tok_s"] > 10000 else 1  # a drafter lost: the group of one is its own
    assert _slowdown(run(s)) is None
    warm = _records([20000.0] * 8 + [4600.0] * 3)
    for m in warm["metrics"][-3:]:
        m["elapsed_s"] = 60.0  # a new generation compiling: its first records are not judged
    assert _slowdown(run(warm)) is None


def test_metrics_stale_while_the_job_runs() -> None:
    s = sample()
    s["metrics"] = [metric(T0 - 120)]
    assert kinds(run(s)) == [("warning", "metrics_stale", "run")]
    compiling = with_worker(s, "drafter-0", state="compiling")
    assert "metrics_stale" not in [f.kind for f in run(compiling)]
    s["job"] = {"lock_pid": 1, "lock_held": False}
    assert "metrics_stale" not in [f.kind for f in run(s)]


def test_metrics_stale_follows_the_run_s_own_step_time() -> None:
    # Steps of 45 s with a 10 s status interval: one record a step, 45 s apart. 2 minutes
    # without one is a step and a half, not twelve intervals.
    s = sample()
    s["metrics"] = [metric(T0 - 120 - 45 * (5 - i), dft_bps=1 / 45, step=500 + i) for i in range(6)]
    assert "metrics_stale" not in [f.kind for f in run(s)]
    s["metrics"] = [metric(T0 - 300 - 45 * (5 - i), dft_bps=1 / 45, step=500 + i) for i in range(6)]
    f = [x for x in run(s) if x.kind == "metrics_stale"]
    assert f and "every 45 s: status interval 10 s, steps of 45.0 s" in f[0].message, f
    # The same gaps without the step time still set the cadence (records of an older job version).
    s["metrics"] = [{k: v for k, v in m.items() if k != "dft_bps"} for m in s["metrics"]]
    s["metrics"][-1]["t"] = T0 - 120
    assert "metrics_stale" not in [f.kind for f in run(s)]


# ---- events --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unfused_flex", "recompile_limit", "force_compile_during_fx_trace"])
def test_degraded_kernel_events(kind: str) -> None:
    s = sample(
        events=[{"t": T0, "event": "degraded", "worker": "drafter-0", "kind": kind, "detail": "d"}] * 2
    )
    f = run(s)
    assert kinds(f) == [("warning", "degraded_kernels", "drafter-0")]


def test_cache_miss_and_cold_compile_where_an_artifact_was_restored() -> None:
    compiled = {"event": "compiled", "worker": "drafter-0", "seconds": 11.5, "hits": 0, "misses": 14}
    s = sample(events=[compiled, {"event": "cache_miss", "worker": "drafter-1", "fxgraph_misses": 3}])
    s["manifest"]["cache_artifact"] = "a" * 64
    assert sorted(kinds(run(s))) == [
        ("warning", "cache_miss", "drafter-1"),
        ("warning", "cold_compile", "drafter-0"),
    ]
    warm = dict(compiled, hits=14, misses=0)
    assert run(sample(events=[warm])) == []
    s = sample(events=[compiled])  # no artifact restored: a cold compile is expected
    assert run(s) == []


def test_restarts_counted_and_none_left() -> None:
    restart = {"event": "restart", "role": "drafter-group", "generation": 1}
    s = sample(events=[restart])
    s["manifest"]["config"]["pipeline"]["max_restarts"] = 3
    f = run(s)
    assert kinds(f) == [("info", "restarts", "drafter-group")] and "2 left" in f[0].message
    s["events"] = [dict(restart, generation=g) for g in (1, 2, 3)]
    assert kinds(run(s)) == [("warning", "restarts", "drafter-group")]


def test_job_stopped() -> None:
    stopped = sample(job={"lock_pid": 5, "lock_held": False})
    stopped["events"] = [{"event": "stopped", "reason": "target-0 died (exit code 1)"}]
    f = run(stopped)
    assert kinds(f) == [("warning", "job_stopped", "run")] and "target-0 died" in f[0].message
    stopped["events"] = [{"event": "stopped", "reason": "completed"}]
    assert kinds(run(stopped)) == [("info", "job_stopped", "run")]
    missing = sample(run_dir_exists=False)
    assert kinds(run(missing)) == [("critical", "run_dir_missing", "run")]


# ---- GPUs, NVML, the sampler ---------------------------------------------------------------------


def test_xid_events() -> None:
    s = sample(xid=[{"t": T0, "gpu": 2, "xid": 79}, {"t": T0, "gpu": 1, "xid": 13}])
    f = run(s)
    assert kinds(f) == [("critical", "gpu_xid", "GPU 2"), ("warning", "gpu_xid", "GPU 1")]
    assert "fallen off the bus" in f[0].message and "drafter-0" in f[0].message
    assert run(sample(xid=[{"t": T0 - 7200, "gpu": 2, "xid": 79}])) == [], "an old XID has aged out"


def test_throttling_ecc_and_lost_gpus() -> None:
    s = with_gpu(sample(), 1, throttle=["hw slowdown", "hw thermal"], sm_clock_mhz=600)
    f = run(s)
    assert kinds(f) == [("warning", "gpu_throttle", "GPU 1")] and "600 MHz" in f[0].message
    assert run(with_gpu(sample(), 1, throttle=["power cap", "idle"])) == []
    assert kinds(run(with_gpu(sample(), 1, ecc_uncorrected=2))) == [("critical", "gpu_ecc", "GPU 1")]
    lost = with_gpu(sample(), 1, faults={"nvmlDeviceGetMemoryInfo": "GPU is lost"})
    assert ("critical", "gpu_fault", "GPU 1") in kinds(run(lost))


def test_nvml_not_answering_and_unavailable() -> None:
    assert kinds(run(sample(nvml="not answering"))) == [("warning", "nvml", "nvml")]
    assert kinds(run(sample(nvml="unavailable: driver not loaded", gpus=[]))) == [("info", "nvml", "nvml")]


def test_silent_sampler() -> None:
    history = History()
    snap = history.ingest(sample())
    import dataclasses

    history.snapshots[-1] = dataclasses.replace(snap, sample_age_s=30.0, source="silent")
    f = detect(history.snapshots)
    assert kinds(f) == [("critical", "sampler", "sampler on gpu-host")], "blind watch is critical"
    assert "no sample from gpu-host for 30 s" in f[0].message


# ---- thresholds and exit codes -------------------------------------------------------------------


def test_exit_code_by_severity() -> None:
    def f(sev: Any) -> Finding:
        return Finding(severity=sev, kind="k", subject="s", message="m", advice="a")

    assert [exit_code([]), exit_code([f("info")]), exit_code([f("info"), f("warning")])] == [0, 0, 1]
    assert exit_code([f("warning"), f("critical")]) == 2


def test_thresholds_from_a_watch_table() -> None:
    th = Thresholds.from_table({"stale_s": 3, "hung_s": 5.5, "throughput_window": 10})
    assert (th.stale_s, th.hung_s, th.throughput_window) == (3.0, 5.5, 10)
    assert Thresholds.from_table(None) == Thresholds()
    with pytest.raises(RunnerError, match=r"\[watch\] stale: unknown threshold"):
        Thresholds.from_table({"stale": 3})
    with pytest.raises(RunnerError, match="must be an integer"):
        Thresholds.from_table({"throughput_window": 2.5})
    with pytest.raises(RunnerError, match="must be a number"):
        Thresholds.from_table({"stale_s": "3"})
    # A tighter threshold makes a quiet reading fire.
    s = with_worker(sample(), "drafter-0", age_s=4.0, proc_state="running")
    assert run(s) == [] and kinds(run(s, th=th)) == [("critical", "hung_worker", "drafter-0")]


def test_docs_list_every_threshold_with_its_default() -> None:
    """docs/watch.md's threshold table is the code's: every field of Thresholds, with its default."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "watch.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| ([0-9.]+) \|", doc, flags=re.M)
    assert {k: float(v) for k, v in rows} == {k: float(v) for k, v in Thresholds().to_table().items()}
    assert len(rows) == len(Thresholds().to_table()), "each threshold listed once"


def _generation_start(
    t: float, generation: int, phases: list[tuple[str, float]], **kw: Any
) -> dict[str, Any]:
    """A drafter group's `generation_start` as the job writes it (dflash/pipeline/timeline.py)."""
    at, out = t - sum(s for _, s in phases), []
    origin = at
    for name, s in phases:
        out.append({"phase": name, "start": at, "seconds": s})
        at += s
    return {
        "t": t,
        "event": "generation_start",
        "role": "drafter-group",
        "worker": "drafter-0",
        "generation": generation,
        "restart": generation > 0,
        "origin": "death" if generation else "launch",
        "origin_at": origin,
        "ready_at": at,
        "total_s": at - origin,
        "phases": out,
        **kw,
    }


def test_the_restart_finding_names_the_slowest_phase_and_its_seconds() -> None:
    restart = {"event": "restart", "role": "drafter-group", "generation": 1}
    timed = _generation_start(
        T0 - 5,
        1,
        [("death_detection", 0.4), ("imports", 2.6), ("model_build", 17.25), ("first_step", 5.7)],
        resumed_from=0,
        resumed_from_kind=None,
        died_at_step=6,
        rolled_back_steps=6,
    )
    s = sample(events=[restart, timed])
    s["manifest"]["config"]["pipeline"]["max_restarts"] = 3
    (f,) = run(s)
    assert f.kind == "restarts" and "it took 26.0 s from death to first step" in f.message, f.message
    assert "6 steps rolled back (from step 0)" in f.message
    assert "slowest: model_build 17.2 s, first_step 5.7 s" in f.message, f.message
    assert f.numbers["slowest_phase"] == "model_build" and f.numbers["slowest_phase_s"] == 17.25
    assert f.numbers["restart_s"] == pytest.approx(25.95) and f.numbers["rolled_back_steps"] == 6
    # A second restart whose generation has not trained yet: the finding says whose cost it quotes.
    s["events"] = [restart, timed, dict(restart, generation=2)]
    (f,) = run(s)
    assert "generation 1 took 26.0 s" in f.message and f.numbers["timed_generation"] == 1


@pytest.mark.parametrize(
    "junk",
    [
        {"phases": "fast"},
        {"phases": [None, {"phase": "x"}, {"phase": "y", "seconds": "3"}, {"seconds": 1.0}]},
        {"total_s": float("nan"), "origin_at": "yesterday", "graphs": [1, 2], "generation": "one"},
        {"rolled_back_steps": -4, "died_at_step": 2.5, "resumed_from_kind": 7},
    ],
)
def test_a_malformed_timeline_reads_as_unknown_never_an_error(junk: dict[str, Any]) -> None:
    restart = {"event": "restart", "role": "drafter-group", "generation": 1}
    timed = {**_generation_start(T0 - 5, 1, [("imports", 2.0)]), **junk}
    (f,) = run(sample(events=[restart, timed]))
    assert f.kind == "restarts" and "restarted 1 time(s)" in f.message


def test_docs_list_every_finding_the_code_makes() -> None:
    """docs/watch.md's finding table has a row for each kind a detector or watch itself makes, and no other."""
    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "watch.md").read_text()
    rows = set(re.findall(r"^\| `(\w+)` \| (?:info|warning|critical)", doc, flags=re.M))
    code: set[str] = set()
    for f in (root / "runner" / "watch").glob("*.py"):  # every Finding(kind="...", subject=...)
        code |= set(re.findall(r'kind="(\w+)",\s*subject=', f.read_text()))
    assert rows == code, (sorted(code - rows), sorted(rows - code))


def test_durations_read_as_people_say_them() -> None:
    from runner.watch.signals import fmt_duration

    assert [fmt_duration(s) for s in (None, 45, 119.6, 160, 180, 599.4, 600, 5400, 9000, 200_000)] == [
        "n/a", "45 s", "120 s", "2 min 40 s", "3 min", "9 min 59 s", "10 min", "90 min", "2.5 h", "2.3 d",
    ]  # fmt: skip
