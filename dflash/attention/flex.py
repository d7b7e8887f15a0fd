"""DFlash attention on FlexAttention with a block-sparse BlockMask.

Compiled ONCE per process, at import, with dynamic=False: each (batch, anchors, context) shape from
the trainer's length buckets compiles once and is then a cache hit; a new mask closure per batch
does not recompile (dynamo guards on the closure tensors' shapes, not their values). Never call
these from more than one thread of a process (field fact: cold-cache compiles deadlock across
threads); workers are processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflash.attention.mask import dflash_mask_mod, layer_masks

flex_attention_compiled = torch.compile(flex_attention, dynamic=False)
# create_block_mask runs eagerly: at the production shape (8192 queries x 11264 keys) the compiled
# version spent over 150 s in Triton compilation on an H200 (2026-11-29) without finishing, while
# the eager build materialises one [Q, KV] bool grid (~92 MB), once per batch per layer type.


BLOCK_MASK_SECONDS = [0.0]
"""Wall seconds this process spent building block masks (eager create_block_mask): dflash.warm
reports it in its per-shape compile-time breakdown."""


class FlexBackend:
    name = "flex"

    def __init__(self, *, compile: bool = True) -> None:
        # compile=False is the unfused fallback: it exists so the degraded-kernel guard can be
        # exercised and so a run can opt out knowingly; it is never chosen silently.
        self.compiled = compile
        self._flex = flex_attention_compiled if compile else flex_attention
        self._block_mask = create_block_mask

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Iterable[int | None],
        sliding_causal: bool = False,
    ) -> dict[int | None, BlockMask]:
        B, A = anchors_BA.shape
        q_len, kv_len = A * block_size, context_len + A * block_size
        plans = {}
        t0 = time.perf_counter()
        for w, causal in layer_masks(windows, sliding_causal).items():
            mask_mod = dflash_mask_mod(
                anchors_BA,
                seq_lens_B,
                context_len=context_len,
                block_size=block_size,
                window=w,
                causal_block=causal,
            )
            plans[w] = self._block_mask(mask_mod, B, None, q_len, kv_len, device=anchors_BA.device)
        BLOCK_MASK_SECONDS[0] += time.perf_counter() - t0
        return plans

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, block_mask: BlockMask) -> Tensor:
        return self._flex(
            q_BHQD, k_BGLD, v_BGLD, block_mask=block_mask, enable_gqa=q_BHQD.shape[1] != k_BGLD.shape[1]
        )
