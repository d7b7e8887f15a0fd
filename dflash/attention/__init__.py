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
    """The layers' q/k RMSNorm + rotary embedding go through dflash.attention.qk_norm_rope's kernels
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


def make_backend(
    name: str,
    *,
    sdpa_chunk_blocks: int = 64,
    compile: bool = True,
    tuned_kernels: bool = True,
    flex_kernels: str = "flex",
    fused_qk_norm_rope: bool = False,
) -> AttentionBackend:
    """flex | sdpa | eager. Imports lazily: flex compiles at import, which sdpa-only runs skip.
    tuned_kernels: flex uses the kernel options measured for this GPU (flex.TUNED_KERNEL_OPTIONS);
    flex_kernels: flex's own kernels or dflash's hand-written ones (dflash.attention.triton_attention);
    fused_qk_norm_rope: with dflash's, the q/k norm + rotary embedding too (dflash.attention.qk_norm_rope)."""
    if name == "flex":
        from dflash.attention.flex import FlexBackend

        return FlexBackend(
            compile=compile, tuned=tuned_kernels, kernels=flex_kernels, fused_qk_norm_rope=fused_qk_norm_rope
        )
    if name == "sdpa":
        from dflash.attention.sdpa import SdpaBackend

        return SdpaBackend(chunk_blocks=sdpa_chunk_blocks)
    if name == "eager":
        from dflash.attention.reference import EagerBackend

        return EagerBackend()
    raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
