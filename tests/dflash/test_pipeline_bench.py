"""bench/pipeline.py: the bound it judges the end-to-end job against, the gap profile, and (one real
tiny run on the CPU) every phase timed on the same batches the job draws."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from pipeline import gap_profile, pipeline_bound  # noqa: E402


def test_bound_is_serial_when_target_and_drafter_share_a_gpu_and_min_when_they_do_not():
    t, d = 43_400.0, 33_300.0
    bound, kind = pipeline_bound(["cuda:0"], ["cuda:0"], t, d)
    assert kind == "serial" and bound == pytest.approx(t * d / (t + d))  # 18.8K: both on one GPU, in turn
    bound, kind = pipeline_bound(["cuda:0"], ["cuda:1"], t, d)
    assert kind == "min" and bound == pytest.approx(d)
    # The field's layout: 5 target GPUs feed 3 drafter GPUs; the slower side's GPUs together bound it.
    bound, kind = pipeline_bound([f"cuda:{i}" for i in range(5)], [f"cuda:{i}" for i in range(5, 8)], t, d)
    assert kind == "min" and bound == pytest.approx(min(5 * t, 3 * d))
    # Two GPUs, each with one target and one drafter rank: twice one shared GPU.
    bound, kind = pipeline_bound(["cuda:0", "cuda:1"], ["cuda:0", "cuda:1"], t, d)
    assert kind == "serial" and bound == pytest.approx(2 * t * d / (t + d))
    # A lopsided share: the GPU with the target and a drafter rank is the busiest.
    bound, _ = pipeline_bound(["cuda:0"], ["cuda:0", "cuda:1"], t, d)
    assert bound == pytest.approx(1 / (1 / t + 0.5 / d))


def beat(role: str, t: float, step: int, retries: int = 0, **state_s: float) -> dict:
    return {"role": role, "updated_at": t, "step": step, "alloc_retries": retries, "state_s": state_s}


def test_gap_profile_names_queue_waits_memory_pressure_and_interleaving():
    before = {
        "target-0": beat("target", 100.0, 10, computing=50.0, waiting_output=5.0),
        "drafter-0": beat("drafter", 100.0, 10, computing=40.0, waiting_input=15.0),
    }
    after = {  # 20 s later: the drafter waited 5 s (25%), the target 20 batches of 0.75 s busy each
        "target-0": beat("target", 120.0, 30, computing=65.0, waiting_output=10.0),
        "drafter-0": beat("drafter", 120.0, 30, retries=4, computing=55.0, waiting_input=20.0),
    }
    p = gap_profile(before, after, {"target": 500.0, "drafter": 740.0}, e2e=9_000.0, bound=18_000.0)
    assert p["efficiency"] == pytest.approx(0.5)
    d, t = p["workers"]["drafter-0"], p["workers"]["target-0"]
    assert d["share"] == {"computing": 0.75, "waiting_input": 0.25} and d["work"] == 20
    assert t["busy_ms_per_work"] == 750.0 and t["stretch"] == pytest.approx(1.5)
    assert d["stretch"] == pytest.approx(750 / 740, abs=1e-3) and d["alloc_retries"] == 4
    causes = p["causes"]
    assert causes[0].startswith("memory pressure: drafter-0 had 4 allocator retries")
    assert any(c.startswith("kernels interleaving: target-0's work took 1.50x") for c in causes)
    assert "drafter-0" not in next(c for c in causes if c.startswith("kernels"))  # 1.01x is no stretch
    waits = [c for c in causes if c.startswith("queue waits")]
    assert waits == [
        "queue waits: drafter-0 waiting_input 25% of the window (the target side is short)",
        "queue waits: target-0 waiting_output 25% of the window (the drafter side is short)",
    ]
    quiet = gap_profile(
        {"drafter-0": beat("drafter", 0.0, 0, computing=0.0)},
        {"drafter-0": beat("drafter", 10.0, 10, computing=10.0)},
        {"drafter": 1000.0},
        e2e=1.0,
        bound=1.0,
    )
    assert quiet["causes"] == []


def test_every_phase_runs_the_jobs_own_batches_and_the_job_is_judged_against_the_serial_bound(tmp_path):
    """The tiny CPU run, two buckets: the phases' shapes and real tokens are the same batches, rates
    count real tokens, target and drafter share the CPU so the bound is the serial one, and the
    end-to-end job's heartbeats give a gap profile of both workers."""
    out = tmp_path / "pipeline.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "pipeline.py"), "--tiny", "--buckets", "2", "--e2e-seconds", "30",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=400, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    phases = [r[k] for k in ("baseline", "target_only", "drafter_only")]
    assert len({json.dumps(p["shapes"], sort_keys=True) for p in phases}) == 1
    assert set(r["batch"]["shapes"]) == {"4x128", "4x256"} and r["batch"]["real_fraction"] < 1
    for p in phases:
        assert p["real_tokens"] == phases[0]["real_tokens"] < p["padded_tokens"]
        assert p["tok_s"] == pytest.approx(p["real_tokens"] / (p["step_ms"] * p["batches"] / 1000))
    s = r["summary"]
    t, d = s["target_only_tok_s"], s["drafter_only_tok_s"]
    assert s["bound"] == "serial" and s["bound_tok_s"] == pytest.approx(t * d / (t + d))
    assert s["efficiency"] == pytest.approx(s["e2e_tok_s"] / s["bound_tok_s"])
    workers = r["e2e"]["gap_profile"]["workers"]
    assert set(workers) == {"target-0", "drafter-0"}
    for w in workers.values():
        assert w["work"] > 0 and sum(w["share"].values()) == pytest.approx(1.0, abs=0.05)
    assert "bound (serial: target and drafter share a GPU)" in proc.stdout
