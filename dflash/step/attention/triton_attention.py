"""The DFlash attention as hand-written Triton kernels (forward and backward), their programs run
longest first.

Why: flex's kernels are launched on the grid (tiles, batch, head), and the GPU starts programs in
grid order. On the DFlash mask the work per program is very uneven: in the backward a context key
tile near position 0 is seen by every block anchored after it (on the 8B step, 64 query tiles x 4
heads x 2 = 512 iterations), a block's own key tile by one query tile (8 iterations); in the
forward a query tile of late anchors reads the whole context, one of early anchors a few tiles. The
last (batch, head)'s longest programs then start when most of the launch is done and run alone at
its end: a list schedule of the 8B step's backward in grid order finishes 16% (full layer) / 10%
(sliding) after the ideal (one program per SM), longest-first (LPT) within 0.2%.

These kernels do the same work as flex's (the same block-sparse tiles from the plan's BlockMask,
the same arithmetic per tile to a rounding: scores in float32 and base 2, an online softmax in the
forward, p = exp2(qk * scale * log2 e - lse2) and ds = p * (dp - delta) in the backward, p and ds
rounded to the inputs' dtype for their products) but read their programs from a schedule: every
program's (kind, batch, head, tile), ordered by the tiles it will visit, most first. The forward
returns the output and its natural-log log-sum-exp (as flex's return_aux does), the one thing the
backward needs from it besides the output.

Masking: a tile listed as full is computed unmasked; a partial one through the per-row intervals
of dflash.step.attention.flex.block_mask_and_tables (context [lo, hi) and own block [own_lo, own_hi)), the
pairs that mask allows, no others. A row that allows no key gets output 0 and lse -inf (flex's
convention).

dQ in the backward has programs of its own (per query tile and head, recomputing the scores and
dp: 3 products per tile step). Adding it from the dK/dV programs with float32 atomics instead (one
product per step) was measured on the H200 on 2026-12-03 and lost: 7.55 ms against 4.57 for the
8B step's full layer at the same tiles, 5.13 at its best tiles (docs/BENCHMARKS.md).

On the CPU the job never calls these; the tests run them through Triton's interpreter
(dflash.step.triton_jit) against float64 autograd of the dense-mask reference.

TMA (a tile option, FwdTiles.TMA / Tiles.TMA): the tiles the loops step over come in by bulk copies
through host-side descriptors over the tensors' own strides (tma_descriptor), rows past the end as 0.

Warp specialisation (tl.range(..., warp_specialize=True), what would let the softmax overlap the
products as in FlashAttention-3) does not compile for these kernels on Hopper under Triton 3.6: the
NVGPUWarpSpecialization pass fails (H200, 2026-12-04, docs/BENCHMARKS.md). Gluon
(triton.experimental.gluon) could express that schedule by hand on Hopper. FlashAttention-4's Hopper
kernels already have it (FlashAttention-3's schedule, through flex's BACKEND=FLASH, on this mask, H200,
2026-12-04). Against these kernels they are 18-19% faster forward, 10% faster backward on the full
layer and equal on the sliding ones: 1.44 ms of the 8B step's 24.3 ms of attention alone. That is
not worth a second JIT compiler and a non-deterministic backward in the job (docs/BENCHMARKS.md).

Status (H200, 2026-12-04, docs/BENCHMARKS.md): at the 8B step's shapes, the table's tiles, forward
1.40 ms (full layer, TMA) / 1.16 (sliding, TMA) against flex's 1.50 / 1.26, backward 4.27 (TMA) /
3.55 against flex's 5.03 / 3.97. The job's default on a GPU (attention.flex_kernels = auto).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from dflash.step.triton_jit import jit_per_mode, unit_stride_last


class Tiles(NamedTuple):
    """The kernel's tiles: dK/dV programs hold BLOCK_N1 keys and step over BLOCK_M1 query rows;
    dQ programs hold BLOCK_M2 rows and step over BLOCK_N2 keys. Each divides the sparse block."""

    BLOCK_M1: int = 64
    BLOCK_N1: int = 128
    BLOCK_M2: int = 128
    BLOCK_N2: int = 64
    num_warps: int = 8
    num_stages: int = 2
    ORDER: int = 0
    """The launch order, an index into ORDERS."""
    TMA: int = 0
    """1: the tiles the loops step over (q and dO in dK/dV programs, k and v in dQ programs) come in
    by TMA bulk copies (tma_descriptor) instead of per-thread loads."""

    def programs(self, q_len: int, kv_len: int) -> tuple[int, int]:
        """(key tiles per kv head, query tiles per head): the dK/dV and dQ programs per batch row."""
        return -(-kv_len // self.BLOCK_N1), -(-q_len // self.BLOCK_M2)


class FwdTiles(NamedTuple):
    """The forward's tiles: a program holds BLOCK_M query rows of one head and steps over BLOCK_N
    keys. Each divides the sparse block."""

    BLOCK_M: int = 64
    BLOCK_N: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ORDER: int = 0
    """The launch order, an index into ORDERS."""
    TMA: int = 0
    """1: the key and value tiles come in by TMA bulk copies (tma_descriptor)."""

    def programs(self, q_len: int) -> int:
        """Query tiles per head: the forward's programs per (batch, head)."""
        return -(-q_len // self.BLOCK_M)


DEFAULT_FWD_TILES = FwdTiles()
"""flex's tuned forward tiles for the H200 (dflash/step/attention/flex_tuned.json), the same tile work."""


DEFAULT_TILES = Tiles()
"""flex's tuned backward tiles for the H200 (dflash/step/attention/flex_tuned.json), the same tile work."""

LOG2_E = 1.4426950408889634
"""Scores are taken in base 2: s * scale * log2(e) against the log-sum-exp over ln 2, one multiply
per score (flex multiplies by the scale and by log2(e) one after the other: the same to a rounding)."""

DKV_COST, DQ_COST, PROGRAM_COST = 4, 3, 4
"""Schedule weights: a dK/dV step makes four products of its tile, a dQ step three; a program's
fixed cost (loading its resident tiles, storing its result) counted as this many products."""


class Tables(NamedTuple):
    """What the kernel reads of a plan: the BlockMask's tile lists ([B, 1, ...] int32) and the
    mask's per-row intervals ([B, rows] for the context, [rows] for the own block; rows padded to
    whole sparse blocks)."""

    kv_num: Tensor
    kv_idx: Tensor
    full_kv_num: Tensor
    full_kv_idx: Tensor
    q_num: Tensor
    q_idx: Tensor
    full_q_num: Tensor
    full_q_idx: Tensor
    ctx_lo: Tensor
    ctx_hi: Tensor
    own_lo: Tensor
    own_hi: Tensor

    @property
    def tile_lists(self) -> tuple[Tensor, ...]:
        """The eight BlockMask lists, in BlockMask's own argument order (kv_num ... full_q_idx)."""
        return tuple(self[:8])


@jit_per_mode
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def dflash_attention_delta(
        OUT, DO, DELTA, Q_LEN, HQ, so_z, so_h, so_m, sdo_z, sdo_h, sdo_m, D: tl.constexpr, BLOCK: tl.constexpr
    ):
        """delta = rowsum(o * do) in float32, [B*HQ, Q_LEN]."""
        zh = tl.program_id(1)
        z, h = zh // HQ, zh % HQ
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        ok = rows < Q_LEN
        o = tl.load(
            OUT + z * so_z + h * so_h + rows[:, None] * so_m + cols[None, :], mask=ok[:, None], other=0.0
        )
        do = tl.load(
            DO + z * sdo_z + h * sdo_h + rows[:, None] * sdo_m + cols[None, :], mask=ok[:, None], other=0.0
        )
        tl.store(
            DELTA + zh.to(tl.int64) * Q_LEN + rows,
            tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1),
            mask=ok,
        )

    @triton.jit
    def dflash_attention_forward(
        Q, K, V, KD, VD, OUT, LSE, SCHED,
        KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, CTX_LO, CTX_HI, OWN_LO, OWN_HI,
        sq_z, sq_h, sq_m, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n, so_z, so_h, so_m,
        s_kvnum_z, s_kvidx_z, s_kvidx_m, s_ctx_z,
        HQ, Q_LEN, KV_LEN, M_TILES, QK_SCALE,
        D: tl.constexpr, GQA: tl.constexpr, SPARSE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, TMA: tl.constexpr,
    ):  # fmt: skip
        """out and natural-log lse of BLOCK_M rows of query head h: an online softmax over the
        row tile's partial sparse blocks (masked), then its full ones."""
        LN2: tl.constexpr = 0.6931471805599453
        MULT: tl.constexpr = SPARSE // BLOCK_N
        e = tl.load(SCHED + tl.program_id(0))
        z = e // (HQ * M_TILES)
        h = (e // M_TILES) % HQ
        start_m = (e % M_TILES) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        m_ok = offs_m < Q_LEN
        q_ptrs = Q + z.to(tl.int64) * sq_z + h.to(tl.int64) * sq_h + offs_m[:, None] * sq_m + offs_d[None, :]
        if EVEN:  # every row and key in range: loads without bounds
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
        lo = tl.load(CTX_LO + z * s_ctx_z + offs_m, mask=m_ok, other=0)
        hi = tl.load(CTX_HI + z * s_ctx_z + offs_m, mask=m_ok, other=0)
        olo = tl.load(OWN_LO + offs_m, mask=m_ok, other=0)
        ohi = tl.load(OWN_HI + offs_m, mask=m_ok, other=0)
        g = h // GQA
        k_ptr = K + z.to(tl.int64) * sk_z + g.to(tl.int64) * sk_h
        v_ptr = V + z.to(tl.int64) * sv_z + g.to(tl.int64) * sv_h
        mb = start_m // SPARSE
        m_i = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for part in tl.static_range(2):
            if part == 0:
                num = tl.load(KV_NUM + z * s_kvnum_z + mb)
                idx_ptr = KV_IDX + z * s_kvidx_z + mb * s_kvidx_m
            else:
                num = tl.load(FULL_KV_NUM + z * s_kvnum_z + mb)
                idx_ptr = FULL_KV_IDX + z * s_kvidx_z + mb * s_kvidx_m
            for it in range(0, num * MULT):
                blk = tl.load(idx_ptr + it // MULT)
                start_n = blk * SPARSE + (it % MULT) * BLOCK_N
                offs_n = start_n + tl.arange(0, BLOCK_N)
                kT_ptrs = k_ptr + offs_n[None, :] * sk_n + offs_d[:, None]
                v_ptrs = v_ptr + offs_n[:, None] * sv_n + offs_d[None, :]
                if TMA:  # rows past KV_LEN come in as 0, as the bounded loads' other=0.0
                    kT = tl.trans(KD.load([z, g, start_n, 0]).reshape([BLOCK_N, D]))
                    v = VD.load([z, g, start_n, 0]).reshape([BLOCK_N, D])
                elif EVEN:
                    kT = tl.load(kT_ptrs)
                    v = tl.load(v_ptrs)
                else:
                    n_ok = offs_n < KV_LEN
                    kT = tl.load(kT_ptrs, mask=n_ok[None, :], other=0.0)
                    v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
                s = tl.dot(q, kT) * QK_SCALE
                if part == 0:
                    keys = offs_n[None, :]
                    ok = ((keys >= lo[:, None]) & (keys < hi[:, None])) | (
                        (keys >= olo[:, None]) & (keys < ohi[:, None])
                    )
                    s = tl.where(ok, s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # no key yet: nothing to subtract
                alpha = tl.math.exp2(m_i - m_use)
                p = tl.math.exp2(s - m_use[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        o_ptrs = (
            OUT + z.to(tl.int64) * so_z + h.to(tl.int64) * so_h + offs_m[:, None] * so_m + offs_d[None, :]
        )
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=m_ok[:, None])
        lse = tl.where(empty, -float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(LSE + (z * HQ + h).to(tl.int64) * Q_LEN + offs_m, lse, mask=m_ok)

    @triton.jit
    def dflash_attention_backward(
        Q, K, V, DO, QD, KD, VD, DOD, DQ, DK, DV, LSE, DELTA, SCHED,
        KV_NUM, KV_IDX, FULL_KV_NUM, FULL_KV_IDX, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX,
        CTX_LO, CTX_HI, OWN_LO, OWN_HI,
        sq_z, sq_h, sq_m, sk_z, sk_h, sk_n, sv_z, sv_h, sv_n, sdo_z, sdo_h, sdo_m,
        sdq_z, sdq_h, sdq_m, sdk_z, sdk_h, sdk_n, sdv_z, sdv_h, sdv_n,
        s_kvnum_z, s_kvidx_z, s_kvidx_m, s_qnum_z, s_qidx_z, s_qidx_n, s_ctx_z,
        HQ, HKV, Q_LEN, KV_LEN, N1_TILES, M2_TILES, NUM_DKV, SM_SCALE, QK_SCALE,
        D: tl.constexpr, GQA: tl.constexpr, SPARSE: tl.constexpr,
        BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr,
        EVEN: tl.constexpr, TMA: tl.constexpr,
    ):  # fmt: skip
        RCP_LN2: tl.constexpr = 1.44269504
        MULT1: tl.constexpr = SPARSE // BLOCK_M1
        MULT2: tl.constexpr = SPARSE // BLOCK_N2
        e = tl.load(SCHED + tl.program_id(0))
        offs_d = tl.arange(0, D)
        if e < NUM_DKV:
            # dK, dV of BLOCK_N1 keys of kv head g, over every query head of its group; per head the
            # partial sparse blocks (masked), then the full ones.
            z = e // (HKV * N1_TILES)
            g = (e // N1_TILES) % HKV
            start_n = (e % N1_TILES) * BLOCK_N1
            offs_n = start_n + tl.arange(0, BLOCK_N1)
            n_ok = offs_n < KV_LEN
            k_ptrs = (
                K + z.to(tl.int64) * sk_z + g.to(tl.int64) * sk_h + offs_n[:, None] * sk_n + offs_d[None, :]
            )
            if EVEN:  # every row and key in range: loads without bounds
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
            v_ptrs = (
                V + z.to(tl.int64) * sv_z + g.to(tl.int64) * sv_h + offs_n[:, None] * sv_n + offs_d[None, :]
            )
            if EVEN:
                v = tl.load(v_ptrs)
            else:
                v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
            dk = tl.zeros([BLOCK_N1, D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N1, D], dtype=tl.float32)
            nb = start_n // SPARSE
            for hh in range(0, GQA):
                h = g * GQA + hh
                q_ptr = Q + z.to(tl.int64) * sq_z + h.to(tl.int64) * sq_h
                do_ptr = DO + z.to(tl.int64) * sdo_z + h.to(tl.int64) * sdo_h
                row0 = (z * HQ + h).to(tl.int64) * Q_LEN
                for part in tl.static_range(2):
                    if part == 0:
                        num = tl.load(Q_NUM + z * s_qnum_z + nb)
                        idx_ptr = Q_IDX + z * s_qidx_z + nb * s_qidx_n
                    else:
                        num = tl.load(FULL_Q_NUM + z * s_qnum_z + nb)
                        idx_ptr = FULL_Q_IDX + z * s_qidx_z + nb * s_qidx_n
                    for it in range(0, num * MULT1):
                        blk = tl.load(idx_ptr + it // MULT1)
                        start_m = blk * SPARSE + (it % MULT1) * BLOCK_M1
                        offs_m = start_m + tl.arange(0, BLOCK_M1)
                        m_ok = offs_m < Q_LEN
                        qT_ptrs = q_ptr + offs_m[None, :] * sq_m + offs_d[:, None]
                        do_ptrs = do_ptr + offs_m[:, None] * sdo_m + offs_d[None, :]
                        if TMA:
                            qT = tl.trans(QD.load([z, h, start_m, 0]).reshape([BLOCK_M1, D]))
                            do = DOD.load([z, h, start_m, 0]).reshape([BLOCK_M1, D])
                        elif EVEN:
                            qT = tl.load(qT_ptrs)
                            do = tl.load(do_ptrs)
                        else:
                            qT = tl.load(qT_ptrs, mask=m_ok[None, :], other=0.0)
                            do = tl.load(do_ptrs, mask=m_ok[:, None], other=0.0)
                        lse = tl.load(LSE + row0 + offs_m, mask=m_ok, other=0.0)
                        lse2 = tl.where(lse == -float("inf"), 0.0, lse * RCP_LN2)
                        di = tl.load(DELTA + row0 + offs_m, mask=m_ok, other=0.0)
                        s = tl.dot(k, qT) * QK_SCALE
                        if part == 0:
                            lo = tl.load(CTX_LO + z * s_ctx_z + offs_m, mask=m_ok, other=0)
                            hi = tl.load(CTX_HI + z * s_ctx_z + offs_m, mask=m_ok, other=0)
                            olo = tl.load(OWN_LO + offs_m, mask=m_ok, other=0)
                            ohi = tl.load(OWN_HI + offs_m, mask=m_ok, other=0)
                            keys = offs_n[:, None]
                            ok = ((keys >= lo[None, :]) & (keys < hi[None, :])) | (
                                (keys >= olo[None, :]) & (keys < ohi[None, :])
                            )
                            s = tl.where(ok, s, -float("inf"))
                        pT = tl.math.exp2(s - lse2[None, :])
                        dv += tl.dot(pT.to(do.dtype), do)
                        dpT = tl.dot(v, tl.trans(do))
                        dsT = pT * (dpT - di[None, :])
                        dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT))
            dv_ptrs = (
                DV
                + z.to(tl.int64) * sdv_z
                + g.to(tl.int64) * sdv_h
                + offs_n[:, None] * sdv_n
                + offs_d[None, :]
            )
            tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=n_ok[:, None])
            dk_ptrs = (
                DK
                + z.to(tl.int64) * sdk_z
                + g.to(tl.int64) * sdk_h
                + offs_n[:, None] * sdk_n
                + offs_d[None, :]
            )
            tl.store(dk_ptrs, (dk * SM_SCALE).to(DK.dtype.element_ty), mask=n_ok[:, None])
        else:
            # dQ of BLOCK_M2 rows of query head h: the partial sparse blocks (masked), then the full.
            e2 = e - NUM_DKV
            z = e2 // (HQ * M2_TILES)
            h = (e2 // M2_TILES) % HQ
            start_m = (e2 % M2_TILES) * BLOCK_M2
            offs_m = start_m + tl.arange(0, BLOCK_M2)
            m_ok = offs_m < Q_LEN
            q_ptrs = (
                Q + z.to(tl.int64) * sq_z + h.to(tl.int64) * sq_h + offs_m[:, None] * sq_m + offs_d[None, :]
            )
            if EVEN:
                q = tl.load(q_ptrs)
            else:
                q = tl.load(q_ptrs, mask=m_ok[:, None], other=0.0)
            do_ptrs = (
                DO
                + z.to(tl.int64) * sdo_z
                + h.to(tl.int64) * sdo_h
                + offs_m[:, None] * sdo_m
                + offs_d[None, :]
            )
            if EVEN:
                do = tl.load(do_ptrs)
            else:
                do = tl.load(do_ptrs, mask=m_ok[:, None], other=0.0)
            row0 = (z * HQ + h).to(tl.int64) * Q_LEN
            lse = tl.load(LSE + row0 + offs_m, mask=m_ok, other=0.0)
            lse2 = tl.where(lse == -float("inf"), 0.0, lse * RCP_LN2)
            di = tl.load(DELTA + row0 + offs_m, mask=m_ok, other=0.0)
            lo = tl.load(CTX_LO + z * s_ctx_z + offs_m, mask=m_ok, other=0)
            hi = tl.load(CTX_HI + z * s_ctx_z + offs_m, mask=m_ok, other=0)
            olo = tl.load(OWN_LO + offs_m, mask=m_ok, other=0)
            ohi = tl.load(OWN_HI + offs_m, mask=m_ok, other=0)
            g = h // GQA
            k_ptr = K + z.to(tl.int64) * sk_z + g.to(tl.int64) * sk_h
            v_ptr = V + z.to(tl.int64) * sv_z + g.to(tl.int64) * sv_h
            mb = start_m // SPARSE
            dq = tl.zeros([BLOCK_M2, D], dtype=tl.float32)
            for part in tl.static_range(2):
                if part == 0:
                    num = tl.load(KV_NUM + z * s_kvnum_z + mb)
                    idx_ptr = KV_IDX + z * s_kvidx_z + mb * s_kvidx_m
                else:
                    num = tl.load(FULL_KV_NUM + z * s_kvnum_z + mb)
                    idx_ptr = FULL_KV_IDX + z * s_kvidx_z + mb * s_kvidx_m
                for it in range(0, num * MULT2):
                    blk = tl.load(idx_ptr + it // MULT2)
                    start_n = blk * SPARSE + (it % MULT2) * BLOCK_N2
                    offs_n = start_n + tl.arange(0, BLOCK_N2)
                    kT_ptrs = k_ptr + offs_n[None, :] * sk_n + offs_d[:, None]
                    vT_ptrs = v_ptr + offs_n[None, :] * sv_n + offs_d[:, None]
                    if TMA:
                        kT = tl.trans(KD.load([z, g, start_n, 0]).reshape([BLOCK_N2, D]))
                        vT = tl.trans(VD.load([z, g, start_n, 0]).reshape([BLOCK_N2, D]))
                    elif EVEN:
                        kT = tl.load(kT_ptrs)
                        vT = tl.load(vT_ptrs)
                    else:
                        n_ok = offs_n < KV_LEN
                        kT = tl.load(kT_ptrs, mask=n_ok[None, :], other=0.0)
                        vT = tl.load(vT_ptrs, mask=n_ok[None, :], other=0.0)
                    s = tl.dot(q, kT) * QK_SCALE
                    if part == 0:
                        keys = offs_n[None, :]
                        ok = ((keys >= lo[:, None]) & (keys < hi[:, None])) | (
                            (keys >= olo[:, None]) & (keys < ohi[:, None])
                        )
                        s = tl.where(ok, s, -float("inf"))
                    p = tl.math.exp2(s - lse2[:, None])
                    dp = tl.dot(do, vT)
                    ds = p * (dp - di[:, None])
                    dq += tl.dot(ds.to(kT.dtype), tl.trans(kT))
            dq_ptrs = (
                DQ
                + z.to(tl.int64) * sdq_z
                + h.to(tl.int64) * sdq_h
                + offs_m[:, None] * sdq_m
                + offs_d[None, :]
            )
            tl.store(dq_ptrs, (dq * SM_SCALE).to(DQ.dtype.element_ty), mask=m_ok[:, None])

    return dflash_attention_delta, dflash_attention_backward, dflash_attention_forward


ORDERS = ("longest_first", "grid", "grouped")
"""Launch orders: longest_first: every program by its work, most first (a stable sort: ties keep
the numbering); grid: flex's order (per head, its tiles in turn); grouped: the programs of one
(batch, kv head) together, as in grid order, and within each group most work first: the groups'
K/V (or Q/dO) stay in L2 while their programs run, and each group's long programs start first."""


def ordered(work: Tensor, group: Callable[[], Tensor], order: str) -> Tensor:
    """Program ids (positions in work) in the launch order; group() (made for the grouped order
    only): each program's (batch, kv head)."""
    if order == "longest_first":
        return torch.argsort(work, descending=True, stable=True).to(torch.int32)
    if order == "grouped":
        top = work.max() + 1
        return torch.argsort(group() * top + (top - 1 - work), stable=True).to(torch.int32)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def schedule(
    tables: Tables,
    heads: int,
    kv_heads: int,
    q_len: int,
    kv_len: int,
    sparse: int,
    tiles: Tiles,
    order: str | None = None,
) -> Tensor:
    """The programs of one backward launch in `order` (ORDERS; None: the tiles' ORDER): int32
    entries, dK/dV programs numbered (batch, kv head, key tile) from 0, then dQ programs (batch,
    head, query tile) from their count. Work = the tile steps each will make (from the plan's tile
    lists) weighted by their products, plus a fixed cost per program. order="grid": flex's launch
    order (per kv head, per batch: its dK/dV programs, then the dQ programs of its query heads)."""
    order = ORDERS[tiles.ORDER] if order is None else order
    B = tables.kv_num.shape[0]
    gqa = heads // kv_heads
    n1, m2 = tiles.programs(q_len, kv_len)
    dev = tables.kv_num.device
    if order == "grid":
        gqa_heads = torch.arange(heads, device=dev).view(kv_heads, gqa)
        dkv_ids = torch.arange(B * kv_heads * n1, device=dev).view(B, kv_heads, n1).transpose(0, 1)
        dq_ids = B * kv_heads * n1 + torch.arange(B * heads * m2, device=dev).view(B, heads, m2)
        dq_ids = dq_ids[:, gqa_heads].reshape(B, kv_heads, gqa * m2).transpose(0, 1)
        return torch.cat([dkv_ids, dq_ids], dim=2).reshape(-1).to(torch.int32)
    q_steps_BN = (tables.q_num + tables.full_q_num)[:, 0, :].to(torch.int64)  # [B, key sparse blocks]
    dkv_BN = q_steps_BN[:, torch.arange(n1, device=dev) * tiles.BLOCK_N1 // sparse]
    dkv_BN = dkv_BN * (gqa * (sparse // tiles.BLOCK_M1) * DKV_COST * tiles.BLOCK_N1 * tiles.BLOCK_M1)
    dkv = (dkv_BN[:, None, :] + PROGRAM_COST * tiles.BLOCK_N1 * tiles.BLOCK_M1).expand(B, kv_heads, n1)
    kv_steps_BM = (tables.kv_num + tables.full_kv_num)[:, 0, :].to(torch.int64)  # [B, query sparse blocks]
    dq_BM = kv_steps_BM[:, torch.arange(m2, device=dev) * tiles.BLOCK_M2 // sparse]
    dq_BM = dq_BM * ((sparse // tiles.BLOCK_N2) * DQ_COST * tiles.BLOCK_M2 * tiles.BLOCK_N2)
    dq = (dq_BM[:, None, :] + PROGRAM_COST * tiles.BLOCK_M2 * tiles.BLOCK_N2).expand(B, heads, m2)
    work = torch.cat([dkv.reshape(-1), dq.reshape(-1)])

    def group() -> Tensor:
        zg = torch.arange(B * kv_heads, device=dev).view(B, kv_heads)
        return torch.cat(
            [
                zg[:, :, None].expand(B, kv_heads, n1).reshape(-1),
                zg.repeat_interleave(gqa, dim=1)[:, :, None].expand(B, heads, m2).reshape(-1),
            ]
        )

    return ordered(work, group, order)


def check_tiles(tiles: Tiles | FwdTiles, sparse: int) -> None:
    """Refuse tiles the kernels cannot run: each BLOCK_* must divide the sparse block (a tile never
    straddles two of the plan's blocks) and the order must name one of ORDERS. A hand-edited table
    with other values would otherwise compute the wrong pairs silently."""
    blocks = {f: getattr(tiles, f) for f in tiles._fields if f.startswith("BLOCK_")}
    bad = {f: b for f, b in blocks.items() if b < 16 or sparse % b}
    if bad:
        raise ValueError(
            f"attention tiles {bad} must each divide the sparse block ({sparse}) and be at least 16: "
            "fix the kernel_fwd_*/kernel_bwd_* entries of dflash/step/attention/flex_tuned.json"
        )
    if not 0 <= tiles.ORDER < len(ORDERS):
        raise ValueError(f"attention tile ORDER {tiles.ORDER} is not an index into {ORDERS}")
    if tiles.TMA not in (0, 1):
        raise ValueError(f"attention tile TMA {tiles.TMA} must be 0 or 1")


_SCHEDULES: dict[tuple[Any, ...], tuple[weakref.ref[Tensor], Tensor]] = {}
"""Schedules by (which, the plan's kv_num tensor, its version, the launch's sizes): a plan's layers of
one kind share their tables, so each step sorts its programs once per layer kind and direction, not
once per layer (the sorts were about 0.4 ms of device time per 8B step, measured on the H200)."""


def cached_schedule(which: str, tables: Tables, key: tuple[Any, ...], make: Callable[[], Tensor]) -> Tensor:
    """make()'s schedule, or the one made for the same tables object (alive, unmodified) and key.
    An entry goes when its tables do."""
    anchor = tables.kv_num
    k = (which, id(anchor), anchor._version, *key)
    hit = _SCHEDULES.get(k)
    if hit is not None and hit[0]() is anchor:
        return hit[1]
    sched = make()
    _SCHEDULES[k] = (weakref.ref(anchor, lambda _, k=k: _SCHEDULES.pop(k, None)), sched)
    return sched


def grad_like(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised gradient (or output) for x in x's layout (dimension order by stride, unit
    stride along D: what the kernels store through)."""
    g = torch.empty_like(x, dtype=dtype, memory_format=torch.preserve_format)
    return g if g.stride(-1) == 1 else torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tables: Tables,
    *,
    scale: float,
    sparse: int,
    tiles: Tiles = DEFAULT_TILES,
    order: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of softmax(q k^T * scale, masked by the plan) v, given the forward's output and
    its natural-log log-sum-exp [B, heads, q_len]. q/grad_out/out: [B, heads, q_len, D]; k, v:
    [B, kv_heads, kv_len, D]; any strides with unit stride along D."""
    check_tiles(tiles, sparse)
    delta_rows, backward, _ = _kernels()  # named so that profiles count them as attention
    B, HQ, QL, D = q.shape
    HKV, KL = k.shape[1], k.shape[2]
    q, k, v, grad_out, out = unit_stride_last(q, k, v, grad_out, out)
    lse = lse.contiguous()
    delta = torch.empty(B, HQ, QL, dtype=torch.float32, device=q.device)
    delta_rows[(-(-QL // 64), B * HQ)](
        out, grad_out, delta, QL, HQ, *out.stride()[:3], *grad_out.stride()[:3], D=D, BLOCK=64
    )
    # Each gradient in its input's layout (as flex's backward writes them): the layer's backward
    # then reads them without a transposing copy.
    dq, dk, dv = grad_like(q), grad_like(k), grad_like(v)
    sched = cached_schedule(
        "backward",
        tables,
        (HQ, HKV, QL, KL, sparse, tiles, order),
        lambda: schedule(tables, HQ, HKV, QL, KL, sparse, tiles, order),
    )
    n1, m2 = tiles.programs(QL, KL)
    t = tables
    tma = bool(tiles.TMA) and tma_ready(q, k, v, grad_out)
    backward[(sched.numel(),)](
        q,
        k,
        v,
        grad_out,
        *(
            (
                tma_descriptor(q, tiles.BLOCK_M1),
                tma_descriptor(k, tiles.BLOCK_N2),
                tma_descriptor(v, tiles.BLOCK_N2),
                tma_descriptor(grad_out, tiles.BLOCK_M1),
            )
            if tma
            else (q, k, v, grad_out)
        ),
        dq,
        dk,
        dv,
        lse,
        delta,
        sched,
        *t,  # the kernel's table arguments are Tables' fields, in order
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *grad_out.stride()[:3],
        *dq.stride()[:3],
        *dk.stride()[:3],
        *dv.stride()[:3],
        t.kv_num.stride(0),
        t.kv_idx.stride(0),
        t.kv_idx.stride(2),
        t.q_num.stride(0),
        t.q_idx.stride(0),
        t.q_idx.stride(2),
        t.ctx_lo.stride(0),
        HQ,
        HKV,
        QL,
        KL,
        n1,
        m2,
        B * HKV * n1,
        scale,
        scale * LOG2_E,
        D=D,
        GQA=HQ // HKV,
        SPARSE=sparse,
        BLOCK_M1=tiles.BLOCK_M1,
        BLOCK_N1=tiles.BLOCK_N1,
        BLOCK_M2=tiles.BLOCK_M2,
        BLOCK_N2=tiles.BLOCK_N2,
        EVEN=QL % sparse == 0 and KL % sparse == 0,
        TMA=tma,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return dq, dk, dv


def tma_ready(*ts: Tensor) -> bool:
    """TMA can copy tiles of these [B, heads, rows, D] tensors: 16-byte aligned base and strides
    (the layers' tensors are; a view that is not takes the per-thread loads)."""
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in ts
    )


def tma_descriptor(x: Tensor, rows: int) -> Any:
    """A host-side TMA descriptor of x [B, heads, rows, D] (unit stride along D, any other strides)
    for one head's tiles of `rows` rows: block [1, 1, rows, D]; rows past the end read as 0."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[-1]])


def forward_schedule(
    tables: Tables,
    heads: int,
    kv_heads: int,
    q_len: int,
    sparse: int,
    tiles: FwdTiles,
    order: str | None = None,
) -> Tensor:
    """The forward's programs (batch, head, query tile), numbered in that order from 0, in `order`
    (ORDERS; None: the tiles' ORDER); work = the key tiles each visits, plus one for its fixed cost."""
    order = ORDERS[tiles.ORDER] if order is None else order
    B = tables.kv_num.shape[0]
    m = tiles.programs(q_len)
    dev = tables.kv_num.device
    if order == "grid":
        return torch.arange(B * heads * m, device=dev, dtype=torch.int32)
    kv_steps_BM = (tables.kv_num + tables.full_kv_num)[:, 0, :].to(torch.int64)  # [B, query sparse blocks]
    work_BM = kv_steps_BM[:, torch.arange(m, device=dev) * tiles.BLOCK_M // sparse] + 1  # + its fixed cost
    work = work_BM[:, None, :].expand(B, heads, m).reshape(-1)

    def group() -> Tensor:
        zg = torch.arange(B, device=dev)[:, None] * kv_heads + torch.arange(heads, device=dev) // (
            heads // kv_heads
        )
        return zg[:, :, None].expand(B, heads, m).reshape(-1)

    return ordered(work, group, order)


def attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tables: Tables,
    *,
    scale: float,
    sparse: int,
    tiles: FwdTiles = DEFAULT_FWD_TILES,
    order: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(out, natural-log lse [B, heads, q_len] float32) of softmax(q k^T * scale, masked by the plan)
    v; out in q's layout. q: [B, heads, q_len, D]; k, v: [B, kv_heads, kv_len, D]; any strides with
    unit stride along D."""
    check_tiles(tiles, sparse)
    _, _, forward = _kernels()
    B, HQ, QL, D = q.shape
    HKV, KL = k.shape[1], k.shape[2]
    q, k, v = unit_stride_last(q, k, v)
    out = grad_like(q, v.dtype)
    lse = torch.empty(B, HQ, QL, dtype=torch.float32, device=q.device)
    sched = cached_schedule(
        "forward",
        tables,
        (HQ, HKV, QL, sparse, tiles, order),
        lambda: forward_schedule(tables, HQ, HKV, QL, sparse, tiles, order),
    )
    t = tables
    tma = bool(tiles.TMA) and tma_ready(k, v)
    forward[(sched.numel(),)](
        q,
        k,
        v,
        *((tma_descriptor(k, tiles.BLOCK_N), tma_descriptor(v, tiles.BLOCK_N)) if tma else (k, v)),
        out,
        lse,
        sched,
        t.kv_num,
        t.kv_idx,
        t.full_kv_num,
        t.full_kv_idx,
        t.ctx_lo,
        t.ctx_hi,
        t.own_lo,
        t.own_hi,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *out.stride()[:3],
        t.kv_num.stride(0),
        t.kv_idx.stride(0),
        t.kv_idx.stride(2),
        t.ctx_lo.stride(0),
        HQ,
        QL,
        KL,
        tiles.programs(QL),
        scale * LOG2_E,
        D=D,
        GQA=HQ // HKV,
        SPARSE=sparse,
        BLOCK_M=tiles.BLOCK_M,
        BLOCK_N=tiles.BLOCK_N,
        EVEN=QL % sparse == 0 and KL % sparse == 0,
        TMA=tma,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out, lse
