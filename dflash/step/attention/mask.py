"""The one DFlash training mask, as a flex `mask_mod` and as a dense boolean reference.

Query index q is block token `q % K` of block `i = q // K` (anchor a_i). KV index kv is either a
context position (kv < S) or block token `kv - S` of block `(kv - S) // K`. Block i sees:
  - context p with p < a_i (strictly before its anchor), p < seq_len, and on sliding layers
    p >= a_i - window;
  - every token of its own block (bidirectional), or with causal_block only the block's tokens up
    to its own position (the convention engines assume for sliding layers unless a drafter's
    config.json says `is_causal: false`; drafter.sliding_block_causal picks it for sliding layers);
and nothing else. An invalid block (anchor -1) sees only its own block, so no row is empty (no NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def layer_masks(windows: Iterable[int | None], sliding_causal: bool) -> dict[int | None, bool]:
    """{window: causal_block} for each distinct layer type: one plan per entry, shared by every layer
    of that type. Only sliding layers (window not None) can be causal inside the block."""
    return {w: sliding_causal and w is not None for w in set(windows)}


def mask_name(block_size: int, window: int | None, causal_block: bool = False) -> str:
    kind = "full" if window is None else f"window{window}"
    return f"dflash_block{block_size}_{kind}{'_causal' if causal_block else ''}"


def dflash_mask_mod(
    anchors_BA: Tensor,
    seq_lens_B: Tensor,
    *,
    context_len: int,
    block_size: int,
    window: int | None,
    causal_block: bool = False,
) -> MaskMod:
    """Named mask_mod (attention-gym style: the name carries block size and window, so compiled
    code and logs say which mask they are). Safe on index grids padded past Q=[A*K] and KV=[S+A*K]
    (flex rounds both up to its sparse block size): every tensor index is clamped into range."""
    num_blocks = anchors_BA.shape[1]
    S, K = context_len, block_size
    q_len = num_blocks * K

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = torch.clamp(q_idx // K, max=num_blocks - 1)
        anchor = anchors_BA[b, block]
        in_context = (kv_idx < S) & (kv_idx < anchor) & (kv_idx < seq_lens_B[b])
        if window is not None:
            in_context = in_context & (kv_idx >= anchor - window)
        own_block = (kv_idx >= S) & ((kv_idx - S) // K == block) & (kv_idx < S + q_len)
        if causal_block:
            own_block = own_block & ((kv_idx - S) % K <= q_idx % K)
        return (in_context | own_block) & (q_idx < q_len)

    mask_mod.__name__ = mask_name(block_size, window, causal_block)
    return mask_mod


def dense_mask(
    anchors_BA: Tensor,
    seq_lens_B: Tensor,
    *,
    context_len: int,
    block_size: int,
    window: int | None,
    causal_block: bool = False,
) -> Tensor:
    """Boolean [B, A*K, S + A*K], built block by block from the definition (independently of the
    mask_mod, so tests compare two constructions). For tests and the eager backend only."""
    B, A = anchors_BA.shape
    S, K = context_len, block_size
    out = torch.zeros(B, A * K, S + A * K, dtype=torch.bool, device=anchors_BA.device)
    own_KK = torch.ones(K, K, dtype=torch.bool, device=anchors_BA.device)
    if causal_block:
        own_KK = own_KK.tril()
    for b in range(B):
        seq_len = int(seq_lens_B[b])
        for i in range(A):
            rows = slice(i * K, (i + 1) * K)
            anchor = int(anchors_BA[b, i])
            out[b, rows, S + i * K : S + (i + 1) * K] = own_KK
            if anchor < 0:
                continue
            lo = 0 if window is None else max(0, anchor - window)
            hi = min(anchor, seq_len, S)
            if hi > lo:
                out[b, rows, lo:hi] = True
    return out


def allowed_pairs(
    anchors_BA: Tensor,
    seq_lens_B: Tensor,
    *,
    context_len: int,
    block_size: int,
    window: int | None,
    causal_block: bool = False,
) -> int:
    """Unmasked query-key pairs (per head), computed in closed form: what benchmarks count as FLOPs."""
    K = block_size
    hi = torch.minimum(anchors_BA, seq_lens_B[:, None].clamp(max=context_len))
    lo = torch.zeros_like(hi) if window is None else (anchors_BA - window).clamp(min=0)
    ctx = (hi - lo).clamp(min=0) * (anchors_BA >= 0)
    own = K * (K + 1) // 2 if causal_block else K * K
    return int(ctx.sum()) * K + anchors_BA.numel() * own
