"""DFlash attention on FlexAttention with a block-sparse BlockMask.

Compiled ONCE per process, at import, with dynamic=False: each (batch, anchors, context) shape from
the trainer's length buckets compiles once and is then a cache hit; a new mask closure per batch
does not recompile (dynamo guards on the closure tensors' shapes, not their values). Never call
these from more than one thread of a process (field fact: cold-cache compiles deadlock across
threads); workers are processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

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


class FlexPlan(NamedTuple):
    """One layer type's plan: its block mask, which kind of layer it is, and the GPU it runs on (the
    kernel options are picked from these when the layer is traced)."""

    block_mask: BlockMask
    kind: str
    """"full" or "sliding"."""
    capability: tuple[int, int] | None
    """CUDA compute capability of the device, None off CUDA."""


TUNED_KERNEL_OPTIONS: dict[tuple[tuple[int, int], int, str], dict[str, Any]] = {}
"""flex kernel options (tile sizes, pipeline stages, warps; fwd_ for the forward kernel, bwd_ for the
backward's) per (compute capability, head dim, layer kind), for bf16 on the DFlash mask. Chosen by
bench/flex_tune.py from measurements on that GPU (docs/BENCHMARKS.md): where no entry matches,
inductor's own defaults for the GPU apply."""


def layer_kind(window: int | None) -> str:
    return "full" if window is None else "sliding"


class FlexBackend:
    name = "flex"

    def __init__(
        self,
        *,
        compile: bool = True,
        tuned: bool = True,
        kernel_options: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        # compile=False is the unfused fallback: it exists so the degraded-kernel guard can be
        # exercised and so a run can opt out knowingly; it is never chosen silently.
        self.compiled = compile
        self._flex = flex_attention_compiled if compile else flex_attention
        self._block_mask = create_block_mask
        self.tuned = tuned
        """Use TUNED_KERNEL_OPTIONS (attention.tuned_kernels); False: inductor's defaults."""
        self.kernel_options_override = (
            {kind: dict(opts) for kind, opts in kernel_options.items()}
            if kernel_options is not None
            else None
        )
        """{kind: options} in place of TUNED_KERNEL_OPTIONS (bench/flex_tune.py tries candidates so)."""

    def kernel_options(self, plan: FlexPlan, head_dim: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The options this layer's flex kernels compile with (None: inductor's defaults)."""
        if self.kernel_options_override is not None:
            return dict(self.kernel_options_override.get(plan.kind) or {}) or None
        if not self.tuned or plan.capability is None or dtype != torch.bfloat16:
            return None
        tuned = TUNED_KERNEL_OPTIONS.get((plan.capability, head_dim, plan.kind))
        return dict(tuned) if tuned else None

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Iterable[int | None],
        sliding_causal: bool = False,
    ) -> dict[int | None, FlexPlan]:
        B, A = anchors_BA.shape
        q_len, kv_len = A * block_size, context_len + A * block_size
        device = anchors_BA.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
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
            block_mask = self._block_mask(mask_mod, B, None, q_len, kv_len, device=device)
            plans[w] = FlexPlan(block_mask, layer_kind(w), capability)
        BLOCK_MASK_SECONDS[0] += time.perf_counter() - t0
        return plans

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: FlexPlan) -> Tensor:
        return self._flex(
            q_BHQD,
            k_BGLD,
            v_BGLD,
            block_mask=plan.block_mask,
            enable_gqa=q_BHQD.shape[1] != k_BGLD.shape[1],
            kernel_options=self.kernel_options(plan, q_BHQD.shape[-1], q_BHQD.dtype),
        )
