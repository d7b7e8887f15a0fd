"""`python -m dflash.eval` as a user runs it: on a real trained run directory, one of its
checkpoints and its export (which needs --target), and one clear line for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from jobs import start_job

from dflash.data.demo import make_tiny_target


def _eval(repo, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflash.eval", *args, "--limit", "3", "--max-new", "12"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def trained(repo, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    run_dir = root / "run"
    proc = start_job(
        "dflash.train",
        repo,
        root,
        run_dir,
        "--set",
        "train.total_steps=4",
        "--set",
        "train.checkpoint_every=4",
        "--set",
        "attention.compile=false",
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    export = root / "export"
    subprocess.run(
        [sys.executable, "-m", "dflash.export", str(run_dir), str(export)], cwd=repo, check=True, timeout=300
    )
    return root, run_dir, export


def _one_error(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_a_run_directory_and_its_checkpoint_measure_tau(repo, trained) -> None:
    _, run_dir, _ = trained
    proc = _eval(repo, str(run_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["kind"] == "run" and r["drafter"].endswith("checkpoints/step-4") and r["prompts_from"] == "demo"
    assert r["prompts"] == 3 and 1.0 <= r["tau"] <= 16 and r["rounds"] == sum(r["histogram"].values())
    assert 3 <= r["tokens"] <= 3 * 12  # an eos may end a prompt early
    assert len(r["acceptance_per_position"]) == 15 and r["tokens_per_s"] > 0 and r["speedup"] > 0
    human = _eval(repo, str(run_dir / "checkpoints" / "step-4"))
    assert human.returncode == 0, human.stderr
    assert "tau " in human.stdout and "(checkpoint)" in human.stdout and "3/3 prompts" in human.stderr
    plain = _eval(repo, str(run_dir), "--json", "--plain")
    assert json.loads(plain.stdout.splitlines()[-1])["tau"] == r["tau"]


def test_an_export_needs_its_target(repo, trained) -> None:
    root, _, export = trained
    _one_error(_eval(repo, str(export)), "exported drafter", "--target")
    target = root / ".tiny-target-l8-h64-s0"
    proc = _eval(repo, str(export), "--target", str(target), "--prompts", "demo", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    assert r["kind"] == "export" and r["target"] == str(target) and 1.0 <= r["tau"] <= 16
    _one_error(_eval(repo, str(export), "--target", str(target)), "--prompts")


def test_bad_inputs_get_one_line(repo, trained, tmp_path) -> None:
    _, run_dir, export = trained
    _one_error(_eval(repo, str(tmp_path / "nowhere")), "does not exist")
    _one_error(_eval(repo, str(tmp_path)), "neither a run directory")
    other = make_tiny_target(tmp_path / "other", layers=4, hidden=32, seed=1)
    _one_error(
        _eval(repo, str(export), "--target", str(other), "--prompts", "demo"), "was not trained on the target"
    )
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    _one_error(_eval(repo, str(run_dir), "--prompts", str(bad)), "prompts.jsonl:2", "not JSON")
    _one_error(_eval(repo, str(run_dir), "--prompts", str(tmp_path / "missing.jsonl")), "no such file")
