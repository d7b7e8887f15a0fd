"""tau in the job (issue 47): the pipeline's supervisor measures the acceptance length after each
checkpoint with `python -m dflash.eval` on held-out prompts, on the CPU with the real demo-size job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from jobs import PIPELINE_SETS, start_job

from dflash.rundir import RunDir


def test_a_demo_size_run_records_tau_after_each_checkpoint(repo, tmp_path):
    run_dir = tmp_path / "run"
    sets = [*PIPELINE_SETS, "--set", "train.total_steps=20", "--set", "train.checkpoint_every=10"]
    sets += ["--set", "train.tau_budget=1"]  # every checkpoint (the default paces them to 2%)
    sets += [
        "--set",
        "train.tau_eval=true",
        "--set",
        "train.tau_prompt_count=4",
        "--set",
        "train.tau_max_new=16",
    ]
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, *sets)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    run = RunDir(run_dir)
    assert run.read_events("stopped")[-1]["reason"] == "completed"
    taus = run.read_events("tau")
    # After step 10 and after the final checkpoint (step 20), which the supervisor waits for.
    assert [t["step"] for t in taus] == [10, 20], (taus, run.read_events("tau_failed"))
    for t in taus:
        assert 1.0 <= t["tau"] <= 16 and t["prompts"] == 4 and t["prompts_from"] == "demo"
        assert t["rounds"] == sum(t["histogram"].values()) and len(t["acceptance_per_position"]) == 15
        assert t["drafter"].endswith(f"step-{t['step']}") and t["seconds"] > 0
    assert not run.read_events("tau_failed")
    # What the job recorded, `python -m dflash.eval CHECKPOINT` gives again: a run's checkpoint is
    # measured with the run's tau settings by default (one thread, as the job's measurement runs).
    again = subprocess.run(
        [sys.executable, "-m", "dflash.eval", taus[-1]["drafter"], "--json", "--device", "cpu"],
        cwd=repo, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    r = json.loads(again.stdout)
    assert (r["tau"], r["histogram"], r["prompts"], r["max_new"]) == (
        taus[-1]["tau"], taus[-1]["histogram"], 4, 16
    )  # fmt: skip


def test_a_real_datasets_tau_is_measured_on_records_held_out_of_it(repo, tmp_path):
    lines = [f'{{"text": "The red fox sees the blue owl near the river, {i} times."}}\n' for i in range(200)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(lines))
    run_dir = tmp_path / "run"
    sets = [*PIPELINE_SETS, "--set", "train.total_steps=4", "--set", f"data.path={corpus}"]
    sets += ["--set", "train.tau_eval=true", "--set", "data.min_seq_len=4", "--set", "train.tau_max_new=8"]
    proc = start_job("dflash.launch", repo, tmp_path, run_dir, *sets)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    run = RunDir(run_dir)
    assert not run.read_events("tau_skipped") and run.read_events("stopped")[-1]["reason"] == "completed"
    (tau,) = run.read_events("tau")  # the final checkpoint's
    held = Path(tau["prompts_from"])
    assert held.name == "prompts.jsonl" and tau["prompts"] == 16
    assert sorted(held.read_text().splitlines(keepends=True) + (held.parent / "train.jsonl").read_text().splitlines(
        keepends=True)) == sorted(lines)  # fmt: skip
    # The job trained on the 184 records left, and the held-out ones are none of them.
    summary = run.read_events("launched")[0]["data"]
    assert summary["records"] == 184, summary
