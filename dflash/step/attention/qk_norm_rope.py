"""The attention's q/k RMSNorm and rotary embedding as one Triton kernel, forward and backward.

What it replaces (dflash.step.model.DrafterAttention, as Qwen3 computes it under autocast):
    y = bf16(x * rsqrt(mean(x^2) + eps))     per head, x in float32 from the projection's bf16
    u = w * y                                 float32 (the norm's weight is float32)
    z = u * cos + rotate_half(u) * sin        float32 (cos, sin float32 in the job: the dtype of the
                                              block's hidden states, which the context's norm makes float32)
    out = bf16(z)                             the dtype the attention takes
and its autograd, with the same roundings (the gradient reaching y rounded to bf16, as the float32
x bf16 product's backward rounds it). Compiled by inductor inside the layer, these took about 3.2 ms
of the 8B step on the H200 (forward and backward, the five layers' q and k), where the bytes they
must move (forward: read x, write out; backward: read the gradient and x, write dx: 4.6 GB per step)
take about 1.2 ms at 4 TB/s. Here each program reads its rows once per pass and sums its share of
the weight's gradient, then the partials are summed (deterministic, no atomics): 1.9 ms per step
(forward 0.72, backward 1.18; the A/B of 2026-12-03 22:26 in docs/BENCHMARKS.md: the step 1.8 ms
faster with it).

On by default wherever dflash's attention kernels run (attention.fused_qk_norm_rope = auto).
On the CPU the kernels run only through Triton's interpreter, for the tests
(tests/dflash/test_qk_norm_rope.py: against float64 autograd of the module path, and the drafter
with and without them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dflash.step.triton_jit import interpreted, jit_per_mode, unit_stride_last


class Launch(NamedTuple):
    """One kernel's launch: rows (one token's one head: D values) per block, warps per program, and
    for the backward the programs at most (0: one row block each; each sums its rows' share of the
    weight's gradient into one [D] partial; the partials are summed after: programs x D floats)."""

    rows: int
    num_warps: int
    programs: int = 0


FORWARD = Launch(rows=16, num_warps=4)
BACKWARD = Launch(rows=16, num_warps=2, programs=4096)
"""Measured on the H200 at the 8B step's q [2, 8192, 32, 128] and k [2, 12288, 8, 128]
(bench/qk_norm_rope.py --sweep, 2026-12-03 22:17 UTC, docs/BENCHMARKS.md): the backward at 16 rows / 2
warps / 4096 programs 0.155 ms (q, 2.6 TB/s) and 0.074 ms (k) against 0.274 and 0.116 at the first
choice (32 rows / 8 warps / 1024 programs: fewer registers, fewer loads in flight a thread); the
forward at 16 rows / 4 warps 0.100 and 0.043 ms (32 / 8: 0.103 and 0.044). Compiled for sm_90 without a
GPU (Triton 3.9's ptxas): the backward 240 registers a thread at 16 rows / 2 warps, the forward 80, no
spills (tests/dflash/test_qk_norm_rope.py keeps it so)."""


@jit_per_mode
def _kernels() -> Any:
    """(forward, backward): dflash.step.attention.qk_norm_rope_kernels, loaded afresh for this mode."""
    path = Path(__file__).with_name("qk_norm_rope_kernels.py")
    spec = importlib.util.spec_from_file_location(
        f"dflash.step.attention.qk_norm_rope_kernels_{interpreted()}", path
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.qk_norm_rope_forward, module.qk_norm_rope_backward


ROUNDING_FREE = (torch.bfloat16, torch.float16, torch.float32)
"""Dtypes whose values float32 holds exactly: the kernels compute in float32 from any of them."""


def head_dim_supported(D: int) -> bool:
    """The head dim's halves are a kernel's block: a power of two, 4 or more."""
    return D >= 4 and D & (D - 1) == 0


def unsupported(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor) -> str | None:
    """Why the kernels would not compute what the module path does for these inputs (None: they
    do). They need a float32 norm weight (the module path's u = w * y is then float32), x, cos and
    sin in float32 or narrower (the module path's float32 arithmetic holds them exactly), and a
    power-of-two head dim (its halves are a kernel's block). Metadata only: the compiled layer
    evaluates it while tracing."""
    D = x.shape[-1]
    if weight.dtype != torch.float32:
        return f"the q/k norm weight is {weight.dtype}, not float32"
    if x.dtype not in ROUNDING_FREE or cos.dtype not in ROUNDING_FREE or sin.dtype != cos.dtype:
        return f"x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}: each must be float32 or narrower, cos and sin alike"
    if not head_dim_supported(D):
        return f"head_dim {D} is not a power of two (4 or more)"
    B, T = x.shape[:2]
    if tuple(cos.shape) != (B, T, D) or tuple(sin.shape) != (B, T, D) or tuple(weight.shape) != (D,):
        return f"shapes x {tuple(x.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}, weight {tuple(weight.shape)}"
    return None


def check(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Refuse inputs the kernels would not compute as the module path does (unsupported says why)."""
    why = unsupported(x, weight, cos, sin)
    if why is not None:
        raise ValueError(f"dflash's q/k norm + rotary kernel cannot take these inputs: {why}")


def _strides3(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def qk_norm_rope_forward(
    x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, launch: Launch = FORWARD
) -> Tensor:
    """x [B, T, H, D] (unit stride along D), weight [D], cos/sin [B, T, D] -> out [B, T, H, D] in x's
    dtype, contiguous."""
    check(x, weight, cos, sin)
    forward, _ = _kernels()
    x, cos, sin = unit_stride_last(x, cos, sin)
    assert cos.stride() == sin.stride(), "cos and sin share one layout"
    B, T, H, D = x.shape
    out = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    rows = B * T * H
    forward[(_cdiv(rows, launch.rows),)](
        x, weight, cos, sin, out, rows, H, T,
        *_strides3(x), cos.stride(0), cos.stride(1), *_strides3(out),
        eps, D=D, BLOCK=launch.rows, num_warps=launch.num_warps,
    )  # fmt: skip
    return out


def backward_grid(rows: int, launch: Launch) -> tuple[int, int]:
    """(programs, row blocks per program) of the backward over `rows` rows: at most launch.programs
    programs (0: one block each), the blocks shared out evenly."""
    blocks = _cdiv(rows, launch.rows)
    per_program = _cdiv(blocks, launch.programs or blocks)
    return _cdiv(blocks, per_program), per_program


def qk_norm_rope_backward(
    grad: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float, launch: Launch = BACKWARD
) -> tuple[Tensor, Tensor]:
    """(dx [B, T, H, D] in x's dtype, contiguous; dweight [D] in the weight's dtype) given the
    output's gradient; on at most `launch.programs` programs (0: one row block per program), each
    looping over its share of row blocks."""
    _, backward = _kernels()
    grad, x, cos, sin = unit_stride_last(grad, x, cos, sin)
    assert cos.stride() == sin.stride(), "cos and sin share one layout"
    B, T, H, D = x.shape
    rows = B * T * H
    programs, per_program = backward_grid(rows, launch)
    dx = torch.empty((B, T, H, D), dtype=x.dtype, device=x.device)
    dw = torch.empty((programs, D), dtype=torch.float32, device=x.device)
    backward[(programs,)](
        grad, x, weight, cos, sin, dx, dw, rows, H, T, per_program,
        *_strides3(grad), *_strides3(x), cos.stride(0), cos.stride(1), *_strides3(dx),
        eps, D=D, BLOCK=launch.rows, num_warps=launch.num_warps,
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
    check(x, weight, cos, sin)
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


def fused_qk_head_dim_problem(head_dim: int) -> str | None:
    """Why dflash's q/k kernel cannot take this head dim (None: it can)."""
    if head_dim_supported(head_dim):
        return None
    return f"needs a power-of-two head_dim (4 or more); this drafter's is {head_dim}: set it false or auto"
