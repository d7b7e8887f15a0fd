"""The loss chunk's elementwise work as one hand-written Triton kernel (the GPU's fused loss).

Per row of a chunk's [C, V] logits, one program makes two passes over the vocabulary:
  1. an online logsumexp, rescaled once per tile of BLOCK logits (not per element), with the
     argmax of the row (the first index of its maximum, as torch.argmax) from the same tiles;
  2. the gradient w * (softmax - onehot), written over the logits in place (the caller drops the
     logits as soon as it has the gradient, so no second [C, V] buffer is allocated).
Two reads and one write of the bf16 logits. The compiled chunk function (dflash.step.objective's
chunk_cross_entropy under torch.compile) reads them three times and was bound by its per-element
arithmetic on the H200 (7.7 ms of the 8B step for 2 x 8192 rows, docs/BENCHMARKS.md).

Softmax and cross-entropy in float32, the same maths as chunk_cross_entropy; only the order of the
float32 sums differs (the test compares both against a float64 reference). On the CPU the job never
calls this (the compiled or eager chunk runs there); the CPU tests run it through Triton's
interpreter (dflash.step.triton_jit).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.step.triton_jit import jit_per_mode, on_kernel_device

BLOCK = 2048
"""Logits per tile: each pass loads a row in tiles of this many. Chosen by bench/head_loss.py
--ce-sweep on the H200 (2026-12-02, 8192 x 151936 bf16 logits): tile 2048 with 4 warps 2.09 ms
(3.6 TB/s counted as three passes), 4096 / 8 warps 2.22, 8192 / 16 warps 2.32; the compiled chunk
function 3.47 ms."""
NUM_WARPS = 4

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def supports(logits_CV: torch.Tensor, ce_dtype: torch.dtype) -> bool:
    """Whether the kernel computes this chunk: CUDA logits (CPU ones under the interpreter) of a
    kernel dtype, float32 softmax, rows of unit stride (the head's matmul output is)."""
    return (
        on_kernel_device(logits_CV)
        and logits_CV.dtype in KERNEL_DTYPES
        and ce_dtype == torch.float32
        and logits_CV.dim() == 2
        and logits_CV.stride(1) == 1
    )


@jit_per_mode
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def ce_rows(
        logits_ptr,
        row_stride,
        y_ptr,
        w_ptr,
        loss_ptr,
        correct_ptr,
        V,
        WANT_GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        y = tl.load(y_ptr + row).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        cols = tl.arange(0, BLOCK)
        # Pass 1: running max m, running sum s of exp(x - m), first index of the max.
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m, best = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best = best.to(tl.int64)
        s = tl.sum(tl.exp(x - m), axis=0)
        for start in range(BLOCK, V, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            tile_max, tile_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            m_new = tl.maximum(m, tile_max)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            # Strictly greater: an equal maximum in a later tile keeps the earlier index.
            best = tl.where(tile_max > m, start + tile_arg.to(tl.int64), best)
            m = m_new
        lse = m + tl.log(s)
        picked = tl.load(base + y).to(tl.float32)
        tl.store(loss_ptr + row, (lse - picked) * w)
        tl.store(correct_ptr + row, (best == y).to(tl.int8))
        if WANT_GRAD:
            # Pass 2: dL/dlogits = w * (exp(x - lse) - [col == y]), over the logits.
            for start in range(0, V, BLOCK):
                offs = start + cols
                inside = offs < V
                x = tl.load(base + offs, mask=inside, other=0.0).to(tl.float32)
                p = tl.exp(x - lse)
                g = tl.where(offs == y, p - 1.0, p) * w
                tl.store(base + offs, g.to(logits_ptr.dtype.element_ty), mask=inside)

    return ce_rows


def chunk_cross_entropy_kernel(
    logits_CV: torch.Tensor,
    y_C: torch.Tensor,
    w_C: torch.Tensor,
    want_grad: bool,
    *,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """chunk_cross_entropy's (sum of w * CE, top-1 hit per row, dL/dlogits or None) for float32
    softmax, by the kernel. With want_grad the gradient is returned IN the logits' storage: the
    logits are consumed."""
    C, V = logits_CV.shape
    loss_C = torch.empty(C, dtype=torch.float32, device=logits_CV.device)
    correct_C = torch.empty(C, dtype=torch.int8, device=logits_CV.device)
    if C:
        _kernel()[(C,)](
            logits_CV,
            logits_CV.stride(0),
            y_C.contiguous(),
            w_C.to(torch.float32).contiguous(),
            loss_C,
            correct_C,
            V,
            WANT_GRAD=want_grad,
            BLOCK=block,
            num_warps=num_warps,
        )
    return loss_C.sum(), correct_C.view(torch.bool), logits_CV if want_grad else None
