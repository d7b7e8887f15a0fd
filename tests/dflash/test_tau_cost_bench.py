"""bench/tau_cost.py: its arithmetic on constructed records, and one real tiny run of the job with
the in-job tau on the CPU, whose report gives the slowdown while an eval ran and the shipped cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from tau_cost import intervals, split_rates  # noqa: E402  (bench/)


def test_steps_during_an_eval_are_told_from_the_rest() -> None:
    # One record a second; 2 steps/s, but 1 step/s while the eval ran (t 10..20), and a checkpoint
    # write at t 5 whose interval is left out.
    records, step = [], 0
    for t in range(31):
        records.append({"t": float(t), "step": step})
        step += 1 if 10 <= t < 20 else 2
    spans = intervals(records)
    assert spans[0] == (2.0, 3.0, 2)  # the first two records (compile, warm-up) are not counted
    rates = split_rates(spans, evals=[(10.0, 20.0)], writes=[(4.5, 5.5)])
    assert rates["steps_per_s_during_eval"] == 1.0 and rates["steps_per_s_outside"] == 2.0
    assert rates["slowdown"] == 0.5 and rates["seconds_during_eval"] == 10.0
    assert rates["seconds_outside"] == 30 - 2 - 10 - 2  # less the eval and the write's two intervals


def test_a_tiny_run_reports_the_cost_of_its_tau(tmp_path: Path) -> None:
    out = tmp_path / "tau_cost.json"
    proc = subprocess.run(
        [sys.executable, "bench/tau_cost.py", "--tiny", "--work", str(tmp_path / "work"), "--measurements", "1",
         "--after", "4", "--set", "train.tau_prompt_count=4", "--set", "train.tau_max_new=16", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["bench"] == "tau_cost" and len(r["taus"]) == 1 and r["taus"][0]["device"] == "cpu"
    assert r["steps_per_s_outside"] > 0 and r["steps_per_s_during_eval"] is not None
    assert 0 <= r["shipped"]["eval_share"] <= r["shipped"]["tau_budget"] == 0.02
    assert "training loses" in proc.stdout
