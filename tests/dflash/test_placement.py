"""Placement and memory rules (dflash.plan.placement), checked before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.config import load_config
from dflash.plan.placement import GIB, fit_problems, placement_problems, worst

REPO = Path(__file__).resolve().parents[2]
CFG = load_config(str(REPO / "configs" / "qwen3-8b.toml"), ["target.path=tiny", "data.path=demo"])
TOTAL = 140 * GIB
RECORD = {
    "drafter": {"12x512": {"peak_reserved": 60 * GIB}, "12x4096": {"peak_reserved": 70 * GIB}},
    "target": {"12x4096": {"peak_reserved": 30 * GIB}},
}


def _keys(problems) -> list[str]:
    return [p.key for p in problems]


def test_two_drafter_ranks_on_one_gpu_are_refused_naming_the_key() -> None:
    problems = placement_problems(CFG, ["cuda:0"] * 2, ["cuda:0"] * 3, device_count=1)
    assert _keys(problems) == ["pipeline.drafter_devices"]
    assert "NCCL refuses" in problems[0].problem and "cuda:0" in problems[0].problem
    assert placement_problems(CFG, ["cpu"], ["cpu", "cpu"], device_count=None) == []  # gloo on CPU: fine


def test_a_device_the_host_does_not_have_is_refused() -> None:
    problems = placement_problems(CFG, ["cuda:0", "cuda:9"], ["cuda:1"], device_count=2)
    assert _keys(problems) == ["pipeline.target_devices"] and "cuda:9" in problems[0].problem


def test_a_shared_gpu_must_hold_target_and_drafter() -> None:
    fits = placement_problems(CFG, ["cuda:0"], ["cuda:0"], device_count=1, totals={0: TOTAL}, record=RECORD)
    assert fits == []  # 70 + 30 GiB of 140 less 4
    two_targets = placement_problems(
        CFG, ["cuda:0", "cuda:0", "cuda:0"], ["cuda:0"], device_count=1, totals={0: TOTAL}, record=RECORD
    )
    assert _keys(two_targets) == ["pipeline.drafter_devices"]
    text = two_targets[0].problem
    assert "12x4096" in text and "70.0 GiB" in text and "pipeline.target_devices" in text


def test_the_worst_shape_must_fit_the_device_less_the_headroom() -> None:
    assert worst(RECORD, "drafter") == ("12x4096", 70 * GIB)
    assert fit_problems(RECORD, TOTAL, 4.0, where="cuda:0") == []
    (problem,) = fit_problems(RECORD, 72 * GIB, 4.0, where="cuda:3")
    assert "12x4096" in problem and "run.memory_headroom_gb" in problem and "block_token_budget" in problem
    assert (
        fit_problems(None, TOTAL, 4.0, where="cpu") == [] and fit_problems(RECORD, None, 4, where="cpu") == []
    )


@pytest.mark.parametrize("bad", [{"drafter": "x"}, {"drafter": {"a": {"peak_reserved": "big"}}}, []])
def test_a_malformed_record_checks_nothing_rather_than_crash(bad) -> None:
    assert fit_problems(bad, TOTAL, 4.0, where="cuda:0") == []


def _job(module: str, tmp_path: Path, *sets: str, env: dict[str, str] | None = None):
    import os
    import subprocess
    import sys

    args = [sys.executable, "-m", module, str(REPO / "configs" / "demo-cpu.toml")]
    args += ["--run-dir", str(tmp_path / "run"), "--set", f"run.runs_root={tmp_path}"]
    for s in ("run.device=cuda", "attention.backend=flex", *sets):
        args += ["--set", s]
    return subprocess.run(
        args, capture_output=True, text=True, cwd=REPO, timeout=300, env={**os.environ, **(env or {})}
    )


@pytest.mark.gpu
def test_the_job_refuses_a_restored_artifact_whose_shape_does_not_fit_this_gpu(tmp_path: Path) -> None:
    """The record a restore leaves (artifact.json) says the drafter's shape needs more than this GPU
    has: dflash.train stops before loading any model, naming the shape."""
    import json

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    record = {"drafter": {"8x256": {"peak_allocated": 2**50, "peak_reserved": 2**50}}, "target": {}}
    (cache / "artifact.json").write_text(json.dumps({"key": "k" * 64, "memory": record}))
    done = _job("dflash.train", tmp_path, env={"DFLASH_CACHE_DIR": str(cache)})
    assert done.returncode == 2, done.stderr[-3000:]
    assert "8x256" in done.stderr and "run.memory_headroom_gb" in done.stderr, done.stderr[-3000:]


@pytest.mark.gpu
def test_launch_refuses_two_drafter_ranks_on_one_gpu_before_any_worker(tmp_path: Path) -> None:
    done = _job(
        "dflash.launch",
        tmp_path,
        "pipeline.drafters=2",
        'pipeline.target_devices=["cuda:0"]',
        'pipeline.drafter_devices=["cuda:0", "cuda:0"]',
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "pipeline.drafter_devices" in done.stderr and "NCCL refuses" in done.stderr
    logs = tmp_path / "run" / "logs"
    assert not list(logs.glob("target-*.log")) and not list(logs.glob("drafter-*.log")), "a worker started"
    events = tmp_path / "run" / "events.jsonl"
    assert not events.exists() or "launched" not in events.read_text()
