"""`python -m dflash.check`: every error of a config in one call, by key, without loading weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash import check
from dflash.config import load_config
from dflash.errors import ConfigError
from dflash.pipeline.transport import HiddenStateQueue, segment_bytes
from dflash.plan.placement import slot_bytes

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo-cpu.toml")


def _check(capsys, *argv: str) -> tuple[int, dict]:
    """dflash.check's main in this process (the CLI is run once for real, below): rc, JSON report."""
    rc = check.main([*argv, "--json"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    return rc, json.loads(last)


def _keys(report: dict) -> list[str]:
    return sorted(e["key"] for e in report["errors"])


def _sets(*sets: str) -> list[str]:
    return [arg for s in sets for arg in ("--set", s)]


def _anywhere(tmp_path: Path) -> list[str]:
    """Overrides that make any shipped config pass on any machine: the demo target and corpus, and
    the CPU (the GPU configs name up to 8 GPUs; test_gpu_config_on_this_host keeps them)."""
    return _sets(
        f"run.runs_root={tmp_path / 'runs'}",
        "target.path=tiny",
        "data.path=demo",
        "run.device=cpu",
        "attention.backend=sdpa",
        "pipeline.target_devices=[]",
        "pipeline.drafter_devices=[]",
    )


def test_demo_config_is_ok_through_the_real_cli(repo, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dflash.check", "configs/demo-cpu.toml", "--json"]
        + ["--set", f"run.runs_root={tmp_path / 'runs'}"],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, out
    assert report["ok"] and report["errors"] == [] and report["entry"] == "dflash.launch"
    assert report["config"]["train"]["total_steps"] == 600
    assert report["config"]["run"]["runs_root"] == str(tmp_path / "runs")
    assert report["shm_bytes"] > 0
    assert not (tmp_path / "runs").exists(), "the check creates nothing (no tiny target, no corpus)"


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs").glob("*.toml")))
def test_every_shipped_config_is_ok(tmp_path, capsys, name):
    rc, report = _check(capsys, str(REPO / "configs" / name), *_anywhere(tmp_path))
    assert rc == 0 and report["ok"], report["errors"]
    assert report["config"]["run"]["name"] == name.removesuffix(".toml")


@pytest.mark.gpu
def test_gpu_config_on_this_host(tmp_path, capsys):
    """qwen3-8b co-locates its one target and one drafter on cuda:0: fine on any GPU host."""
    sets = _sets(f"run.runs_root={tmp_path}", "target.path=tiny", "data.path=demo")
    rc, report = _check(capsys, str(REPO / "configs" / "qwen3-8b.toml"), *sets)
    assert rc == 0, report["errors"]
    sets += _sets("pipeline.drafters=2", "pipeline.drafter_devices=['cuda:0', 'cuda:0']")
    rc, report = _check(capsys, str(REPO / "configs" / "qwen3-8b.toml"), *sets)
    assert rc == 2 and "NCCL refuses" in report["errors"][0]["message"], report["errors"]


def test_all_errors_of_all_sections_in_one_call(tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text(
        "[run]\nstatus_interval_s = 0\ndevcie = 'cpu'\n"  # a bad value and a misspelt key
        "[target]\npath = 'tiny'\ndtype = 'int8'\n"
        "[data]\npath = 'demo'\nmax_seq_len = 'long'\n"  # a type error
        "[train]\nlr = -1\nwarmup_steps = -3\nkeep_last = 0\n"  # three in one section
        "[pipeline]\nqueue_depth = 0\n"
        "[extra]\n"
    )
    rc, report = _check(capsys, str(config), "--set", "drafter.num_layers=0", "--set", "no-equals-sign")
    assert rc == 2 and not report["ok"]
    assert _keys(report) == [
        "data.max_seq_len",
        "drafter.num_layers",
        "extra",
        "no-equals-sign",
        "pipeline.queue_depth",
        "run.devcie",
        "run.status_interval_s",
        "target.dtype",
        "train.keep_last",
        "train.lr",
        "train.warmup_steps",
    ]
    messages = {e["key"]: e["message"] for e in report["errors"]}
    assert "status_interval_s" in messages["run.devcie"], "an unknown key lists the known ones"
    assert "'long'" in messages["data.max_seq_len"]
    assert report["config"] is None, "a config with errors is not reported as resolved"
    with pytest.raises(ConfigError):
        load_config(config)  # the job itself still stops at the first


def test_missing_required_values_are_named(tmp_path, capsys):
    config = tmp_path / "empty.toml"
    config.write_text("[train]\nlr = 0\n")
    rc, report = _check(capsys, str(config))
    assert rc == 2 and _keys(report) == ["data.path", "target.path", "train.lr"]


def test_missing_target_and_data_are_named(tmp_path, capsys):
    no_config = tmp_path / "model-without-config"
    no_config.mkdir()
    rc, report = _check(
        capsys,
        DEMO,
        "--set",
        f"target.path={no_config}",
        "--set",
        f"data.path={tmp_path / 'nowhere.jsonl'}",
        "--set",
        f"run.runs_root={tmp_path}",
    )
    messages = {e["key"]: e["message"] for e in report["errors"]}
    assert rc == 2 and sorted(messages) == ["data.path", "target.path"]
    assert "nowhere.jsonl" in messages["data.path"]
    assert str(no_config) in messages["target.path"] and "config.json" in messages["target.path"]
    assert report["shm_bytes"] is None, "unknown without the target's sizes"


def test_target_sizes_come_from_config_json_alone(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 40, "hidden_size": 512}))
    (model / "model.safetensors").write_bytes(b"not weights: loading them would fail")
    sets = ["target.path=" + str(model), f"run.runs_root={tmp_path}", "drafter.num_target_layers=4"]
    rc, report = _check(capsys, DEMO, *_sets(*sets, "pipeline.state_copy_every=0"))
    assert rc == 0, report["errors"]
    cfg = load_config(DEMO, sets)
    assert report["shm_bytes"] == segment_bytes(8, slot_bytes(cfg, 4 * 512, 4)), "4 layers x 512, float32"
    # With state copies (the default) their two slots come on top, sized from the same config.json.
    rc, report = _check(capsys, DEMO, *_sets(*sets))
    assert rc == 0, report["errors"]
    assert report["shm_bytes"] > segment_bytes(8, slot_bytes(cfg, 4 * 512, 4)) + 2 * 512 * 512 * 12
    sets.append("drafter.target_layer_ids=[3, 40]")
    rc, report = _check(capsys, DEMO, *_sets(*sets))
    assert rc == 2 and _keys(report) == ["drafter.target_layer_ids"]
    assert "40 layers" in report["errors"][0]["message"]


def test_shm_bytes_is_what_the_queue_maps(tmp_path, capsys):
    """Against the job's own resolution: the tiny target built and read as the launcher reads it."""
    from transformers import AutoConfig

    from dflash.data.inputs import open_target
    from dflash.pipeline.state_copy import copies_nbytes
    from dflash.plan.resolve import torch_dtype
    from dflash.step.model import resolve_spec

    sets = [f"run.runs_root={tmp_path}", "pipeline.queue_depth=3", "target.dtype=bfloat16"]
    sets += ["drafter.num_target_layers=4", "data.max_seq_len=700", "data.bucket_multiple=128"]
    rc, report = _check(capsys, DEMO, *_sets(*sets))
    assert rc == 0, report["errors"]
    cfg = load_config(DEMO, sets)
    target_path, _, mask_id = open_target(cfg)
    spec = resolve_spec(cfg.drafter, AutoConfig.from_pretrained(target_path), mask_id)
    features = len(spec.target_layer_ids) * spec.target_hidden_size
    queue = HiddenStateQueue.create(
        f"dflash-test-check-{os.getpid()}",
        capacity=cfg.pipeline.queue_depth,
        slot_bytes=slot_bytes(cfg, features, torch_dtype(cfg.target.dtype).itemsize),
    )
    try:
        # The queue and the drafter state copies' file (its size against the real file's: test_state_copy).
        assert os.stat(queue.path).st_size + copies_nbytes(spec) == report["shm_bytes"]
    finally:
        queue.close()
        queue.unlink()


def test_host_and_device_rules(tmp_path, capsys):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    sets = [
        f"run.runs_root={tmp_path}",
        "train.keep_last=1",
        f"pipeline.target_devices=['cuda:{gpus}']",  # one past the last GPU: never there
        "pipeline.drafter_devices=['cpu', 'tpu']",  # two for one drafter, and no such device
    ]
    rc, report = _check(capsys, DEMO, *_sets(*sets), "--nnodes", "2", "--node-rank", "2")
    assert rc == 2
    assert _keys(report) == [
        "pipeline.drafter_devices",
        "pipeline.drafter_devices",
        "pipeline.nnodes",
        "pipeline.rdzv_endpoint",
        "pipeline.target_devices",
        "train.keep_last",
    ]
    text = json.dumps(report["errors"])
    assert "--node-rank 2 must be in 0..1" in text and "--rdzv-endpoint HOST0:PORT" in text
    assert f"cuda:{gpus}: not on this host" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only host")
def test_cuda_device_without_cuda(tmp_path, capsys):
    rc, report = _check(capsys, DEMO, "--set", "run.device=cuda", "--set", f"run.runs_root={tmp_path}")
    assert rc == 2 and _keys(report) == ["run.device"]


def test_runs_root_must_be_creatable(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc, report = _check(capsys, DEMO, "--set", f"run.runs_root={blocker / 'runs'}")
    assert rc == 2 and _keys(report) == ["run.runs_root"]
    assert "not a directory" in report["errors"][0]["message"]


def test_failures_still_answer_in_json(tmp_path, capsys, monkeypatch):
    rc, report = _check(capsys, str(tmp_path / "missing.toml"))
    assert rc == 2 and _keys(report) == [""] and "missing.toml" in report["errors"][0]["message"]
    rc, report = _check(capsys, DEMO, "--no-such-flag")
    assert rc == 2 and "--no-such-flag" in report["errors"][0]["message"]

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(check, "check", broken)
    rc, report = _check(capsys, DEMO)
    assert rc == 2 and report["errors"] == [
        {"key": "", "message": "the check itself failed: RuntimeError: boom"}
    ]


def test_human_output(tmp_path, capsys):
    assert check.main([DEMO, "--set", "train.lr=-1", "--set", f"run.runs_root={tmp_path}"]) == 2
    out = capsys.readouterr().out
    assert "error: train.lr: must be a positive number" in out and "1 error(s)" in out
    assert check.main([DEMO, "--set", f"run.runs_root={tmp_path}"]) == 0
    assert "ok (hidden-state queue:" in capsys.readouterr().out


def test_bf16_weights_off_the_gpu_is_refused_before_anything_starts(tmp_path, capsys):
    """train.bf16_weights=true keeps float32 masters in the GPU optimizer's kernel: on the CPU it is
    a config error naming the key; a misspelt value too."""
    rc, report = _check(capsys, DEMO, *_sets(f"run.runs_root={tmp_path / 'runs'}", "train.bf16_weights=true"))
    assert rc == 2 and _keys(report) == ["train.bf16_weights"], report["errors"]
    assert "use auto or false" in report["errors"][0]["message"]
    rc, report = _check(capsys, DEMO, *_sets(f"run.runs_root={tmp_path / 'runs'}", "train.bf16_weights=yes"))
    assert rc == 2 and _keys(report) == ["train.bf16_weights"] and "'yes'" in report["errors"][0]["message"]


def test_the_fused_qk_norm_rope_without_dflash_kernels_is_refused_before_anything_starts(tmp_path, capsys):
    """attention.fused_qk_norm_rope is part of dflash's attention kernels: on the CPU demo it would
    do nothing, so the check names it, and what to do, before any worker starts."""
    rc, report = _check(
        capsys, DEMO, *_sets(f"run.runs_root={tmp_path / 'runs'}", "attention.fused_qk_norm_rope=true")
    )
    assert rc == 2 and _keys(report) == ["attention.fused_qk_norm_rope"], report["errors"]
    assert "GPU only" in report["errors"][0]["message"]


def test_the_fused_qk_norm_rope_with_a_head_dim_its_kernel_cannot_take_is_refused_before_anything_starts(
    tmp_path, capsys
):
    """Set true with a target whose head dim is not a power of two, the check names the key and the
    head dim from the target's config.json (hidden / heads where it has no head_dim), not a worker
    when it builds the drafter; auto is fine there (it leaves the kernel off)."""
    model = tmp_path / "model"
    model.mkdir()
    sizes = {"num_hidden_layers": 8, "hidden_size": 480, "num_attention_heads": 5}  # head dim 96
    (model / "config.json").write_text(json.dumps(sizes))
    (model / "model.safetensors").write_bytes(b"not weights: the check never loads them")
    base = ["target.path=" + str(model), f"run.runs_root={tmp_path}", "drafter.num_target_layers=4"]
    rc, report = _check(capsys, DEMO, *_sets(*base, "attention.fused_qk_norm_rope=true"))
    messages = [e["message"] for e in report["errors"] if e["key"] == "attention.fused_qk_norm_rope"]
    assert rc == 2 and any("this drafter's is 96: set it false or auto" in m for m in messages), report[
        "errors"
    ]
    rc, report = _check(
        capsys, DEMO, *_sets(*base, "attention.fused_qk_norm_rope=true", "drafter.head_dim=64")
    )
    assert not any("head_dim" in e["message"] for e in report["errors"]), report["errors"]
    rc, report = _check(capsys, DEMO, *_sets(*base))
    assert rc == 0, report["errors"]


def test_the_spare_drafters_mode_and_cost_are_reported(tmp_path, capsys):
    """As the launcher resolves pipeline.spare_drafters before any worker: the CPU demo loads its
    graphs ahead; a two-rank group gets host spares; graphs asked for a two-rank group is an error."""
    from dflash.pipeline.state_copy import copy_nbytes

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 40, "hidden_size": 512}))
    (model / "model.safetensors").write_bytes(b"not weights: loading them would fail")
    sets = ["target.path=" + str(model), f"run.runs_root={tmp_path}", "drafter.num_target_layers=4"]
    rc, report = _check(capsys, DEMO, *_sets(*sets))
    assert rc == 0, report["errors"]
    spare = report["spare"]
    assert (spare["mode"], spare["per_host"], spare["gpu_bytes"]) == ("graphs", 1, 0)
    from transformers import Qwen3Config

    from dflash.plan.spec import resolve_spec

    spec = resolve_spec(
        load_config(DEMO, sets).drafter, Qwen3Config(num_hidden_layers=40, hidden_size=512), 0
    )
    frozen = (
        2 * 151936 * 512 * 4
    )  # Qwen3's default vocabulary, float32 (the demo's dtype): embedding and head
    assert spare["host_bytes"] == copy_nbytes(spec) // 3 + frozen
    rc, report = _check(capsys, DEMO, *_sets(*sets, "pipeline.drafters=2", "pipeline.queue_depth=8"))
    assert rc == 0 and report["spare"]["mode"] == "host" and report["spare"]["per_host"] == 2
    rc, report = _check(
        capsys,
        DEMO,
        *_sets(*sets, "pipeline.drafters=2", "pipeline.queue_depth=8", "pipeline.spare_drafters=graphs"),
    )
    assert (
        rc == 2 and _keys(report) == ["pipeline.spare_drafters"] and "DDP" in report["errors"][0]["message"]
    )
