"""The hand-written DFlash attention kernels (dflash.step.attention.triton_attention): on the CPU through
Triton's interpreter against float64 autograd of the dense-mask attention, alone and as the flex
backend's kernels (eager and inside a compiled region, as the trainer's layers call them); on the GPU
against flex's own kernels at the 8B head sizes.

The check_* functions run in a process of their own with the interpreter on
(tests/interpreter_helpers.py says why)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch._dynamo
from interpreter_helpers import main, run_interpreted

from dflash.step.attention.flex import FlexBackend, block_mask_and_tables
from dflash.step.attention.mask import dense_mask
from dflash.step.attention.triton_attention import (
    DEFAULT_FWD_TILES,
    DEFAULT_TILES,
    FwdTiles,
    Tiles,
    attention_backward,
    attention_forward,
    forward_schedule,
    schedule,
)

S, K, H, G, D = 600, 4, 4, 2, 16
A = 90  # 360 query rows: two whole sparse blocks of 128 and a part of one; 960 keys: eight blocks
EVEN_S, EVEN_A = 640, 96  # 384 query rows, 1024 keys: whole sparse blocks (the kernels' unbounded loads)


def test_backward_through_the_interpreter():
    """Every check_* below, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def anchors_and_lens(seed: int = 0, context: int = S, num: int = A) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 0 full length; batch 1 shorter, its last 5 blocks padding (-1)."""
    g = torch.Generator().manual_seed(seed)
    a0 = torch.sort(torch.randperm(context - 1, generator=g)[:num] + 1).values
    short = context - 50
    a1 = torch.cat(
        [torch.sort(torch.randperm(short - 1, generator=g)[: num - 5] + 1).values, torch.full((5,), -1)]
    )
    return torch.stack([a0, a1]), torch.tensor([context, short])


def reference(q, k, v, mask_BQL, grad_out):  # noqa: ANN001, ANN201
    """float64 out, natural-log lse and (dq, dk, dv) of the dense-mask attention."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask_BQL[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.repeat_interleave(rep, 1)
    out.backward(grad_out.double())
    return out.detach(), lse.detach(), (q.grad, k.grad, v.grad)


def inputs(seed: int = 0, context: int = S, num: int = A) -> tuple[torch.Tensor, ...]:
    """float32 q, k, v and an output gradient for `num` anchors on a `context`-token context."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, num * K, D, generator=g)
    k = torch.randn(2, G, context + num * K, D, generator=g)
    v = torch.randn(2, G, context + num * K, D, generator=g)
    return q, k, v, torch.randn(q.shape, generator=g)


def layer_layout(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, Q, D] with [B, Q, H, D] memory, as the layer's projections give q and the o_proj's
    backward gives the output's gradient."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def float64_case(window: int | None, causal: bool, even: bool) -> tuple[Any, ...]:
    """(q, k, v, grad_out, tables, (out, lse, (dq, dk, dv)) in float64) for one layer kind; even:
    lengths of whole sparse blocks (the kernels' loads without bounds)."""
    ctx, num = (EVEN_S, EVEN_A) if even else (S, A)
    anchors, lens = anchors_and_lens(context=ctx, num=num)
    q, k, v, grad_out = inputs(context=ctx, num=num)
    kw = dict(context_len=ctx, block_size=K, window=window, causal_block=causal)
    _, tables = block_mask_and_tables(anchors, lens, **kw)
    return q, k, v, grad_out, tables, reference(q, k, v, dense_mask(anchors, lens, **kw), grad_out)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_kernel_matches_float64(window: int | None, causal: bool, tiles: Tiles, even: bool = False) -> None:
    """dq, dk, dv from the float64 forward's output and lse, against float64 autograd; on the full
    layer both tile lists (full and partial sparse blocks) are visited. q and grad_out in the layer's
    layout: q's gradient comes back in it. even: as float64_case's."""
    q, k, v, grad_out, tables, (out, lse, ref) = float64_case(window, causal, even)
    assert int(tables.kv_num.sum()) > 0 and (window is not None or int(tables.full_kv_num.sum()) > 0)
    q_strided = layer_layout(q)
    got = attention_backward(
        layer_layout(grad_out),
        q_strided,
        k,
        v,
        out.float(),
        lse.float(),
        tables,
        scale=D**-0.5,
        sparse=128,
        tiles=tiles,
    )
    assert got[0].stride() == q_strided.stride() and got[1].stride() == k.stride()
    for name, r, x in zip(("dq", "dk", "dv"), ref, got, strict=True):
        assert x.shape == r.shape and x.dtype == torch.float32, name
        assert rel(x, r) < 2e-6, f"{name} {window} {causal} {tiles}: relative error {rel(x, r):.2e}"


def check_forward_matches_float64(
    window: int | None, causal: bool, tiles: FwdTiles, even: bool = False
) -> None:
    """out and the natural-log lse against the float64 dense-mask attention; q in the layer's
    layout, its output in that layout too. even: as float64_case's."""
    q, k, v, _, tables, (ref_out, ref_lse, _) = float64_case(window, causal, even)
    q_strided = layer_layout(q)
    out, lse = attention_forward(q_strided, k, v, tables, scale=D**-0.5, sparse=128, tiles=tiles)
    assert out.stride() == q_strided.stride() and lse.shape == ref_lse.shape
    assert rel(out, ref_out) < 2e-6, f"out {window} {causal} {tiles}: {rel(out, ref_out):.2e}"
    assert rel(lse, ref_lse) < 2e-6, f"lse {window} {causal} {tiles}: {rel(lse, ref_lse):.2e}"


def check_a_row_without_keys_gives_zero_and_minus_inf() -> None:
    """flex's convention for a row whose mask allows nothing: output 0, lse -inf, no NaN anywhere,
    and no gradient into it. The DFlash mask always allows a row its own position, so the row is
    made empty in the tables (its tile is one the kernels mask, so the intervals decide)."""
    anchors, lens = anchors_and_lens()
    q, k, v, grad_out = inputs()
    _, tables = block_mask_and_tables(
        anchors, lens, context_len=S, block_size=K, window=None, causal_block=False
    )
    row = 5
    assert int(tables.full_kv_num[0, 0, 0]) == 0  # the row's tile is only ever masked: the intervals decide
    tables.ctx_hi[0, row] = tables.ctx_lo[0, row]
    tables.own_hi[row] = tables.own_lo[row]  # the own-block table is shared by the batch
    out, lse = attention_forward(q, k, v, tables, scale=D**-0.5, sparse=128)
    assert torch.equal(out[0, :, row], torch.zeros_like(out[0, :, row]))
    assert bool((lse[0, :, row] == float("-inf")).all())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse[1]).all())
    dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, tables, scale=D**-0.5, sparse=128)
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv))
    assert torch.equal(dq[0, :, row], torch.zeros_like(dq[0, :, row]))


def check_forward_schedule_is_every_program_once_longest_first() -> None:
    anchors, lens = anchors_and_lens()
    _, tables = block_mask_and_tables(
        anchors, lens, context_len=S, block_size=K, window=200, causal_block=False
    )
    tiles = FwdTiles(BLOCK_M=64, BLOCK_N=32)
    sched = forward_schedule(tables, H, G, A * K, 128, tiles)
    m = math.ceil(A * K / 64)
    assert sorted(sched.tolist()) == list(range(2 * H * m))
    kv_steps = (tables.kv_num + tables.full_kv_num)[:, 0].tolist()
    works = [kv_steps[e // (H * m)][(e % m) * 64 // 128] for e in sched.tolist()]
    assert works == sorted(works, reverse=True) and works[0] > works[-1]
    assert forward_schedule(tables, H, G, A * K, 128, tiles, order="grid").tolist() == list(range(2 * H * m))
    # grouped: the programs of one (batch, kv head) together, in grid order of the groups, each
    # group's most work first.
    grouped = forward_schedule(tables, H, G, A * K, 128, tiles, order="grouped").tolist()
    group_of = [(e // (H * m), (e // m) % H // (H // G)) for e in grouped]
    assert group_of == sorted(group_of)
    for i in range(0, len(grouped), (H // G) * m):
        w = [kv_steps[e // (H * m)][(e % m) * 64 // 128] for e in grouped[i : i + (H // G) * m]]
        assert w == sorted(w, reverse=True)


def test_tiles_the_kernels_cannot_run_are_refused_before_a_launch():
    """A tile that does not divide the sparse block would straddle two of the plan's blocks: the
    kernels would compute the wrong pairs, so such tiles (a hand-edited table) are refused, named."""
    from dflash.step.attention.triton_attention import check_tiles

    check_tiles(DEFAULT_TILES, 128)
    check_tiles(FwdTiles(BLOCK_M=128, BLOCK_N=16), 128)
    for bad, named in (
        (FwdTiles(BLOCK_M=256), "BLOCK_M"),
        (Tiles(BLOCK_N2=48), "BLOCK_N2"),
        (FwdTiles(BLOCK_N=8), "BLOCK_N"),
    ):
        with pytest.raises(ValueError, match=named) as e:
            check_tiles(bad, 128)
        assert "flex_tuned.json" in str(e.value)
    with pytest.raises(ValueError, match="ORDER"):
        check_tiles(Tiles(ORDER=3), 128)
    with pytest.raises(ValueError, match="TMA 2"):
        check_tiles(FwdTiles(TMA=2), 128)
    anchors, lens = anchors_and_lens()
    q, k, v, _ = inputs()
    _, tables = block_mask_and_tables(
        anchors, lens, context_len=S, block_size=K, window=None, causal_block=False
    )
    with pytest.raises(ValueError, match="BLOCK_M"):  # before any kernel: no interpreter needed
        attention_forward(q, k, v, tables, scale=D**-0.5, sparse=128, tiles=FwdTiles(BLOCK_M=96))


def test_schedules_are_made_once_per_tables_and_go_with_them():
    """A plan's layers of one kind share its tables: the schedule is sorted once for them; another
    launch shape or order, or the tables changed in place, makes its own; the entry goes with the
    tables."""
    import gc

    from dflash.step.attention import triton_attention as ta

    anchors, lens = anchors_and_lens()
    block_mask, tables = block_mask_and_tables(
        anchors, lens, context_len=S, block_size=K, window=None, causal_block=False
    )
    made = []

    def make(x: int) -> torch.Tensor:
        made.append(x)
        return torch.tensor([x])

    first = ta.cached_schedule("forward", tables, (H, 1), lambda: make(1))
    assert ta.cached_schedule("forward", tables, (H, 1), lambda: make(2)) is first
    assert ta.cached_schedule("forward", tables, (H, 2), lambda: make(3)).item() == 3
    assert ta.cached_schedule("backward", tables, (H, 1), lambda: make(4)).item() == 4
    tables.kv_num.add_(0)  # a write bumps the version: made again
    assert ta.cached_schedule("forward", tables, (H, 1), lambda: make(5)).item() == 5
    assert made == [1, 3, 4, 5]
    keys = [k for k in ta._SCHEDULES if k[1] == id(tables.kv_num)]
    assert len(keys) == 4
    del block_mask, tables  # the BlockMask holds the same tile lists
    gc.collect()
    assert not any(k in ta._SCHEDULES for k in keys)


def check_schedule_is_every_program_once_longest_first() -> None:
    anchors, lens = anchors_and_lens()
    _, tables = block_mask_and_tables(
        anchors, lens, context_len=S, block_size=K, window=None, causal_block=False
    )
    tiles = Tiles(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32)
    sched = schedule(tables, H, G, A * K, S + A * K, 128, tiles)
    n_dkv = 2 * G * math.ceil((S + A * K) / 64)
    n_dq = 2 * H * math.ceil(A * K / 64)
    assert sorted(sched.tolist()) == list(range(n_dkv + n_dq))
    # Work per program, recomputed here from the tables: steps over the other side's tiles.
    q_steps = (tables.q_num + tables.full_q_num)[:, 0].tolist()
    kv_steps = (tables.kv_num + tables.full_kv_num)[:, 0].tolist()
    n1, m2 = n_dkv // (2 * G), n_dq // (2 * H)

    def work(e: int) -> int:
        if e < n_dkv:
            b, n = e // (G * n1), e % n1
            return (H // G) * q_steps[b][n * 64 // 128] * (128 // 32) * 4 * 64 * 32 + 4 * 64 * 32
        e -= n_dkv
        b, m = e // (H * m2), e % m2
        return kv_steps[b][m * 64 // 128] * (128 // 32) * 3 * 64 * 32 + 4 * 64 * 32

    works = [work(e) for e in sched.tolist()]
    assert works == sorted(works, reverse=True) and works[0] > works[-1]
    # grouped: each (batch, kv head)'s dK/dV and dQ programs together, groups in turn, most work first.
    grouped = schedule(tables, H, G, A * K, S + A * K, 128, tiles, order="grouped").tolist()
    assert sorted(grouped) == list(range(n_dkv + n_dq))

    def group(e: int) -> tuple[int, int]:
        if e < n_dkv:
            return e // (G * n1), (e // n1) % G
        e -= n_dkv
        return e // (H * m2), (e // m2) % H // (H // G)

    assert [group(e) for e in grouped] == sorted(group(e) for e in grouped)
    size = (n_dkv + n_dq) // (2 * G)
    for i in range(0, len(grouped), size):
        w = [work(e) for e in grouped[i : i + size]]
        assert w == sorted(w, reverse=True)


def check_tma_copies_are_made(*checks: Any) -> None:
    """Each check with TMA tiles, and its launches really took the TMA path: descriptors were made
    (tma_ready falls back to the per-thread loads silently)."""
    from dflash.step.attention import triton_attention as ta

    real, made = ta.tma_descriptor, []

    def counting(x: torch.Tensor, rows: int) -> Any:
        made.append(rows)
        return real(x, rows)

    ta.tma_descriptor = counting
    try:
        for check in checks:
            before = len(made)
            check()
            assert len(made) > before, "no TMA descriptor was made: the per-thread loads ran"
    finally:
        ta.tma_descriptor = real


def check_backend_is_the_kernels(compiled_region: bool) -> None:
    """FlexBackend(kernels="dflash"): dflash's forward and backward, against float64 autograd:
    eagerly, and inside a compiled region as the trainer's layers call them."""
    anchors, lens = anchors_and_lens(seed=1)
    q, k, v, grad_out = inputs(seed=1)
    backend = FlexBackend(compile=False, kernels="dflash")
    plan = backend.prepare(anchors, lens, context_len=S, block_size=K, windows=[200], sliding_causal=True)[
        200
    ]
    mask = dense_mask(anchors, lens, context_len=S, block_size=K, window=200, causal_block=True)
    ref_out, _, ref = reference(q * 2, k, v, mask, grad_out)

    def layer(q, k, v):  # noqa: ANN001, ANN202
        return backend.attend(q * 2, k, v, plan)

    fn = torch.compile(layer, backend="inductor", dynamic=False) if compiled_region else layer
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(qq, kk, vv)
    out.backward(grad_out)
    assert rel(out, ref_out) < 2e-6
    for name, r, x in zip(
        ("dq", "dk", "dv"), (2 * ref[0], ref[1], ref[2]), (qq.grad, kk.grad, vv.grad), strict=True
    ):
        assert x is not None and rel(x, r) < 2e-6, f"{name}: relative error {rel(x, r):.2e}"
    with torch.no_grad():  # no autograd: the same op, the same output
        assert rel(fn(q, k, v), ref_out) < 2e-6


def check_the_op_keeps_a_compiled_layer_one_graph() -> None:
    """dflash's op inside a compiled region: no graph break (a break splits the trainer's compiled
    layer and runs the casts around the op eagerly; measured on the H200 before this test: 4.4 ms of
    copies per 8B step)."""
    anchors, lens = anchors_and_lens(seed=1)
    q, k, v, _ = inputs(seed=1)
    backend = FlexBackend(compile=False, kernels="dflash")
    plan = backend.prepare(anchors, lens, context_len=S, block_size=K, windows=[None])[None]

    def layer(q, k, v):  # noqa: ANN001, ANN202
        return backend.attend((q * 2).to(torch.float32), k, v, plan)

    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    explained = torch._dynamo.explain(layer)(qq, kk, vv)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


CHECKS = {
    "full layer": lambda: check_kernel_matches_float64(None, False, DEFAULT_TILES),
    "sliding layer": lambda: check_kernel_matches_float64(200, False, DEFAULT_TILES),
    "sliding causal, small tiles": lambda: check_kernel_matches_float64(
        200, True, Tiles(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32)
    ),
    "full, tall dq tiles": lambda: check_kernel_matches_float64(
        None, False, Tiles(BLOCK_M1=16, BLOCK_N1=128, BLOCK_M2=32, BLOCK_N2=128)
    ),
    "schedule": check_schedule_is_every_program_once_longest_first,
    "forward, full": lambda: check_forward_matches_float64(None, False, DEFAULT_FWD_TILES),
    "forward, sliding": lambda: check_forward_matches_float64(200, False, FwdTiles(BLOCK_M=128, BLOCK_N=32)),
    "whole blocks, grouped order": lambda: (
        check_kernel_matches_float64(
            None, False, Tiles(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, ORDER=2), True
        ),
        check_forward_matches_float64(200, False, FwdTiles(BLOCK_M=64, BLOCK_N=64, ORDER=2), True),
    ),
    "tma copies": lambda: check_tma_copies_are_made(
        lambda: check_kernel_matches_float64(None, False, DEFAULT_TILES._replace(TMA=1)),
        lambda: check_kernel_matches_float64(
            200, True, Tiles(BLOCK_M1=32, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=32, TMA=1)
        ),
        lambda: check_kernel_matches_float64(
            None, False, Tiles(BLOCK_M1=32, BLOCK_N1=64, ORDER=2, TMA=1), True
        ),
        lambda: check_forward_matches_float64(None, False, DEFAULT_FWD_TILES._replace(TMA=1)),
        lambda: check_forward_matches_float64(200, True, FwdTiles(BLOCK_M=32, BLOCK_N=128, TMA=1), True),
    ),
    "forward, sliding causal": lambda: check_forward_matches_float64(
        200, True, FwdTiles(BLOCK_M=32, BLOCK_N=128)
    ),
    "row without keys": check_a_row_without_keys_gives_zero_and_minus_inf,
    "forward schedule": check_forward_schedule_is_every_program_once_longest_first,
    "backend, eager": lambda: check_backend_is_the_kernels(False),
    "backend, compiled region": lambda: check_backend_is_the_kernels(True),
    "one graph": check_the_op_keeps_a_compiled_layer_one_graph,
}


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 2048])
def test_dflash_kernels_match_flex_on_gpu(window, monkeypatch):
    """At the 8B drafter's head sizes (32/8 heads, head dim 128, bf16, block 16) on a 2 x 4096 context
    with 512 anchors: dflash's out, dq, dk, dv (the table's tiles, and flex's tiles in grouped order) against flex's
    own compiled kernels; and the tiles by TMA copies."""
    torch.manual_seed(0)
    ctx, block, num = 4096, 16, 512
    anchors = torch.stack([torch.sort(torch.randperm(ctx - 1)[:num] + 1).values for _ in range(2)])
    lens = torch.tensor([ctx, ctx])
    anchors[1, -7:] = -1
    q = torch.randn(2, 32, num * block, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 8, ctx + num * block, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    grad_out = torch.randn_like(q)
    kind = "full" if window is None else "sliding"
    grouped = {kind: {"kernel_fwd_ORDER": 2, "kernel_bwd_ORDER": 2}}
    tma = {kind: {"kernel_fwd_TMA": 1, "kernel_bwd_TMA": 1}}  # at the default tiles
    from dflash.step.attention import triton_attention as ta

    made = []
    real = ta.tma_descriptor
    monkeypatch.setattr(ta, "tma_descriptor", lambda x, rows: made.append(rows) or real(x, rows))
    results = []
    for backend in (
        FlexBackend(),
        FlexBackend(kernels="dflash"),
        FlexBackend(kernels="dflash", kernel_options=grouped),
        FlexBackend(kernels="dflash", kernel_options=tma),
    ):
        plan = backend.prepare(
            anchors.cuda(), lens.cuda(), context_len=ctx, block_size=block, windows=[window]
        )
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = backend.attend(qq, kk, vv, plan[window])
        out.backward(grad_out)
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    assert made, "no TMA descriptor was made: the TMA backend ran the per-thread loads"
    for mine in results[1:]:
        for name, f, x in zip(("out", "dq", "dk", "dv"), results[0], mine, strict=True):
            assert rel(x, f) < 5e-3, f"{name}: dflash vs flex relative error {rel(x, f):.2e}"


if __name__ == "__main__":
    main(CHECKS)
