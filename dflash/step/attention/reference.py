"""Eager attention under the dense mask: the reference every fast backend is tested against."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dflash.step.attention.mask import dense_mask, layer_masks


class EagerBackend:
    """Materialises the full [Q, KV] scores in float32. Tests and tiny runs only."""

    name = "eager"
    fused_qk_norm_rope = False

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Iterable[int | None],
        sliding_causal: bool = False,
    ) -> dict[int | None, Tensor]:
        return {
            w: dense_mask(
                anchors_BA,
                seq_lens_B,
                context_len=context_len,
                block_size=block_size,
                window=w,
                causal_block=causal,
            )[:, None]
            for w, causal in layer_masks(windows, sliding_causal).items()
        }

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, mask_B1QL: Tensor) -> Tensor:
        return eager_attention(q_BHQD, k_BGLD, v_BGLD, mask_B1QL)


def eager_attention(q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, mask_B1QL: Tensor) -> Tensor:
    # Query head h reads kv head h // (H // G): the same grouping as flex's enable_gqa and SDPA's.
    rep = q_BHQD.shape[1] // k_BGLD.shape[1]
    k_BHLD = k_BGLD.repeat_interleave(rep, dim=1).float()
    v_BHLD = v_BGLD.repeat_interleave(rep, dim=1).float()
    scores_BHQL = q_BHQD.float() @ k_BHLD.transpose(-1, -2) * q_BHQD.shape[-1] ** -0.5
    scores_BHQL = scores_BHQL.masked_fill(~mask_B1QL, float("-inf"))
    probs_BHQL = torch.softmax(scores_BHQL, dim=-1)
    return (probs_BHQL @ v_BHLD).to(q_BHQD.dtype)
