"""dflash.plan.builder: one JobPlan per config and machine, compared whole: what the job will run, where,
with which kernels, at which shapes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

from dflash import check
from dflash.config import load_config
from dflash.data.demo import tiny_config
from dflash.errors import ConfigError
from dflash.plan.builder import AttentionPlan, JobPlan, build_plan
from dflash.plan.shapes import make_plan
from dflash.plan.spec import resolve_spec

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from qwen3_sizes import QWEN3_8B  # noqa: E402

DEMO = REPO / "configs" / "demo-cpu.toml"
Q8B = REPO / "configs" / "qwen3-8b.toml"


def test_the_demo_plans_the_cpu_path_whole(tmp_path):
    cfg = load_config(DEMO, [f"run.runs_root={tmp_path}"])
    target = tiny_config(cfg.target.tiny_layers, cfg.target.tiny_hidden)
    plan = build_plan(cfg, target_config=target, mask_token_id=7)
    assert plan == JobPlan(
        device="cpu",
        attention=AttentionPlan(
            backend="sdpa",  # flex has no backward on the CPU
            compile=True,
            tuned_kernels=True,
            flex_kernels="flex",
            fused_qk_norm_rope=False,
            sdpa_chunk_blocks=cfg.attention.sdpa_chunk_blocks,
            strict=True,  # the demo sets attention.strict_kernels = true
        ),
        fused_loss=False,
        bf16_weights=False,
        target_compile=False,
        drafter_world=1,
        shapes=make_plan(
            min_seq_len=cfg.data.min_seq_len,
            max_seq_len=256,
            bucket_multiple=256,
            token_budget=2048,
            max_batch_size=8,
            num_anchors=cfg.train.num_anchors,
            block_size=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        spec=resolve_spec(cfg.drafter, target, 7),
        target_dtype="float32",
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        num_anchors=cfg.train.num_anchors,
        target_devices=("cpu",),
        drafter_devices=("cpu",),
        tau_eval=True,  # the drafters train on the CPU
    )
    assert plan.recompile_limit == 2 and plan.shapes.buckets() == [[8, 256]]


def test_the_8b_config_plans_the_gpu_path_whole(tmp_path):
    """Planned for a GPU (device given: this machine has none, the plan is data): every GPU choice."""
    cfg = load_config(Q8B, [f"run.runs_root={tmp_path}"])
    target = Qwen3Config(**QWEN3_8B)
    plan = build_plan(cfg, device=torch.device("cuda"), target_config=target, mask_token_id=151669)
    t, d = cfg.train, cfg.data
    assert plan == JobPlan(
        device="cuda",
        attention=AttentionPlan(
            backend="flex",
            compile=True,
            tuned_kernels=True,
            flex_kernels="dflash",
            fused_qk_norm_rope=True,  # head dim 128: the kernel takes it
            sdpa_chunk_blocks=cfg.attention.sdpa_chunk_blocks,
            strict=True,
        ),
        fused_loss=True,
        bf16_weights=True,  # one drafter
        target_compile=True,  # target.compile = auto on a GPU with attention.compile
        drafter_world=1,
        shapes=make_plan(
            min_seq_len=d.min_seq_len,
            max_seq_len=d.max_seq_len,
            bucket_multiple=d.bucket_multiple,
            token_budget=t.token_budget,
            max_batch_size=t.max_batch_size,
            num_anchors=t.num_anchors,
            block_size=cfg.drafter.block_size,
            block_token_budget=t.block_token_budget,
            layer_types=["sliding_attention"] * 4 + ["full_attention"],
            target_compile=True,
        ),
        spec=resolve_spec(cfg.drafter, target, 151669),
        target_dtype="bfloat16",
        loss_chunk_tokens=8192,
        num_anchors=512,
        target_devices=("cuda:0",),
        drafter_devices=("cuda:0",),
        tau_eval=True,  # auto: on a GPU too (the eval checks its room beside the workers)
    )
    assert plan.shapes.target_graphs == 2 * len(plan.shapes.shapes)
    assert plan.recompile_limit == max(plan.shapes.drafter_graphs, plan.shapes.target_graphs)


def test_a_drafter_group_changes_exactly_what_it_decides(tmp_path):
    """Two drafter ranks: the group's size, the float32 weights auto keeps for a group, the placement;
    nothing else in the plan moves."""
    base = [f"run.runs_root={tmp_path}"]
    one = build_plan(load_config(Q8B, base), device=torch.device("cuda"))
    group_cfg = load_config(
        Q8B,
        [
            *base,
            "pipeline.drafters=2",
            'pipeline.drafter_devices=["cuda:1", "cuda:2"]',
            "pipeline.queue_depth=8",
        ],
    )
    group = build_plan(group_cfg, device=torch.device("cuda"))
    assert group == dataclasses.replace(
        one, bf16_weights=False, drafter_world=2, drafter_devices=("cuda:1", "cuda:2")
    )
    assert one.spec is None  # no target config given: no drafter sizes


def test_a_choice_the_machine_cannot_run_is_refused_naming_its_key(tmp_path):
    cfg = load_config(DEMO, [f"run.runs_root={tmp_path}", "attention.backend=flex"])
    with pytest.raises(ConfigError) as e:
        build_plan(cfg)
    assert e.value.key == "attention.backend"


def test_check_prints_the_plan_the_job_builds(tmp_path, capsys):
    runs = f"run.runs_root={tmp_path}"
    rc = check.main([str(DEMO), "--set", runs, "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    cfg = load_config(DEMO, [runs])
    want = build_plan(
        cfg, target_config=tiny_config(cfg.target.tiny_layers, cfg.target.tiny_hidden), mask_token_id=0
    ).to_dict()
    want["spec"]["mask_token_id"] = None  # the tokenizer's: the check reads no tokenizer
    assert report["plan"] == want
    rc = check.main([str(DEMO), "--set", runs, "--set", "train.lr=-1", "--json"])
    assert rc == 2 and json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plan"] is None


def _other(value):
    """A different value of the same kind, for a field of the plan."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    if isinstance(value, str):
        return {"cuda": "cpu", "cpu": "cuda", "flex": "sdpa", "sdpa": "flex", "dflash": "flex"}.get(
            value, value + "x"
        )
    if isinstance(value, tuple):
        return (*value, "cuda:7")
    if dataclasses.is_dataclass(value) and hasattr(value, "shapes"):  # the shape plan
        return dataclasses.replace(value, token_budget=value.token_budget + 1)
    if dataclasses.is_dataclass(value) and hasattr(value, "hidden_size"):  # the drafter's spec
        return dataclasses.replace(value, intermediate_size=value.intermediate_size * 2)
    raise AssertionError(f"no other value for {value!r}")


def test_the_cache_key_is_the_plans_compiled_part_field_by_field(tmp_path):
    """Every plan field is marked where it is declared; changing a field marked compiled changes the
    compile cache's key, changing any other field leaves it (the key is dflash.cache.fingerprint's)."""
    from dflash.cache.fingerprint import fingerprint_key, job_fingerprint
    from dflash.plan.builder import compile_part

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))
    cfg = load_config(Q8B, [f"run.runs_root={tmp_path}"])
    plan = build_plan(
        cfg, device=torch.device("cuda"), target_config=Qwen3Config(**QWEN3_8B), mask_token_id=151669
    )

    def key(p):
        return fingerprint_key(job_fingerprint(cfg, p, str(tmp_path)))

    base = key(plan)
    seen = []
    for owner, replace in (
        (plan, lambda **kw: dataclasses.replace(plan, **kw)),
        (
            plan.attention,
            lambda **kw: dataclasses.replace(plan, attention=dataclasses.replace(plan.attention, **kw)),
        ),
    ):
        for f in dataclasses.fields(owner):
            assert "compiled" in f.metadata, f"{type(owner).__name__}.{f.name} has no compiled mark"
            if f.name == "attention":
                continue  # its own fields, below
            changed = replace(**{f.name: _other(getattr(owner, f.name))})
            moved = key(changed) != base
            assert moved == (f.metadata["compiled"] is not False), f"{type(owner).__name__}.{f.name}"
            seen.append((f.name, moved))
    assert (
        ("tuned_kernels", True) in seen and ("strict", False) in seen and ("drafter_devices", False) in seen
    )
    # The form a mark gives: cuda:0 and cuda:1 compile alike; one rank or a group of 2 or 4 differ once.
    assert key(dataclasses.replace(plan, device="cuda:1")) == base
    assert (
        key(dataclasses.replace(plan, drafter_world=2))
        == key(dataclasses.replace(plan, drafter_world=4))
        != base
    )
    assert compile_part(plan)["attention"] == {
        k: v for k, v in plan.attention.to_dict().items() if k != "strict"
    }
