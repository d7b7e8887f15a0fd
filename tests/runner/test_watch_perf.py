"""The cost of watching: at 1 Hz over 8 GPUs (fake NVML, a run's recorded metrics) one second's work,
sampler and watch side together, stays under 2% of one core (20 ms of CPU)."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

from rich.console import Console
from test_watch_fakes import append_jsonl, manifest, metric, write_heartbeat

from runner.watch.dashboard import render_dashboard
from runner.watch.fakenvml import FakeGPU, FakeNVML
from runner.watch.nvml import NVML
from runner.watch.sampler import SamplerState, dumps, sample_once
from runner.watch.watcher import Watcher

SECONDS = 30


def test_one_second_of_watching_8_gpus_costs_under_20_ms_of_cpu(tmp_path: Path) -> None:
    run = tmp_path / "run"
    now = time.time()
    for i in range(8):
        role, index = ("target", i) if i < 5 else ("drafter", i - 5)
        write_heartbeat(run, f"{role}-{index}", device=f"cuda:{i}", started_at=now - 60)
    (run / "run.json").write_text(json.dumps(manifest()))
    append_jsonl(
        run / "metrics.jsonl", *(metric(now - 3600 + 10 * i, q_pre=[50] * 5, q_hs=[3]) for i in range(360))
    )
    gpus = [FakeGPU(mem_used_mb=60000, util_gpu=95, procs=[[os.getpid(), 59000.0]]) for _ in range(8)]
    state = SamplerState(run, nvml=NVML(FakeNVML(gpus)))
    watcher = Watcher(None)
    console = Console(file=io.StringIO(), no_color=True, width=120)

    def one_second() -> None:
        append_jsonl(run / "metrics.jsonl", metric(time.time(), q_pre=[50] * 5, q_hs=[3]))
        watcher.feed(dumps(sample_once(state)))
        snap, findings = watcher.refresh()
        console.print(render_dashboard(snap, findings))

    one_second()  # the first line carries the backlog
    cpu0 = time.process_time()
    for _ in range(SECONDS):
        one_second()
    per_second_ms = (time.process_time() - cpu0) / SECONDS * 1000
    print(f"watch over 8 GPUs: {per_second_ms:.1f} ms of CPU per 1 Hz refresh")
    assert per_second_ms < 20, per_second_ms
