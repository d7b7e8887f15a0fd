"""The field's incident (shared/FIELD.md), replayed through the whole watch path: a run directory
with the incident's status lines as metrics, heartbeats of 5 targets on GPUs 0-4 and 3 drafters on
5-7 running in a container (a synthetic /proc maps their pids), FakeNVML answering with the
incident's nvidia-smi readings, the sampler, the Watcher, the detectors and the dashboard.
It must say, in seconds, what took a person reading nvidia-smi beside the queues."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from test_watch_fakes import add_proc, append_jsonl, hold_lock, manifest, proc_root, write_heartbeat

from runner.watch.baseline import config_hash, update_from_healthy_run
from runner.watch.dashboard import render_dashboard, snapshot_json
from runner.watch.detectors import Finding, exit_code
from runner.watch.fakenvml import FakeGPU, FakeNVML
from runner.watch.nvml import NVML
from runner.watch.procinfo import ProcessProbe
from runner.watch.sampler import SamplerState, dumps, sample_once
from runner.watch.statusline import parse_status_line
from runner.watch.watcher import Watcher

LINE_23M = (
    "[23m] step=14 loss=10.6894 acc=0.011 streak=0.0 lr=7.53e-06 noise=0.0006 | tgt=0.11b/s dft=0.11b/s "
    "(4.6Ktok/s) | q_pre=[50, 46, 48, 46, 47] q_hs=[0] | epoch~0.01 ETA=36.9d"
)
LINE_14M = (
    "[14m] step=12 loss=--- acc=--- streak=--- lr=--- noise=0.0005 | tgt=0.11b/s dft=0.10b/s "
    "(4.2Ktok/s) | q_pre=[50, 47, 48, 50, 49] q_hs=[2] | epoch~0.01 ETA=37.5d"
)
SMI_14M = """\
0, 84853 MiB, 1 %
1, 71169 MiB, 6 %
2, 86869 MiB, 6 %
3, 88989 MiB, 100 %
4, 72149 MiB, 5 %
5, 59869 MiB, 2 %
6, 94847 MiB, 4 %
7, 46245 MiB, 0 %
"""
TOTAL_MIB = 97887.0  # RTX PRO 6000 Blackwell, "96 GB"
ARTIFACT = "c" * 64
HOST_PID = 42000  # NVML's (host) pid of the worker on GPU i is HOST_PID + i; inside the container, 10 + i


def smi(table: str) -> dict[int, tuple[float, float]]:
    rows = {}
    for line in table.strip().splitlines():
        idx, mem, util = (x.strip() for x in line.split(","))
        rows[int(idx)] = (float(mem.split()[0]), float(util.split()[0]))
    return rows


# At 23 minutes only the drafter GPUs were read (GPU 5: 96 GB at 0%, 6: 86 GB at 3%, 7: 31 GB at 1%);
# the target GPUs are not in the report, so the later table's target rows stand in for them.
READINGS_23M = {**smi(SMI_14M), 5: (96.0 * 1024 - 500, 0.0), 6: (86.0 * 1024, 3.0), 7: (31.0 * 1024, 1.0)}


def field_run(
    tmp: Path, line: str, readings: dict[int, tuple[float, float]], drafters: dict[int, dict[str, Any]]
):
    """The run directory, /proc and NVML of the incident's moment; `drafters` overrides per drafter
    (index -> heartbeat fields, or {"dead": True})."""
    now = time.time()
    started = now - parse_status_line(line)["elapsed_s"]
    run = tmp / "run"
    proc = proc_root(tmp, now - 86400)
    (run / "workers").mkdir(parents=True)
    m = manifest(cache_artifact=ARTIFACT)
    (run / "run.json").write_text(json.dumps(m))
    (run / "job.lock").write_text("10\n")
    hold_lock(proc, run / "job.lock", HOST_PID + 99)
    append_jsonl(run / "metrics.jsonl", {**parse_status_line(line), "t": now - 2})
    append_jsonl(
        run / "events.jsonl",
        {"t": started, "event": "started", "role": "drafter-group", "generation": 0, "world_size": 3},
        {
            "t": started + 60,
            "event": "degraded",
            "worker": "drafter-0",
            "kind": "force_compile_during_fx_trace",
        },
    )
    gpus = []
    for i in range(8):
        used, util = readings[i]
        role, index = ("target", i) if i < 5 else ("drafter", i - 5)
        over = drafters.get(index, {}) if role == "drafter" else {}
        fields = {"state": "waiting_output", "q_pre": 48} if role == "target" else {"state": "waiting_input"}
        fields.update({k: v for k, v in over.items() if k != "dead"})
        progress = fields.pop("progress_age_s", 5.0)
        write_heartbeat(
            run,
            f"{role}-{index}",
            pid=10 + i,
            host="container-1",
            device=f"cuda:{i}",
            started_at=started + 30,
            last_progress_at=now - progress,
            updated_at=now - 0.4,
            step=14,
            **fields,
        )
        add_proc(
            proc,
            HOST_PID + i,
            start=started + 25,
            nspid=(HOST_PID + i, 10 + i),
            state="Z" if over.get("dead") else "S",
        )
        gpus.append(
            FakeGPU(
                name="NVIDIA RTX PRO 6000 Blackwell",
                mem_total_mb=TOTAL_MIB,
                mem_used_mb=used,
                util_gpu=int(util),
                procs=[[HOST_PID + i, used - 400]],
            )
        )
    state = SamplerState(
        run, nvml=NVML(FakeNVML(gpus)), probe=ProcessProbe(proc, hostname="gpu-host"), host="gpu-host"
    )
    return run, state, m


def healthy_baseline(root: Path, m: dict[str, Any]) -> None:
    healthy = [
        {"elapsed_s": 600.0 + 10 * i, "tok_s": 20000.0 + 150 * (i % 10)} for i in range(60)
    ]  # 20-21.5K
    assert (
        update_from_healthy_run(root, ARTIFACT, config_hash(m["config"]), healthy, run_id="healthy")
        is not None
    )


def judge(tmp: Path, state: SamplerState) -> tuple[Any, list[Finding]]:
    line = dumps(sample_once(state))  # through JSON, as from a remote host
    watcher = Watcher([line], baseline_dir=tmp / "baselines")
    deadline = time.monotonic() + 5
    snap, findings = watcher.refresh(timeout=2.0)
    while snap.pipeline is None and time.monotonic() < deadline:
        snap, findings = watcher.refresh(timeout=0.5)
    return snap, findings


def by_kind(findings: list[Finding], kind: str) -> list[Finding]:
    return [f for f in findings if f.kind == kind]


def test_status_lines_parse() -> None:
    a, b = parse_status_line(LINE_23M), parse_status_line(LINE_14M)
    assert (a["elapsed_s"], a["step"], a["tok_s"], a["q_pre"], a["q_hs"]) == (
        1380,
        14,
        4600.0,
        [50, 46, 48, 46, 47],
        [0],
    )
    assert a["eta_s"] == 36.9 * 86400 and a["tgt_bps"] == 0.11 and a["lr"] == 7.53e-06
    assert b["loss"] is None and b["acc"] is None and b["dft_bps"] == 0.10 and b["q_hs"] == [2]


def test_field_23m_drafters_are_the_bottleneck_and_gpu5_is_likely_oom(tmp_path: Path) -> None:
    # drafter-0 (GPU 5, memory full) has made no progress for 10 minutes; the others still step, slowly.
    run, state, m = field_run(
        tmp_path, LINE_23M, READINGS_23M, {0: {"state": "computing", "progress_age_s": 600.0}}
    )
    healthy_baseline(tmp_path / "baselines", m)
    snap, findings = judge(tmp_path, state)

    # Which worker sits on which GPU, through the container's pids.
    assert [g.workers for g in snap.gpus] == [(f"target-{i}",) for i in range(5)] + [
        (f"drafter-{i}",) for i in range(3)
    ]
    assert snap.worker("drafter-0").host_pid == HOST_PID + 5 and snap.worker("drafter-0").gpu_match == "pid"

    starved = by_kind(findings, "drafters_bottleneck")
    assert len(starved) == 1 and starved[0].severity == "critical"
    msg = starved[0].message
    assert msg.startswith("drafters are the bottleneck")
    assert "q_pre=[50, 46, 48, 46, 47] of 50" in msg and "q_hs=[0] of 8" in msg
    assert "GPU 5 (drafter-0, 0%), GPU 6 (drafter-1, 3%), GPU 7 (drafter-2, 1%)" in msg
    assert starved[0].numbers["idle_drafter_gpus"] == [5, 6, 7]
    assert starved[0].numbers["q_pre"] == [50, 46, 48, 46, 47] and starved[0].numbers["q_hs"] == [0]

    oom = by_kind(findings, "likely_oom")
    assert [f.subject for f in oom] == ["GPU 5"] and "drafter-0" in oom[0].message
    assert "no progress for 10 min" in oom[0].message

    busy = by_kind(findings, "busy_gpu")
    assert [f.subject for f in busy] == ["GPU 3"] and "target-3" in busy[0].message

    slow = by_kind(findings, "slow_kernels")
    assert slow and "4.6K tok/s is 22% of the baseline 20.7K tok/s" in slow[0].message
    degraded = by_kind(findings, "degraded_kernels")
    assert degraded and "force_compile_during_fx_trace" in degraded[0].message
    assert exit_code(findings) == 2
    assert not by_kind(findings, "dead_worker") and not by_kind(findings, "targets_bottleneck")


def test_field_14m_dead_and_full_drafters_and_the_busy_target(tmp_path: Path) -> None:
    # Two of three drafters dead or dying: drafter-2 (GPU 7) is a zombie still holding 46 GB;
    # drafter-1 (GPU 6, memory full at 4%) stuck for 10 minutes.
    run, state, _ = field_run(
        tmp_path,
        LINE_14M,
        smi(SMI_14M),
        {1: {"state": "computing", "progress_age_s": 600.0}, 2: {"dead": True, "state": "computing"}},
    )
    snap, findings = judge(tmp_path, state)
    starved = by_kind(findings, "drafters_bottleneck")
    assert (
        starved
        and "q_pre=[50, 47, 48, 50, 49] of 50" in starved[0].message
        and "q_hs=[2] of 8" in starved[0].message
    )
    assert starved[0].numbers["idle_drafter_gpus"] == [5, 6, 7]
    assert [f.subject for f in by_kind(findings, "dead_worker")] == ["drafter-2"]
    assert [f.subject for f in by_kind(findings, "likely_oom")] == ["GPU 6"]
    busy = by_kind(findings, "busy_gpu")
    assert len(busy) == 1 and busy[0].subject == "GPU 3"
    assert (
        "target-3 pid 13 at 100% while target-0, target-1, target-2, target-4 are at 1-6%" in busy[0].message
    )
    assert snap.gpu(3).workers == ("target-3",)

    out = io.StringIO()
    Console(file=out, no_color=True, width=120).print(render_dashboard(snap, findings))
    text = out.getvalue()
    assert "drafters are the bottleneck" in text and "DEAD" in text
    assert "q_pre [50, 47, 48, 50, 49] of 50   q_hs [2] of 8" in text
    row3 = next(line for line in text.splitlines() if "target-3" in line)
    assert "100%" in row3 and "86.9/95.6 GiB" in row3
    doc = snapshot_json(snap, findings)
    assert doc["exit_code"] == 2 and json.loads(json.dumps(doc))["gpus"][3]["workers"] == ["target-3"]
