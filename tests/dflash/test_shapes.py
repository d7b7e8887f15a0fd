"""The shape plan (dflash.plan.shapes): budgets per bucket, anchors per row, graphs and the recompile limit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash.config import load_config
from dflash.data.dataset import TokenBudgetBatcher, TokenizedDataset
from dflash.errors import ConfigError, DFlashError
from dflash.plan.shapes import make_plan, shape_plan
from dflash.step.objective import block_labels, dflash_loss, position_weights, sample_anchors

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def _cfg(path: Path, *sets: str):
    return load_config(str(path), ["target.path=tiny", "data.path=demo", *sets])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_every_bucket_within_both_budgets_and_its_anchors(config: Path) -> None:
    cfg = _cfg(config)
    plan = shape_plan(cfg)
    longest = plan.shapes[-1]
    assert plan.block_token_budget == longest.block_tokens  # derived: the longest bucket's
    for s in plan.shapes:
        assert s.block_tokens <= plan.block_token_budget, s
        assert s.seq_tokens <= cfg.train.token_budget and s.rows <= cfg.train.max_batch_size, s
        assert s.anchors == min(cfg.train.num_anchors, s.length - 1), s
        assert s.block_size == cfg.drafter.block_size


def test_the_8b_short_bucket_no_longer_five_times_heavier() -> None:
    """The field numbers: 64 rows x 512 anchors x 16 = 524,288 block tokens at the 512 bucket before,
    12 x 512 x 16 = 98,304 at 4096. Now every bucket is at most the 4096 bucket's."""
    plan = shape_plan(_cfg(REPO / "configs" / "qwen3-8b.toml"))
    assert plan.lengths == list(range(512, 4097, 512))
    assert plan.shape_for(4096).block_tokens == 98_304
    assert plan.shape_for(512).anchors == 511 and plan.shape_for(512).rows == 12
    assert max(s.block_tokens for s in plan.shapes) == 98_304
    # 8 buckets x 3 layer variants: sliding first (input without grad), sliding, full
    assert plan.layer_variants == 3 and plan.drafter_graphs == 24 and plan.recompile_limit == 24


def test_an_explicit_block_budget_binds_and_one_below_a_row_is_refused() -> None:
    config = REPO / "configs" / "qwen3-8b.toml"
    plan = shape_plan(_cfg(config, "train.block_token_budget=49152"))
    assert [s.rows for s in plan.shapes] == [6] * 8 and plan.block_token_budget == 49152
    with pytest.raises(ConfigError, match=r"train\.block_token_budget.*one row of the longest bucket"):
        _cfg(config, "train.block_token_budget=1000")


def test_graphs_follow_layer_types_and_target_compile() -> None:
    demo = REPO / "configs" / "demo-cpu.toml"
    assert shape_plan(_cfg(demo)).recompile_limit == 2  # one bucket: sliding (first), full
    one_type = shape_plan(_cfg(demo, 'drafter.layer_types=["full_attention", "full_attention"]'))
    assert one_type.drafter_graphs == 2  # the first layer's input needs no grad, the second's does
    single = shape_plan(_cfg(demo, "drafter.num_layers=1", 'drafter.layer_types=["full_attention"]'))
    assert single.drafter_graphs == 1
    with_target = shape_plan(_cfg(demo), target_compile=True)  # as the plan gives it (target.compile=true)
    assert with_target.target_graphs == 2 and with_target.recompile_limit == 2  # unpadded + padded


def test_target_compile_auto_is_on_where_it_wins(tmp_path: Path) -> None:
    """auto compiles the target on a GPU with compile on (its graphs in the plan, the recompile limit
    and the fingerprint), not on the CPU; true and false are what they say; anything else is refused."""
    import dataclasses

    from dflash.cache.fingerprint import target_fingerprint
    from dflash.plan.builder import build_plan
    from dflash.plan.resolve import resolve_target_compile

    eight_b = REPO / "configs" / "qwen3-8b.toml"
    cfg = _cfg(eight_b)
    assert cfg.target.compile == "auto"
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_target_compile(cfg, cuda) and not resolve_target_compile(cfg, cpu)
    sdpa = "attention.backend=sdpa"  # planned for the CPU too (flex has no backward there)

    def planned(device, *sets):
        return build_plan(_cfg(eight_b, sdpa, *sets), device=device)

    on_gpu, on_cpu = planned(cuda).shapes, planned(cpu).shapes
    assert on_cpu.target_graphs == 0 and on_gpu.target_graphs == 2 * len(on_gpu.buckets())
    assert on_gpu.recompile_limit >= on_gpu.target_graphs // len(on_gpu.buckets())
    assert planned(cuda, "attention.compile=false").shapes.target_graphs == 0
    assert planned(cpu, "target.compile=true").shapes.target_graphs > 0
    assert planned(cuda, "target.compile=false").shapes.target_graphs == 0
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_hidden_layers": 4}')

    class Spec:
        target_layer_ids = (1, 2)

    def with_spec(plan):
        return dataclasses.replace(plan, spec=Spec)

    assert target_fingerprint(cfg, with_spec(planned(cpu)), str(tmp_path)) == {"compile": False}
    fp = target_fingerprint(cfg, with_spec(planned(cuda)), str(tmp_path))
    assert fp["compile"] is True and fp["layers_kept"] == 3
    with pytest.raises(ConfigError, match=r"target\.compile.*true, false or auto"):
        _cfg(eight_b, "target.compile=maybe")


def test_unplanned_batches_are_refused() -> None:
    plan = shape_plan(_cfg(REPO / "configs" / "qwen3-8b.toml"))
    assert plan.check_batch(12, 1024).anchors == 512
    with pytest.raises(DFlashError, match="outside the shape plan"):
        plan.check_batch(13, 1024)
    with pytest.raises(DFlashError, match="outside the shape plan"):
        plan.check_batch(12, 1000)


def _dataset(lengths: list[int], trained_tail: int) -> TokenizedDataset:
    """Sequences whose last `trained_tail` tokens are trained (a prompt, then a short answer)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = (np.arange(offsets[-1], dtype=np.int64) * 7919 % 97).astype(np.int32)
    mask = np.zeros_like(tokens, dtype=np.bool_)
    for end in offsets[1:]:
        mask[max(0, end - trained_tail) : end] = True
    return TokenizedDataset(tokens=tokens, loss_mask=mask, offsets=offsets, pad_token_id=99)


def _epoch_sums(plan, ds: TokenizedDataset) -> tuple[float, float, int, int]:
    """(sum of w * CE, sum of w, hits, trained positions) over one epoch of `plan`'s batches, with a
    fixed per-token "drafter" (hidden state = a fixed function of the anchor's token and k)."""
    torch.manual_seed(0)
    emb = torch.randn(100, 8, dtype=torch.float64)
    pos = torch.randn(16, 8, dtype=torch.float64)
    head = torch.randn(100, 8, dtype=torch.float64)
    batcher = TokenBudgetBatcher(ds, plan=plan, seed=3, shuffle=True)
    it = iter(batcher)
    ce = weight = 0.0
    hits = n = 0
    for _ in range(batcher.batches_per_epoch):
        b = next(it)
        shape = plan.shape_for(b.input_ids_BL.shape[1])
        anchors = sample_anchors(
            b.loss_mask_BL, b.seq_lens_B, shape.anchors, torch.Generator().manual_seed(1)
        )
        labels, valid = block_labels(b.input_ids_BL, b.loss_mask_BL, b.seq_lens_B, anchors, 16)
        at_anchor = b.input_ids_BL.gather(1, anchors.clamp(min=0))
        hidden = emb[at_anchor][:, :, None, :] + pos[None, None]
        out = dflash_loss(hidden, head, labels, valid, gamma=7.0, chunk_tokens=64)
        w = position_weights(16, 7.0)[None, None].expand_as(valid)[valid].double().sum().item()
        ce += out.loss.item() * w
        weight += w
        hits += round(out.acc * out.tokens) if out.tokens else 0
        n += out.tokens
    return ce, weight, hits, n


def test_loss_and_accuracy_unchanged_by_the_block_budget() -> None:
    """Rows are independent and every row keeps its anchors, so the budget only regroups the same
    training examples: with anchors covering every eligible position (here 20 trained tokens per
    sequence, 24 anchors per row) the epoch's weighted loss, hits and trained positions are
    identical; with sampled anchors they are equal in expectation (each row's anchors are drawn the
    same way whatever the batch)."""
    lengths = [int(x) for x in np.random.default_rng(0).integers(4, 128, size=90)]
    common = {"min_seq_len": 1, "max_seq_len": 128, "bucket_multiple": 32, "token_budget": 512}
    common.update(max_batch_size=16, num_anchors=24, block_size=16)
    budgeted = make_plan(**common)  # the derived block budget binds for the short buckets
    unbounded = make_plan(**common, block_token_budget=10**9)
    assert [s.rows for s in budgeted.shapes] == [4, 4, 4, 4]
    assert [s.rows for s in unbounded.shapes] == [16, 8, 5, 4]
    ds = _dataset(lengths, trained_tail=20)
    a, b = _epoch_sums(budgeted, ds), _epoch_sums(unbounded, ds)
    assert a[2:] == b[2:] and a[3] > 0
    # Equal up to the float32 sums of the loss weights (grouped differently).
    assert math.isclose(a[0], b[0], rel_tol=1e-6) and math.isclose(a[1], b[1], rel_tol=1e-6)
