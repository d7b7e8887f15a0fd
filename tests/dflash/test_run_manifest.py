"""run.json when dflashctl creates the run directory first: the job fills in its fields around the
runner's stub and keeps the stub's own, and refuses a format it does not write."""

from __future__ import annotations

import json

from jobs import start_job

from dflash.rundir import RUN_FORMAT, RunDir

SHORT = [
    "--set",
    "train.total_steps=2",
    "--set",
    "attention.compile=false",
    "--set",
    "run.status_interval_s=0.5",
]
RUNNER = {"backend": "tmux", "host": "gpu-7", "session": "dflash-demo", "created_at": 1.5}


def _stub(run_dir, **fields) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({"format": RUN_FORMAT, "run_id": "chosen-id", **fields}))


def test_runner_stub_is_filled_in_and_kept(repo, tmp_path):
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "r1"
    _stub(run_dir, runner=RUNNER, labels={"team": "spec"})
    proc = start_job("dflash.train", repo, runs, run_dir, *SHORT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    manifest = RunDir(run_dir).read_manifest()
    assert manifest["format"] == RUN_FORMAT == 1
    assert manifest["run_id"] == "chosen-id", "the runner's id is kept"
    assert manifest["runner"] == RUNNER and manifest["labels"] == {"team": "spec"}
    assert manifest["config"]["train"]["total_steps"] == 2, "a stub without config is a new run"
    for key in ("started_at", "project_commit", "hosts", "image_digest", "lock_sha256", "cache_artifact"):
        assert key in manifest, key
    (command,) = manifest["command_lines"]
    assert command["argv"][0].endswith("train.py") and str(run_dir) in command["argv"]
    assert RunDir(run_dir).read_events("stopped")[-1]["reason"] == "completed"

    # Started again: run.json now has a config, so this is a resume that only appends its command.
    proc = start_job("dflash.train", repo, runs, run_dir, *SHORT)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    again = RunDir(run_dir).read_manifest()
    assert len(again["command_lines"]) == 2
    assert {k: v for k, v in again.items() if k != "command_lines"} == {
        k: v for k, v in manifest.items() if k != "command_lines"
    }


def test_a_newer_format_is_refused_before_anything_loads(repo, tmp_path):
    runs, run_dir = tmp_path / "runs", tmp_path / "runs" / "r2"
    _stub(run_dir, runner=RUNNER)
    (run_dir / "run.json").write_text(json.dumps({"format": RUN_FORMAT + 1, "runner": RUNNER}))
    proc = start_job("dflash.train", repo, runs, run_dir, *SHORT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and f"has format {RUN_FORMAT + 1}" in out, out
    assert json.loads((run_dir / "run.json").read_text()) == {"format": RUN_FORMAT + 1, "runner": RUNNER}
