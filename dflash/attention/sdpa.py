"""DFlash attention on F.scaled_dot_product_attention, with no dense [Q, KV] mask.

The flex-free path: CPU training (flex has no backward on CPU) and the fallback that cannot hit a
compile race. Work is split in chunks of `chunk_blocks` blocks, so every mask and gathered K/V is
bounded by the chunk, not by the batch:
  - sliding layers: each block gathers its own context window [a_i - W, a_i) plus its own block,
    so a block's SDPA call sees exactly W + K keys (no wasted columns beyond the window edges);
  - the full layer: a chunk of blocks reads the context prefix [0, max anchor of the chunk) and the
    chunk's own blocks, under a chunk-sized boolean mask.
GQA is folded into the query axis ([G heads x K tokens] per kv head) so no K/V is repeated and the
kernel gets G*K query rows per call instead of K.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(kw_only=True, slots=True)
class SlidingPlan:
    context_len: int
    block_size: int
    index_BAW: Tensor
    """Context positions of each block's window, clamped into [0, S-1]."""
    keep_BAL: Tensor
    """Which of the W window keys + K own-block keys a block sees."""


@dataclass(kw_only=True, slots=True)
class FullPlan:
    context_len: int
    block_size: int
    chunks: list[tuple[int, int, int]]
    """(first block, end block, context prefix length) per chunk."""
    masks: list[Tensor]
    """Per chunk: bool [B, 1, c*K, prefix + c*K]."""


class SdpaBackend:
    name = "sdpa"

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
    ) -> dict[int | None, SlidingPlan | FullPlan]:
        plans: dict[int | None, SlidingPlan | FullPlan] = {}
        for w in set(windows):
            if w is None:
                plans[w] = self._full_plan(anchors_BA, seq_lens_B, context_len, block_size)
            else:
                plans[w] = self._sliding_plan(anchors_BA, seq_lens_B, context_len, block_size, w)
        return plans

    def _sliding_plan(
        self, anchors_BA: Tensor, seq_lens_B: Tensor, S: int, K: int, window: int
    ) -> SlidingPlan:
        width = max(1, min(window, S))
        pos_BAW = anchors_BA[:, :, None] - width + torch.arange(width, device=anchors_BA.device)
        limit_B11 = torch.minimum(seq_lens_B, torch.tensor(S, device=seq_lens_B.device))[:, None, None]
        valid_BAW = (pos_BAW >= 0) & (pos_BAW < anchors_BA[:, :, None]) & (pos_BAW < limit_B11)
        own_BAK = torch.ones(*anchors_BA.shape, K, dtype=torch.bool, device=anchors_BA.device)
        return SlidingPlan(
            context_len=S,
            block_size=K,
            index_BAW=pos_BAW.clamp(0, max(S - 1, 0)),
            keep_BAL=torch.cat([valid_BAW, own_BAK], dim=2),
        )

    def _full_plan(self, anchors_BA: Tensor, seq_lens_B: Tensor, S: int, K: int) -> FullPlan:
        B, A = anchors_BA.shape
        dev = anchors_BA.device
        limit_BA = torch.minimum(anchors_BA, seq_lens_B[:, None].clamp(max=S)).clamp(min=0)
        starts = list(range(0, A, self.chunk_blocks))
        # One host sync per batch (not per layer): the prefix each chunk must read.
        prefix = [
            int(x)
            for x in torch.stack([limit_BA[:, s : s + self.chunk_blocks].amax() for s in starts]).tolist()
        ]
        chunks, masks = [], []
        for s, p in zip(starts, prefix, strict=True):
            e = min(s + self.chunk_blocks, A)
            c = e - s
            ctx_BcP = torch.arange(p, device=dev)[None, None, :] < limit_BA[:, s:e, None]
            own_cc = torch.eye(c, dtype=torch.bool, device=dev)
            keep_BcL = torch.cat([ctx_BcP, own_cc.expand(B, c, c)], dim=2)
            # Expand blocks to their K query rows and own-block columns to K keys each.
            ctx_part = keep_BcL[:, :, :p].repeat_interleave(K, dim=1)
            own_part = keep_BcL[:, :, p:].repeat_interleave(K, dim=1).repeat_interleave(K, dim=2)
            masks.append(torch.cat([ctx_part, own_part], dim=2)[:, None])
            chunks.append((s, e, p))
        return FullPlan(context_len=S, block_size=K, chunks=chunks, masks=masks)

    # Runs eagerly even inside a compiled layer: the plans carry data-dependent sizes (the context
    # prefix of each full-layer chunk), which would otherwise recompile the layer for every batch.
    # SDPA is one fused kernel per call already; compile keeps the norms, projections and MLP.
    @torch.compiler.disable
    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: SlidingPlan | FullPlan) -> Tensor:
        if isinstance(plan, SlidingPlan):
            return self._attend_sliding(q_BHQD, k_BGLD, v_BGLD, plan)
        return self._attend_full(q_BHQD, k_BGLD, v_BGLD, plan)

    def _attend_sliding(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: SlidingPlan) -> Tensor:
        B, H, Q, D = q_BHQD.shape
        G = k_BGLD.shape[1]
        S, K = plan.context_len, plan.block_size
        A = Q // K
        q_BGRAKD = q_BHQD.view(B, G, H // G, A, K, D)
        k_ctx_BSGD = k_BGLD[:, :, :S].transpose(1, 2)
        v_ctx_BSGD = v_BGLD[:, :, :S].transpose(1, 2)
        k_blk_BGAKD = k_BGLD[:, :, S:].view(B, G, A, K, D)
        v_blk_BGAKD = v_BGLD[:, :, S:].view(B, G, A, K, D)
        outs = []
        for s in range(0, A, self.chunk_blocks):
            e = min(s + self.chunk_blocks, A)
            c = e - s
            idx_BcW = plan.index_BAW[:, s:e]
            W = idx_BcW.shape[-1]

            q_NGRD = q_BGRAKD[:, :, :, s:e].permute(0, 3, 1, 2, 4, 5).reshape(B * c, G, (H // G) * K, D)
            mask_N11L = plan.keep_BAL[:, s:e].reshape(B * c, 1, 1, W + K)
            o_NGRD = F.scaled_dot_product_attention(
                q_NGRD,
                _window_kv(k_ctx_BSGD, k_blk_BGAKD, idx_BcW, s, e),
                _window_kv(v_ctx_BSGD, v_blk_BGAKD, idx_BcW, s, e),
                attn_mask=mask_N11L,
            )
            outs.append(o_NGRD.view(B, c, G, H // G, K, D).permute(0, 2, 3, 1, 4, 5))
        return torch.cat(outs, dim=3).reshape(B, H, Q, D)

    def _attend_full(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: FullPlan) -> Tensor:
        B, H, Q, D = q_BHQD.shape
        G = k_BGLD.shape[1]
        R = H // G
        S, K = plan.context_len, plan.block_size
        q_BGRQD = q_BHQD.view(B, G, R, Q, D)
        outs = []
        for (s, e, p), mask_B1qL in zip(plan.chunks, plan.masks, strict=True):
            rows = slice(s * K, e * K)
            n = (e - s) * K
            k_BGLD_c = torch.cat([k_BGLD[:, :, :p], k_BGLD[:, :, S + s * K : S + e * K]], dim=2)
            v_BGLD_c = torch.cat([v_BGLD[:, :, :p], v_BGLD[:, :, S + s * K : S + e * K]], dim=2)
            q_BGnD = q_BGRQD[:, :, :, rows].reshape(B, G, R * n, D)
            # The mask rows repeat for the R query heads folded into the query axis.
            mask_B1nL = mask_B1qL.repeat(1, 1, R, 1)
            o_BGnD = F.scaled_dot_product_attention(q_BGnD, k_BGLD_c, v_BGLD_c, attn_mask=mask_B1nL)
            outs.append(o_BGnD.view(B, G, R, n, D))
        return torch.cat(outs, dim=3).reshape(B, H, Q, D)


def _window_kv(ctx_BSGD: Tensor, blk_BGAKD: Tensor, idx_BcW: Tensor, s: int, e: int) -> Tensor:
    """Per block of [s, e): its context window gathered from ctx, then its own block -> [B*c, G, W+K, D]."""
    B, c, W = idx_BcW.shape
    G, K, D = blk_BGAKD.shape[1], blk_BGAKD.shape[3], blk_BGAKD.shape[4]
    b_B11 = torch.arange(B, device=idx_BcW.device)[:, None, None]
    win_BcWGD = ctx_BSGD[b_B11, idx_BcW]
    own_BcKGD = blk_BGAKD[:, :, s:e].permute(0, 2, 3, 1, 4)
    kv_BcLGD = torch.cat([win_BcWGD, own_BcKGD], dim=2)
    return kv_BcLGD.permute(0, 1, 3, 2, 4).reshape(B * c, G, W + K, D)
