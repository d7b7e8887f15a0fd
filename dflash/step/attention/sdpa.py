"""DFlash attention on F.scaled_dot_product_attention, with no dense [Q, KV] mask.

The flex-free path: CPU training (flex has no backward on CPU) and the fallback that cannot hit a
compile race. Work is split in chunks of `chunk_blocks` consecutive blocks. Anchors are sorted, so
the context a chunk needs is ONE contiguous slice [lo, hi): from the earliest window start of its
blocks (0 on the full layer) to its last anchor. Each chunk is one SDPA call over
[that slice | the chunk's own blocks] under a chunk-sized boolean mask. Slicing (not gathering a
window per block) keeps the backward a plain strided add: the first version gathered a 2048-token
window per block and its scatter-add backward took 734 ms per sliding layer on an H200.
GQA is folded into the query axis ([R query heads x rows] per kv head), so no K/V is repeated.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash.step.attention.mask import layer_masks

SLICE_MULTIPLE = 128
"""Context slices are rounded out to multiples of this. SDPA's cuDNN kernels build an execution plan
per new shape on the host: with exact, data-dependent slice lengths every batch brought new shapes,
and the 8B step on the H200 spent about 1 s of host time per step around 315 ms of GPU work
(2026-12-01)."""

SLICE_WIDTH_MULTIPLE = 512
"""And their widths to multiples of this (the slice grows toward the sequence's start, or its end
at the start): a few widths per chunk instead of one per 128 positions. Each new width still cost
a plan of about 65 ms of host time in the 8B step's profile, 23 ms per step over its first steps."""


def widen(lo: int, hi: int, S: int) -> tuple[int, int]:
    """[lo, hi) rounded out to SLICE_MULTIPLE, then widened to a multiple of SLICE_WIDTH_MULTIPLE
    (or to all of [0, S)) inside [0, S)."""
    m = SLICE_MULTIPLE
    lo, hi = lo // m * m, min(S, -(-hi // m) * m)
    width = min(S, -(-(hi - lo) // SLICE_WIDTH_MULTIPLE) * SLICE_WIDTH_MULTIPLE)
    lo = max(0, hi - width)
    return lo, min(S, lo + width)


@dataclass(kw_only=True, slots=True)
class ChunkPlan:
    context_len: int
    block_size: int
    chunks: list[tuple[int, int, int, int]]
    """(first block, end block, context slice start, context slice end) per chunk."""
    masks: list[Tensor]
    """Per chunk: bool [B, 1, c*K, (hi - lo) + c*K]."""


class SdpaBackend:
    name = "sdpa"
    fused_qk_norm_rope = False

    def __init__(self, *, chunk_blocks: int = 64) -> None:
        if chunk_blocks < 1:
            raise ValueError("chunk_blocks must be >= 1")
        self.chunk_blocks = chunk_blocks

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Iterable[int | None],
        sliding_causal: bool = False,
    ) -> dict[int | None, ChunkPlan]:
        return {
            w: self._plan(anchors_BA, seq_lens_B, context_len, block_size, w, causal)
            for w, causal in layer_masks(windows, sliding_causal).items()
        }

    def _plan(
        self, anchors_BA: Tensor, seq_lens_B: Tensor, S: int, K: int, window: int | None, causal_block: bool
    ) -> ChunkPlan:
        B, A = anchors_BA.shape
        dev = anchors_BA.device
        # A block sees context [start, end): strictly before its anchor, inside the sequence, and
        # (sliding layers) not older than the window. Padded blocks (anchor -1) get an empty range.
        end_BA = torch.minimum(anchors_BA, seq_lens_B[:, None].clamp(max=S)).clamp(min=0)
        start_BA = torch.zeros_like(end_BA) if window is None else (anchors_BA - window).clamp(min=0)
        start_BA = torch.minimum(start_BA, end_BA)
        starts = list(range(0, A, self.chunk_blocks))
        big = torch.iinfo(end_BA.dtype).max
        bounds = []
        for s in starts:
            e_BA, s_BA = end_BA[:, s : s + self.chunk_blocks], start_BA[:, s : s + self.chunk_blocks]
            nonempty = e_BA > s_BA
            lo = torch.where(nonempty, s_BA, torch.full_like(s_BA, big)).amin()
            bounds.append(torch.stack([torch.minimum(lo, e_BA.amax()), e_BA.amax()]))
        # One host sync per batch and layer type (not per layer): the slice of every chunk, widened
        # (widen: the extra keys are masked out) so the attention calls take a few shapes, not a new
        # one every batch.
        slices = [widen(int(lo), int(hi), S) for lo, hi in torch.stack(bounds).tolist()]
        chunks, masks = [], []
        for s, (lo, hi) in zip(starts, slices, strict=True):
            e = min(s + self.chunk_blocks, A)
            c = e - s
            pos_P = torch.arange(lo, hi, device=dev)
            ctx_BcP = (pos_P >= start_BA[:, s:e, None]) & (pos_P < end_BA[:, s:e, None])
            own_cc = torch.eye(c, dtype=torch.bool, device=dev).expand(B, c, c)
            # Expand blocks to their K query rows and own-block columns to K keys each.
            ctx_part = ctx_BcP.repeat_interleave(K, dim=1)
            own_part = own_cc.repeat_interleave(K, dim=1).repeat_interleave(K, dim=2)
            if causal_block:  # inside its block, a token sees the block's tokens up to itself
                own_part = own_part & torch.ones(K, K, dtype=torch.bool, device=dev).tril().repeat(c, c)
            masks.append(torch.cat([ctx_part, own_part], dim=2)[:, None])
            chunks.append((s, e, lo, hi))
        return ChunkPlan(context_len=S, block_size=K, chunks=chunks, masks=masks)

    # Runs eagerly even inside a compiled layer: the plans carry data-dependent sizes (each chunk's
    # context slice), which would otherwise recompile the layer for every batch. SDPA is one fused
    # kernel per call already; compile keeps the norms, projections and MLP.
    @torch.compiler.disable
    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: ChunkPlan) -> Tensor:
        B, H, Q, D = q_BHQD.shape
        G = k_BGLD.shape[1]
        R = H // G
        S, K = plan.context_len, plan.block_size
        q_BGRQD = q_BHQD.view(B, G, R, Q, D)
        outs = []
        for (s, e, lo, hi), mask_B1qL in zip(plan.chunks, plan.masks, strict=True):
            n = (e - s) * K
            own = slice(S + s * K, S + e * K)
            k_BGLD_c = torch.cat([k_BGLD[:, :, lo:hi], k_BGLD[:, :, own]], dim=2)
            v_BGLD_c = torch.cat([v_BGLD[:, :, lo:hi], v_BGLD[:, :, own]], dim=2)
            q_BGnD = q_BGRQD[:, :, :, s * K : e * K].reshape(B, G, R * n, D)
            # The mask rows repeat for the R query heads folded into the query axis.
            mask_B1nL = mask_B1qL.repeat(1, 1, R, 1)
            o_BGnD = F.scaled_dot_product_attention(q_BGnD, k_BGLD_c, v_BGLD_c, attn_mask=mask_B1nL)
            outs.append(o_BGnD.view(B, G, R, n, D))
        return torch.cat(outs, dim=3).reshape(B, H, Q, D)
