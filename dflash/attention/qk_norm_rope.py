"""The attention's q/k RMSNorm and rotary embedding as one Triton kernel, forward and backward.

What it replaces (dflash.model.DrafterAttention, as Qwen3 computes it under autocast):
    y = bf16(x * rsqrt(mean(x^2) + eps))     per head, x in float32 from the projection's bf16
    u = w * y                                 float32 (the norm's weight is float32)
    z = u * cos + rotate_half(u) * sin        float32 (cos, sin in the block's dtype)
    out = bf16(z)                             the dtype the attention takes
and its autograd, with the same roundings (the gradient reaching y rounded to bf16, as the float32
x bf16 product's backward rounds it). Compiled by inductor inside the layer, this backward took
3.4 ms of the 8B step for the five layers' q and k (reductions of 1.80 ms in 4 calls and 1.58 in 5,
H200 profile of 2026-12-02 in docs/BENCHMARKS.md), where the bytes it must move (read the gradient
and x, write dx: 2.8 GB per step) take about 0.7 ms at 4 TB/s. Here each program reads its rows
once per pass and sums its share of the weight's gradient, then the partials are summed
(deterministic, no atomics).

Opt-in (attention.fused_qk_norm_rope, with dflash's attention kernels) until it is measured on a GPU.
On the CPU the kernels run only through Triton's interpreter, for the tests
(tests/dflash/test_qk_norm_rope.py: against float64 autograd of the module path, and the drafter
with and without them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflash.triton_jit import interpreted, jit_per_mode

ROWS_PER_PROGRAM = 64
"""Rows (one token's one head: D values) per block of a program."""

PROGRAMS = 1024
"""The backward's programs at most: each sums its rows' share of the weight's gradient into one
[D] partial, and the partials are summed after (1024 x D floats: 0.5 MiB at D = 128)."""


@jit_per_mode
def _kernels() -> Any:
    """(forward, backward): dflash.attention.qk_norm_rope_kernels, loaded afresh for this mode."""
    path = Path(__file__).with_name("qk_norm_rope_kernels.py")
    spec = importlib.util.spec_from_file_location(
        f"dflash.attention.qk_norm_rope_kernels_{interpreted()}", path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qk_norm_rope_forward, module.qk_norm_rope_backward


def applies(x: Tensor, weight: Tensor, cos: Tensor) -> bool:
    """The fused path computes exactly what the module path does for these: a float32 norm weight,
    cos/sin in x's dtype, a power-of-two head dim (its halves are a kernel's block). Metadata only
    (the compiled layer evaluates it while tracing); the device is the attention backend's choice."""
    D = x.shape[-1]
    return weight.dtype == torch.float32 and cos.dtype == x.dtype and D >= 4 and D & (D - 1) == 0


def _unit_d(*ts: Tensor) -> list[Tensor]:
    """The kernels step along D by 1: any other layout is copied (the layer's never is)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def _strides3(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def qk_norm_rope_forward(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """x [B, T, H, D] (unit stride along D), weight [D], cos/sin [B, T, D] -> out [B, T, H, D] in x's
    dtype, contiguous."""
    forward, _ = _kernels()
    x, cos, sin = _unit_d(x, cos, sin)
    assert cos.stride() == sin.stride(), "cos and sin share one layout"
    B, T, H, D = x.shape
    out = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    rows = B * T * H
    forward[(_cdiv(rows, ROWS_PER_PROGRAM),)](
        x, weight, cos, sin, out, rows, H, T,
        *_strides3(x), cos.stride(0), cos.stride(1), *_strides3(out),
        eps, D=D, BLOCK=ROWS_PER_PROGRAM,
    )  # fmt: skip
    return out


def qk_norm_rope_backward(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype and layout [B, T, H, D], dweight float32 [D]) given the output's gradient."""
    _, backward = _kernels()
    grad, x, cos, sin = _unit_d(grad, x, cos, sin)
    assert cos.stride() == sin.stride(), "cos and sin share one layout"
    B, T, H, D = x.shape
    rows = B * T * H
    blocks = _cdiv(rows, ROWS_PER_PROGRAM)
    per_program = _cdiv(blocks, PROGRAMS)
    programs = _cdiv(blocks, per_program)
    dx = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    dw = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    backward[(programs,)](
        grad, x, weight, cos, sin, dx, dw, rows, H, T, per_program,
        *_strides3(grad), *_strides3(x), cos.stride(0), cos.stride(1), *_strides3(dx),
        eps, D=D, BLOCK=ROWS_PER_PROGRAM,
    )  # fmt: skip
    return dx, dw.sum(0).to(weight.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@torch.library.custom_op("dflash::qk_norm_rope", mutates_args=())
def qk_norm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    """RMSNorm over the head dim, then the rotary embedding, of x [B, T, H, D]; see the module's
    docstring. One op, opaque to the compiled layer around it; its backward is the kernel's."""
    return qk_norm_rope_forward(x, weight, cos, sin, eps)


@qk_norm_rope.register_fake
def _(x, weight, cos, sin, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


@torch.library.custom_op("dflash::qk_norm_rope_backward", mutates_args=())
def qk_norm_rope_grad(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of qk_norm_rope."""
    return qk_norm_rope_backward(grad, x, weight, cos, sin, eps)


@qk_norm_rope_grad.register_fake
def _(grad, x, weight, cos, sin, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, weight, cos, sin, eps = inputs
    ctx.save_for_backward(x, weight, cos, sin)
    ctx.eps = eps


def _backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
    x, weight, cos, sin = ctx.saved_tensors
    dx, dw = qk_norm_rope_grad(grad, x, weight, cos, sin, ctx.eps)
    return dx, dw, None, None, None


qk_norm_rope.register_autograd(_backward, setup_context=_setup)
