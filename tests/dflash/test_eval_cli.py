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


def test_no_baseline_measures_the_same_tau_without_the_target_alone(repo, trained) -> None:
    _, run_dir, _ = trained
    full = json.loads(_eval(repo, str(run_dir), "--json").stdout.splitlines()[-1])
    proc = _eval(repo, str(run_dir), "--json", "--no-baseline")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.splitlines()[-1])
    assert (r["tau"], r["histogram"], r["tokens"]) == (full["tau"], full["histogram"], full["tokens"])
    assert "speedup" in full and "speedup" not in r and "target_alone_tokens_per_s" not in r


def _free(monkeypatch, free_gib: float) -> None:
    """No GPU here: the device's free-memory answer stands in (the real call: the GPU test below)."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * 2**30), 80 * 2**30))


def test_a_gpu_without_room_for_the_pair_is_refused_before_loading(
    repo, trained, monkeypatch, capsys
) -> None:
    from dflash import eval as ev

    _, run_dir, _ = trained
    src = ev.open_source(run_dir, None)
    need = ev.pair_bytes(src)
    # The target's weight files, the drafter's, its bf16 embedding and head, and the decode's scratch.
    assert need > ev.EVAL_SCRATCH_BYTES + (src.drafter_dir / "model.safetensors").stat().st_size
    _free(monkeypatch, 4 + need / 2**30 + 0.01)
    ev.check_fits(src, "cuda:0", 4.0)  # fits with the headroom kept
    _free(monkeypatch, 4 + need / 2**30 - 0.01)
    code = ev.main([str(run_dir), "--device", "cuda:0", "--headroom-gb", "4", "--json", "--limit", "1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 3 and len(err) == 1, err
    assert err[0].startswith("error: the target and drafter need ") and "--headroom-gb 4 kept" in err[0]


@pytest.mark.gpu
def test_the_fit_check_reads_the_real_gpu(repo, trained) -> None:
    import torch

    from dflash import eval as ev
    from dflash.errors import DoesNotFit

    src = ev.open_source(trained[1], None)
    ev.check_fits(src, "cuda:0", 0.0)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    with pytest.raises(DoesNotFit, match="free of"):
        ev.check_fits(src, "cuda:0", total)
