"""DFlash attention: one mask (mask.py), several backends chosen in one place (`make_backend`).

Every backend has the same two calls:
  prepare(anchors_BA, seq_lens_B, context_len=S, block_size=K, windows=[...], sliding_causal=False)
      -> {window: plan} once per batch; one plan per layer type (window None = full layer), shared
      across layers; sliding_causal makes the sliding layers causal inside each block;
  attend(q_BHQD, k_BGLD, v_BGLD, plan) -> o_BHQD
      q from the A*K block tokens; k/v over [S context positions | A*K block tokens].
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

BACKENDS = ("flex", "sdpa", "eager")


class AttentionBackend(Protocol):
    name: str
    fused_qk_norm_rope: bool
    """The layers' q/k RMSNorm + rotary embedding go through dflash.step.attention.qk_norm_rope's kernels
    (attention.fused_qk_norm_rope: with dflash's own attention kernels only)."""

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Any,
        sliding_causal: bool = False,
    ) -> dict[int | None, Any]: ...

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: Any) -> Tensor: ...
