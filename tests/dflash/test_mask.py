"""The mask_mod on arange index grids against the dense reference, on odd sizes and edge anchors."""

from __future__ import annotations

import pytest
import torch

from dflash.step.attention.mask import allowed_pairs, dense_mask, dflash_mask_mod, mask_name

S, K = 100, 7
# Anchor 0 (sees no context), anchor S-1 (the last position), a middle one, and a -1 padded block.
ANCHORS = torch.tensor([[0, 3, 50, 99, -1], [1, 10, 20, 40, 60]])
SEQ_LENS = torch.tensor([100, 45])  # batch 1 is padded past 45: anchor 60 must not see 45..59


def grid(mask_mod, q_len: int, kv_len: int) -> torch.Tensor:
    B = ANCHORS.shape[0]
    b = torch.arange(B)[:, None, None]
    q = torch.arange(q_len)[None, :, None]
    kv = torch.arange(kv_len)[None, None, :]
    return mask_mod(b, torch.zeros_like(b), q, kv).expand(B, q_len, kv_len)


@pytest.mark.parametrize("causal_block", [False, True])
@pytest.mark.parametrize("window", [None, 1, 13, 64, 1000])
def test_mask_mod_matches_dense_reference(window, causal_block):
    A = ANCHORS.shape[1]
    kw = dict(context_len=S, block_size=K, window=window, causal_block=causal_block)
    mod = dflash_mask_mod(ANCHORS, SEQ_LENS, **kw)
    dense = dense_mask(ANCHORS, SEQ_LENS, **kw)
    got = grid(mod, A * K, S + A * K)
    assert torch.equal(got, dense), f"mask_mod differs from dense at {(got != dense).nonzero()[:5].tolist()}"
    assert int(dense.sum()) == allowed_pairs(ANCHORS, SEQ_LENS, **kw)


def test_causal_block_sees_its_block_up_to_itself():
    A = ANCHORS.shape[1]
    dense = dense_mask(ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=13, causal_block=True)
    blocks = dense[:, :, S:].reshape(2, A, K, A, K)
    tril = torch.ones(K, K, dtype=torch.bool).tril()
    want = torch.eye(A, dtype=torch.bool)[None, :, None, :, None] & tril[None, None, :, None, :]
    assert torch.equal(blocks, want.expand_as(blocks))
    # Context visibility is unchanged: block at anchor 50 still sees exactly 37..49 on every row.
    for j in range(K):
        assert dense[0, 2 * K + j, :S].nonzero().flatten().tolist() == list(range(37, 50))
    name = dflash_mask_mod(
        ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=13, causal_block=True
    ).__name__
    assert name == "dflash_block7_window13_causal"


def test_mask_structure():
    A = ANCHORS.shape[1]
    dense = dense_mask(ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=None)
    assert dense.any(dim=-1).all(), "every query row must see at least its own block (no NaN rows)"
    # Anchor 0 sees no context; anchor 99 sees exactly 0..98.
    assert not dense[0, 0:K, :S].any()
    assert dense[0, 3 * K, :S].nonzero().flatten().tolist() == list(range(99))
    # The padded block sees only itself.
    row = dense[0, 4 * K]
    assert row[:S].sum() == 0 and row[S + 4 * K : S + 5 * K].all() and row.sum() == K
    # Padding of sequence 1 (positions >= 45) is never visible.
    assert not dense[1, :, 45:S].any()
    # Own block is bidirectional; other blocks are invisible.
    blocks = dense[:, :, S:].reshape(2, A, K, A, K)
    eye = torch.eye(A, dtype=torch.bool)[None, :, None, :, None].expand_as(blocks)
    assert torch.equal(blocks, eye)
    # Sliding: block at anchor 50 with window 13 sees exactly 37..49.
    slid = dense_mask(ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=13)
    assert slid[0, 2 * K, :S].nonzero().flatten().tolist() == list(range(37, 50))


def test_mask_mod_is_safe_on_padded_grids():
    """flex evaluates the mask on lengths rounded up to its block size: indices past Q and KV."""
    A = ANCHORS.shape[1]
    mod = dflash_mask_mod(ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=13)
    padded = grid(mod, 128, 256)
    assert not padded[:, A * K :].any(), "padded query rows must be empty"
    assert not padded[:, :, S + A * K :].any(), "padded kv columns must be invisible"


def test_mask_names_encode_parameters():
    assert dflash_mask_mod(ANCHORS, SEQ_LENS, context_len=S, block_size=K, window=13).__name__ == mask_name(
        7, 13
    )
    assert mask_name(16, None) == "dflash_block16_full"
    assert mask_name(16, 2048) == "dflash_block16_window2048"
