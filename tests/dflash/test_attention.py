"""Backends against the eager dense-mask reference: sdpa fwd+bwd and flex fwd on CPU, flex vs sdpa on CUDA."""

from __future__ import annotations

import pytest
import torch

from dflash.step.model import make_backend

S, K, H, G, D = 100, 7, 4, 2, 16
ANCHORS = torch.tensor([[0, 3, 50, 99, -1], [1, 10, 20, 40, 60]])
SEQ_LENS = torch.tensor([100, 45])
WINDOWS = [None, 13, 64, 1000]


def inputs(
    device="cpu",
    dtype=torch.float32,
    anchors=ANCHORS,
    seq_lens=SEQ_LENS,
    context=S,
    block=K,
    heads=H,
    kv_heads=G,
    head_dim=D,
    seed=0,
):
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, A = anchors.shape
    q = torch.randn(B, heads, A * block, head_dim, generator=g).to(device, dtype)
    k = torch.randn(B, kv_heads, context + A * block, head_dim, generator=g).to(device, dtype)
    v = torch.randn(B, kv_heads, context + A * block, head_dim, generator=g).to(device, dtype)
    return q, k, v, anchors.to(device), seq_lens.to(device)


def run(backend, q, k, v, anchors, seq_lens, window, context=S, block=K, sliding_causal=False):
    plans = backend.prepare(
        anchors,
        seq_lens,
        context_len=context,
        block_size=block,
        windows=[window],
        sliding_causal=sliding_causal,
    )
    return backend.attend(q, k, v, plans[window])


@pytest.mark.parametrize(
    "window,chunk_blocks,sliding_causal",
    [(w, c, False) for w in WINDOWS for c in (1, 2, 64)] + [(13, 1, True), (13, 64, True), (None, 2, True)],
)
def test_sdpa_matches_eager_forward_and_backward(window, chunk_blocks, sliding_causal):
    eager, sdpa = make_backend("eager"), make_backend("sdpa", sdpa_chunk_blocks=chunk_blocks)
    q, k, v, anchors, seq_lens = inputs()
    grad_out = torch.randn_like(q)
    results = []
    for backend in (eager, sdpa):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = run(backend, qq, kk, vv, anchors, seq_lens, window, sliding_causal=sliding_causal)
        (out * grad_out).sum().backward()
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for name, ref, got in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_sdpa_ignores_padding_content():
    """Keys at padded context positions (>= seq_len) and future positions must not change the output."""
    sdpa = make_backend("sdpa", sdpa_chunk_blocks=2)
    q, k, v, anchors, seq_lens = inputs()
    base = run(sdpa, q, k, v, anchors, seq_lens, None)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 45:S] = 1e4
    v2[1, :, 45:S] = 1e4
    torch.testing.assert_close(run(sdpa, q, k2, v2, anchors, seq_lens, None), base)


@torch.no_grad()
def test_flex_forward_matches_eager_on_cpu():
    """Compiled flex on CPU (forward only: flex has no CPU backward), one shape for both layer types."""
    eager, flex = make_backend("eager"), make_backend("flex")
    q, k, v, anchors, seq_lens = inputs()
    for causal in (False, True):
        kw = dict(context_len=S, block_size=K, windows=[None, 13], sliding_causal=causal)
        plans_ref = eager.prepare(anchors, seq_lens, **kw)
        plans = flex.prepare(anchors, seq_lens, **kw)
        for window in (None, 13):
            ref = eager.attend(q, k, v, plans_ref[window])
            got = flex.attend(q, k, v, plans[window])
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # The causal sliding plan really differs from the bidirectional one (and the full layer does not).
    both = [
        eager.prepare(anchors, seq_lens, context_len=S, block_size=K, windows=[None, 13], sliding_causal=c)
        for c in (False, True)
    ]
    assert torch.equal(both[0][None], both[1][None]) and not torch.equal(both[0][13], both[1][13])


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_flex_matches_sdpa_forward_and_backward_on_cuda(window):
    torch.manual_seed(0)
    context, block, A = 1000, 16, 40
    seq_lens = torch.tensor([context, context - 100])
    # Batch 1 is shorter and ends in 3 padded (-1) blocks.
    anchors = torch.stack(
        [
            torch.sort(torch.randperm(context)[:A]).values,
            torch.cat([torch.sort(torch.randperm(context - 100)[: A - 3]).values, torch.full((3,), -1)]),
        ]
    )
    q, k, v, anchors, seq_lens = inputs("cuda", torch.bfloat16, anchors, seq_lens, context, block, 32, 8, 128)
    grad_out = torch.randn_like(q)
    results = []
    for backend in (make_backend("sdpa", sdpa_chunk_blocks=8), make_backend("flex")):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = run(backend, qq, kk, vv, anchors, seq_lens, window, context, block)
        (out.float() * grad_out.float()).sum().backward()
        results.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for name, ref, got in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, f"{name}: flex vs sdpa relative error {rel:.2e}"


def _block_sets(num, idx):  # noqa: ANN001, ANN202
    """{(b, q_tile): set of kv tiles} of a BlockMask's (num, indices) pair."""
    out = {}
    for b in range(num.shape[0]):
        for q in range(num.shape[2]):
            out[b, q] = set(idx[b, 0, q, : int(num[b, 0, q])].tolist())
    return out


@pytest.mark.parametrize("seed", range(4))
def test_closed_form_block_mask_equals_create_block_mask(seed):
    """block_mask_and_tables computes the BlockMask from the anchors; create_block_mask evaluates the
    mask_mod on every pair. Same partial and full tiles, both directions, for full and sliding layers,
    causal blocks, padded (-1) anchors, short rows and shapes that are not tile multiples."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.step.attention.flex import block_mask_and_tables
    from dflash.step.attention.mask import dflash_mask_mod

    g = torch.Generator().manual_seed(seed)
    K = (16, 7, 16, 4)[seed]
    S = (512, 300, 1024, 129)[seed]
    A = (40, 30, 64, 50)[seed]
    seq_lens = torch.tensor([S, S - 77, S // 3])
    anchors = torch.stack(
        [
            torch.sort(torch.randperm(int(n) - 1, generator=g)[:A] + 1).values
            for n in seq_lens.clamp(min=A + 2)
        ]
    )
    anchors[1, -5:] = -1
    anchors[2] = torch.where(anchors[2] < seq_lens[2], anchors[2], torch.full_like(anchors[2], -1))
    for window in (None, 100, 1000):
        for causal in (False, True):
            mod = dflash_mask_mod(
                anchors, seq_lens, context_len=S, block_size=K, window=window, causal_block=causal
            )
            ref = create_block_mask(mod, 3, None, A * K, S + A * K, device="cpu")
            got, _ = block_mask_and_tables(
                anchors,
                seq_lens,
                context_len=S,
                block_size=K,
                window=window,
                causal_block=causal,
            )
            where = f"K={K} S={S} window={window} causal={causal}"
            assert got.shape == ref.shape, where
            # Its own mask_mod allows exactly dflash_mask_mod's pairs, flex's padded grid included.
            rows, cols = got.kv_num_blocks.shape[-1] * 128, got.kv_indices.shape[-1] * 128
            grid = (
                torch.arange(3)[:, None, None, None],
                torch.zeros(1, 1, 1, 1, dtype=torch.long),
                torch.arange(rows)[None, None, :, None],
                torch.arange(cols)[None, None, None, :],
            )
            allowed = got.mask_mod(*grid)
            assert allowed.shape == (3, 1, rows, cols) and allowed.any(), where
            assert torch.equal(allowed, mod(*grid)), where
            for attr in ("kv", "full_kv", "q", "full_q"):
                num, idx = getattr(got, f"{attr}_num_blocks"), getattr(got, f"{attr}_indices")
                rnum, ridx = getattr(ref, f"{attr}_num_blocks"), getattr(ref, f"{attr}_indices")
                assert torch.equal(num, rnum), f"{attr}_num_blocks differ, {where}"
                assert _block_sets(num, idx) == _block_sets(rnum, ridx), f"{attr}_indices differ, {where}"


def test_tuned_kernel_options_are_picked_by_gpu_head_dim_and_layer_kind(tmp_path):
    """The shipped table parses, holds only flex option names and dflash's kernels' tile fields, and is used only where it matches:
    a CUDA plan of that capability and head dim in bf16, with attention.tuned_kernels on."""
    import json

    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.step.attention.flex import TUNED_TABLE, FlexBackend, FlexPlan, kernel_tiles, load_tuned
    from dflash.step.attention.triton_attention import FwdTiles, Tiles, check_tiles

    shipped = load_tuned(TUNED_TABLE)
    assert shipped, "dflash/step/attention/flex_tuned.json is missing or empty"
    for opts in shipped.values():
        # flex's own options, and dflash's kernels' tiles named by their fields
        flex_keys = [k for k in opts if not k.startswith("kernel_")]
        assert all(k.startswith(("fwd_", "bwd_")) or k.isupper() for k in flex_keys), opts
        fwd = {k.removeprefix("kernel_fwd_") for k in opts if k.startswith("kernel_fwd_")}
        bwd = {k.removeprefix("kernel_bwd_") for k in opts if k.startswith("kernel_bwd_")}
        assert fwd <= set(FwdTiles._fields) and bwd <= set(Tiles._fields), opts
        assert len(fwd) + len(bwd) + len(flex_keys) == len(opts), opts
        picked_fwd, picked_bwd = kernel_tiles(opts)
        assert all(getattr(picked_fwd, f) == opts[f"kernel_fwd_{f}"] for f in fwd)
        assert all(getattr(picked_bwd, f) == opts[f"kernel_bwd_{f}"] for f in bwd)
        check_tiles(picked_fwd, 128)  # the kernels can run them
        check_tiles(picked_bwd, 128)
    table = tmp_path / "t.json"
    opts = {"fwd_BLOCK_M": 64, "bwd_num_warps": 8}
    table.write_text(
        json.dumps({"entries": [{"capability": [9, 0], "head_dim": 128, "kind": "sliding", "options": opts}]})
    )
    tuned = load_tuned(table)
    assert tuned == {((9, 0), 128, "sliding"): opts}
    assert load_tuned(tmp_path / "absent.json") == {}
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, 128, 128, device="cpu")
    import dflash.step.attention.flex as flex

    saved = flex.TUNED_KERNEL_OPTIONS
    flex.TUNED_KERNEL_OPTIONS = tuned
    try:
        on, off = FlexBackend(), FlexBackend(tuned=False)
        sliding = FlexPlan(bm, "sliding", (9, 0))
        assert on.kernel_options(sliding, 128, torch.bfloat16) == opts
        assert off.kernel_options(sliding, 128, torch.bfloat16) is None
        assert on.kernel_options(FlexPlan(bm, "full", (9, 0)), 128, torch.bfloat16) is None
        assert on.kernel_options(FlexPlan(bm, "sliding", (8, 0)), 128, torch.bfloat16) is None
        assert on.kernel_options(sliding, 256, torch.bfloat16) is None
        assert on.kernel_options(sliding, 128, torch.float32) is None
        assert on.kernel_options(FlexPlan(bm, "sliding", None), 128, torch.bfloat16) is None
        forced = FlexBackend(kernel_options={"full": {"fwd_BLOCK_M": 32}})
        assert forced.kernel_options(FlexPlan(bm, "full", None), 16, torch.float32) == {"fwd_BLOCK_M": 32}
    finally:
        flex.TUNED_KERNEL_OPTIONS = saved


def test_sdpa_context_slices_take_few_widths_and_keep_every_needed_key():
    """The sdpa backend widens each chunk's context slice (the extra keys are masked): every slice
    still covers the keys its blocks need, stays inside the context, and takes only widths that are
    multiples of SLICE_WIDTH_MULTIPLE or the whole context: a handful of cuDNN plans, not one per
    batch."""
    from dflash.step.attention.sdpa import SLICE_WIDTH_MULTIPLE, widen

    S = 4096
    widths = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(2000):
        lo, hi = sorted(torch.randint(0, S + 1, (2,), generator=gen).tolist())
        a, b = widen(lo, hi, S)
        assert 0 <= a <= lo and hi <= b <= S, (lo, hi, a, b)
        assert (b - a) % SLICE_WIDTH_MULTIPLE == 0 or b - a == S
        widths.add(b - a)
    assert len(widths) <= S // SLICE_WIDTH_MULTIPLE + 1
    assert widen(0, 0, S) == (0, 0) and widen(0, 100, 300) == (0, 300)
