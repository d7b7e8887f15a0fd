"""The dashboard reads without color and off a tty; --once --json carries the same content."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import re

from rich.console import Console
from test_watch_fakes import healthy_sample, metric

from runner.watch.dashboard import bar, render_dashboard, snapshot_json, sparkline
from runner.watch.detectors import detect
from runner.watch.snapshot import History
from runner.watch.watcher import Watcher

T0 = 1_800_000_000.0


def render(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, no_color=True, width=120).print(renderable)
    return out.getvalue()


def test_bars_and_sparklines_are_characters() -> None:
    assert bar(0.5) == "█████░░░░░" and bar(None) == "··········" and bar(1.7) == "█" * 10
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([]) == "" and sparkline([5, 5]) == "▅▅"


def test_healthy_dashboard_rows_pipeline_and_sparkline() -> None:
    s = healthy_sample(T0)
    s["metrics"] = [metric(T0 - 600 + 60 * i, tok_s=18000.0 + 300 * i) for i in range(10)]
    s["workers"]["target-1"]["host_pid"] = 41001  # in a container: nvidia-smi shows the host pid
    history = History(baseline_tok_s=20500)
    snap = history.ingest(s)
    findings = detect(history.snapshots)
    text = render(render_dashboard(snap, findings))
    assert "GPUs on gpu-host (NVML ok)" in text
    row0 = next(line for line in text.splitlines() if "target-0 pid 1000" in line)
    assert "58.6/95.6 GiB" in row0 and "97%" in row0 and "60 C 400 W" in row0 and "power cap" in row0
    assert "computing" in row0 and "0 s, step 500" in row0
    assert "host pid 41001" in text
    assert "q_pre [50, 50] of 50   q_hs [3] of 8" in text
    assert "20.7K tok/s ▁▂▃▃▄▅▆▆▇█" in text and "baseline 20.5K tok/s" in text
    assert "ETA 8.0 d" in text and "healthy: no findings" in text
    assert "\x1b[" not in text, "no escape codes off a tty"


def test_cpu_workers_dead_and_frozen_are_words() -> None:
    s = healthy_sample(T0)
    s["gpus"] = []
    for w in s["workers"].values():
        w.update(gpu_index=None, device="cpu")
    s["workers"]["drafter-0"].update(alive=False, proc_state="gone")
    s["workers"]["drafter-1"].update(age_s=30.0, proc_state="stopped")
    history = History()
    snap = history.ingest(s)
    text = render(render_dashboard(snap, detect(history.snapshots)))
    assert "workers without a GPU reading" in text and "GPUs on" not in text
    assert "DEAD" in text and "FROZEN (stopped)" in text
    assert "CRITICAL drafter-0 is dead" in text and "CRITICAL drafter-1 is frozen" in text


def test_before_the_first_sample_and_json() -> None:
    watcher = Watcher(None)
    snap, findings = watcher.refresh(timeout=0)
    text = render(render_dashboard(snap, findings))
    assert "no metrics record yet" in text and "waiting for the first sample" in text
    assert "healthy" not in text, "before its first sample watch knows nothing: never healthy"
    s = healthy_sample(T0)
    history = History()
    snap = history.ingest(copy.deepcopy(s))
    doc = snapshot_json(snap, detect(history.snapshots))
    again = json.loads(json.dumps(doc))
    assert again["exit_code"] == 0 and again["findings"] == []
    assert again["gpus"][2]["workers"] == ["drafter-0"] and again["pipeline"]["q_hs"] == [3]
    assert {w["name"] for w in again["workers"]} == {"target-0", "target-1", "drafter-0", "drafter-1"}


def test_the_last_restart_and_its_slowest_phases_on_the_dashboard_and_in_json() -> None:
    s = healthy_sample(T0)
    s["metrics"] = [metric(T0 - 60, tok_s=18000.0)]
    phases = [("death_detection", 0.5, T0 - 30), ("imports", 2.5, T0 - 29.5), ("first_step", 6.0, T0 - 27)]
    s["events"] = [
        {"event": "restart", "role": "drafter-group", "generation": 1},
        {
            "t": T0 - 21,
            "event": "generation_start",
            "role": "drafter-group",
            "generation": 1,
            "restart": True,
            "origin": "death",
            "origin_at": T0 - 30,
            "total_s": 9.0,
            "phases": [{"phase": n, "seconds": sec, "start": at} for n, sec, at in phases],
            "rolled_back_steps": 1,
            "resumed_from_kind": "checkpoint",
        },
    ]
    history = History()
    snap = history.ingest(s)
    text = render(render_dashboard(snap, detect(history.snapshots)))
    assert (
        "last restart (gen 1): 9.0 s from death to first step, 1 step rolled back (from checkpoint); "
        "slowest: first_step 6.0 s, imports 2.5 s" in " ".join(text.replace("│", " ").split())
    ), text
    doc = json.loads(json.dumps(snapshot_json(snap, detect(history.snapshots))))
    last = doc["last_restart"]
    assert last["generation"] == 1 and last["slowest_phase"] == "first_step" and last["total_s"] == 9.0
    assert [(p["phase"], p["offset_s"]) for p in last["phases"]] == [
        ("death_detection", 0.0),
        ("imports", 0.5),
        ("first_step", 3.0),
    ]


def test_the_header_keeps_its_counts_whole_at_80_columns() -> None:
    s = healthy_sample(T0)
    history = History()
    snap = history.ingest(s)
    snap = dataclasses.replace(snap, run_dir="/data/runs/qwen3-8b-drafter-20261207-115642-long-name")
    out = io.StringIO()
    Console(file=out, no_color=True, width=80).print(render_dashboard(snap, detect(history.snapshots)))
    first, second = out.getvalue().splitlines()[:2]
    assert first.startswith("/data/runs/qwen3-8b-drafter-20261207-115642-long-name on ")
    assert re.match(r"\d+ critical, \d+ warning, \d+ info   sample .* old \(.+\)$", second), second
