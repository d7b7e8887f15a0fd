"""The Triton kernels of dflash.step.attention.qk_norm_rope (its docstring says what they compute).

Imported only through qk_norm_rope._kernels, which loads a fresh copy per interpreter mode: triton.jit
reads TRITON_INTERPRET when it decorates, and the interpreter finds a kernel's helpers only among its
module's globals (not in a closure), so they live here, with Triton imported at the top.
"""

import triton
import triton.language as tl


@triton.jit
def _rows(R0, ROWS, HEADS, T, BLOCK: tl.constexpr):
    rows = R0 + tl.arange(0, BLOCK)
    h = rows % HEADS
    bt = rows // HEADS
    return rows, rows < ROWS, bt // T, bt % T, h


@triton.jit
def _normed(X, xo, ok, half, eps, D: tl.constexpr):
    """x's halves in float32, 1 / rms per row, and y (x / rms rounded to x's dtype) as float32."""
    dt = X.dtype.element_ty
    x1 = tl.load(X + xo[:, None] + half[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(X + xo[:, None] + D // 2 + half[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)
    y1 = (x1 * r[:, None]).to(dt).to(tl.float32)
    y2 = (x2 * r[:, None]).to(dt).to(tl.float32)
    return x1, x2, r, y1, y2


@triton.jit
def _rope(COS, SIN, co, ok, half, D: tl.constexpr):
    m = ok[:, None]
    c1 = tl.load(COS + co[:, None] + half[None, :], mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(COS + co[:, None] + D // 2 + half[None, :], mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + co[:, None] + half[None, :], mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + co[:, None] + D // 2 + half[None, :], mask=m, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def qk_norm_rope_forward(
    X, W, COS, SIN, OUT, ROWS, HEADS, T,
    sx_b, sx_t, sx_h, sc_b, sc_t, so_b, so_t, so_h,
    eps, D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows, ok, b, t, h = _rows(tl.program_id(0) * BLOCK, ROWS, HEADS, T, BLOCK)
    half = tl.arange(0, D // 2)
    x1, x2, r, y1, y2 = _normed(X, b * sx_b + t * sx_t + h * sx_h, ok, half, eps, D)
    u1 = tl.load(W + half).to(tl.float32)[None, :] * y1
    u2 = tl.load(W + D // 2 + half).to(tl.float32)[None, :] * y2
    c1, c2, s1, s2 = _rope(COS, SIN, b * sc_b + t * sc_t, ok, half, D)
    oo = (b * so_b + t * so_t + h * so_h)[:, None] + half[None, :]
    tl.store(OUT + oo, (u1 * c1 - u2 * s1).to(OUT.dtype.element_ty), mask=ok[:, None])
    tl.store(OUT + oo + D // 2, (u2 * c2 + u1 * s2).to(OUT.dtype.element_ty), mask=ok[:, None])


@triton.jit
def qk_norm_rope_backward(
    G, X, W, COS, SIN, DX, DW, ROWS, HEADS, T, BLOCKS_PER_PROGRAM,
    sg_b, sg_t, sg_h, sx_b, sx_t, sx_h, sc_b, sc_t, sd_b, sd_t, sd_h,
    eps, D: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    half = tl.arange(0, D // 2)
    w1 = tl.load(W + half).to(tl.float32)[None, :]
    w2 = tl.load(W + D // 2 + half).to(tl.float32)[None, :]
    dw1 = tl.zeros([D // 2], dtype=tl.float32)
    dw2 = tl.zeros([D // 2], dtype=tl.float32)
    for i in range(0, BLOCKS_PER_PROGRAM):
        rows, ok, b, t, h = _rows((pid * BLOCKS_PER_PROGRAM + i) * BLOCK, ROWS, HEADS, T, BLOCK)
        x1, x2, r, y1, y2 = _normed(X, b * sx_b + t * sx_t + h * sx_h, ok, half, eps, D)
        c1, c2, s1, s2 = _rope(COS, SIN, b * sc_b + t * sc_t, ok, half, D)
        go = (b * sg_b + t * sg_t + h * sg_h)[:, None] + half[None, :]
        g1 = tl.load(G + go, mask=ok[:, None], other=0.0).to(tl.float32)
        g2 = tl.load(G + go + D // 2, mask=ok[:, None], other=0.0).to(tl.float32)
        # z1 = u1 c1 - u2 s1, z2 = u2 c2 + u1 s2
        gu1 = g1 * c1 + g2 * s2
        gu2 = g2 * c2 - g1 * s1
        dw1 += tl.sum(gu1 * y1, 0)
        dw2 += tl.sum(gu2 * y2, 0)
        gy1 = (gu1 * w1).to(X.dtype.element_ty).to(tl.float32)
        gy2 = (gu2 * w2).to(X.dtype.element_ty).to(tl.float32)
        # y = x * r, r = (mean(x^2) + eps)^-1/2: dx = r gy - x r^3 sum(gy x) / D
        c = r * r * r * (tl.sum(gy1 * x1, 1) + tl.sum(gy2 * x2, 1)) / D
        do = (b * sd_b + t * sd_t + h * sd_h)[:, None] + half[None, :]
        tl.store(DX + do, (r[:, None] * gy1 - x1 * c[:, None]).to(DX.dtype.element_ty), mask=ok[:, None])
        tl.store(
            DX + do + D // 2, (r[:, None] * gy2 - x2 * c[:, None]).to(DX.dtype.element_ty), mask=ok[:, None]
        )
    tl.store(DW + pid * D + half, dw1)
    tl.store(DW + pid * D + D // 2 + half, dw2)
