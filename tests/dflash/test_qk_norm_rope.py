"""dflash.attention.qk_norm_rope: the q/k RMSNorm + rotary embedding kernels, through Triton's
interpreter on the CPU against autograd of the module path (Qwen3RMSNorm, apply_rotary_pos_emb), in
float64 and with the job's bf16 roundings, alone, as a compiled layer calls them, and in the drafter;
on the GPU against the module path at the 8B drafter's sizes. The check_* functions run in a process
of their own with the interpreter on (tests/interpreter_helpers.py says why)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from interpreter_helpers import main, run_interpreted
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from dflash.attention.flex import FlexBackend
from dflash.attention.qk_norm_rope import applies, qk_norm_rope
from dflash.model import rms_norm

EPS = 1e-6


def test_kernels_through_the_interpreter():
    """Every check_* below, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def case(dtype: torch.dtype, B: int = 2, T: int = 7, H: int = 3, D: int = 64, seed: int = 0):  # noqa: ANN201
    """x [B, T, H, D] as a projection's view (a slice of a wider row: not contiguous), a float32
    weight near 1, cos/sin of rotary angles in x's dtype [B, T, D], and the output's gradient in
    the attention backward's layout ([B, H, T, D] memory)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, H * D + 8, generator=g).to(dtype)
    x = wide[..., 8:].view(B, T, H, D)
    weight = 1 + 0.1 * torch.randn(D, generator=g)
    pos = torch.randint(0, 4096, (B, T), generator=g).double()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    grad = torch.randn(B, H, T, D, generator=g).to(dtype).transpose(1, 2)
    return x, weight, cos, sin, grad


def module_path(x, weight, cos, sin, grad, dtype: torch.dtype):  # noqa: ANN001, ANN201
    """out, dx, dweight as DrafterAttention's module path computes them, in `dtype` (float64: no
    roundings; x's dtype: the job's)."""
    x = x.detach().to(dtype if dtype == torch.float64 else x.dtype).requires_grad_()
    w = weight.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    c, s = (t.to(x.dtype) for t in (cos, sin))
    y = rms_norm(x, w, EPS).transpose(1, 2)
    out, _ = apply_rotary_pos_emb(y, y, c, s)
    out = out.to(x.dtype).transpose(1, 2)
    out.backward(grad.to(x.dtype))
    return out.detach(), x.grad, w.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_op(x, weight, cos, sin, grad):  # noqa: ANN001, ANN201
    xx, ww = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = qk_norm_rope(xx, ww, cos, sin, EPS)
    out.backward(grad)
    return out.detach(), xx.grad, ww.grad


def check_float32_matches_float64() -> None:
    """Without roundings to a narrower dtype the kernels are the float64 math to float32's precision;
    rows not a whole block of the program (2 x 7 x 3 = 42 of 64), x strided, the gradient transposed."""
    x, weight, cos, sin, grad = case(torch.float32)
    assert applies(x, weight, cos)
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.float64)
    assert got[0].dtype == torch.float32 and got[1].shape == x.shape and got[2].shape == weight.shape
    for name, a, b in zip(("out", "dx", "dweight"), got, ref, strict=True):
        assert rel(a, b) < 1e-5, f"{name}: relative error {rel(a, b):.2e}"


def check_bf16_rounds_as_the_module_path() -> None:
    """x and cos/sin in bf16, the weight float32 (the job's dtypes under autocast): the module path's
    roundings, to bf16's precision (Triton's interpreter rounds float32 to bf16 toward zero, the GPU
    to nearest: the GPU test below checks the outputs bitwise). The backward spans more than one
    block per program (4 x 40 x 8 rows: 20 blocks of 64 on 1024 programs at most)."""
    x, weight, cos, sin, grad = case(torch.bfloat16, B=4, T=40, H=8, D=32, seed=1)
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    errors = [rel(a, b) for a, b in zip(got, ref, strict=True)]
    assert errors[0] < 8e-3 and errors[1] < 2e-2 and errors[2] < 1e-2, errors


def check_compiled_layer_is_one_graph_and_the_same() -> None:
    """Inside a compiled region, as the trainer's layers call it: one graph, the eager op's values."""
    x, weight, cos, sin, grad = case(torch.float32, seed=2)

    def layer(x, w):  # noqa: ANN001, ANN202
        return qk_norm_rope(x * 2, w, cos, sin, EPS).transpose(1, 2) + 1

    xx, ww = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    explained = torch._dynamo.explain(layer)(xx, ww)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    out = torch.compile(layer, backend="inductor", dynamic=False)(xx, ww)
    out.backward(grad.transpose(1, 2))
    ref = run_op(x * 2, weight, cos, sin, grad)
    assert rel(out.detach().transpose(1, 2) - 1, ref[0]) < 1e-6
    assert xx.grad is not None and rel(xx.grad, 2 * ref[1]) < 1e-6
    assert ww.grad is not None and rel(ww.grad, ref[2]) < 1e-6


def check_drafter_with_and_without_the_kernels(autocast: bool) -> None:
    """The whole drafter (dflash's attention kernels either way) with the fused q/k norm + rotary
    kernels on and off: the same hidden states and gradients, to float32's precision without
    autocast and to bf16's under it (where both paths round as the job does)."""
    from test_model import ANCHORS, SEQ_LENS, batch, build, tiny_spec

    spec = tiny_spec(head_dim=16)
    ids, feats = batch(spec)
    results = []
    for fused in (True, False):
        model = build(spec, "flex")
        model.backend = FlexBackend(compile=False, kernels="dflash", fused_qk_norm_rope=fused)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            hidden = model(ids, feats, ANCHORS, SEQ_LENS)
            loss = model.lm_head(hidden.flatten(0, 2)).float().logsumexp(-1).mean()
        loss.backward()
        results.append((hidden.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h, g), (h_ref, g_ref) = results
    tol = 2e-2 if autocast else 1e-5
    assert rel(h, h_ref) < tol, rel(h, h_ref)
    assert g.keys() == g_ref.keys() and any("q_norm" in n for n in g)
    for name in g:
        assert rel(g[name], g_ref[name]) < tol, f"{name}: {rel(g[name], g_ref[name]):.2e}"


CHECKS = {
    "float32 against float64": check_float32_matches_float64,
    "bf16 roundings": check_bf16_rounds_as_the_module_path,
    "compiled layer": check_compiled_layer_is_one_graph_and_the_same,
    "drafter, float32": lambda: check_drafter_with_and_without_the_kernels(False),
    "drafter, bf16 autocast": lambda: check_drafter_with_and_without_the_kernels(True),
}


def test_the_fused_path_applies_only_where_it_computes_the_module_path():
    x, weight, cos, _, _ = case(torch.bfloat16)
    assert applies(x, weight, cos)
    assert not applies(x, weight.to(torch.bfloat16), cos)  # the module path would round w * y to bf16
    assert not applies(x, weight, cos.float())  # the module path would not round cos/sin
    x6, w6, c6, _, _ = case(torch.bfloat16, D=48)
    assert not applies(x6, w6, c6)  # the halves must be a power of two
    assert not FlexBackend(compile=False, kernels="dflash").fused_qk_norm_rope
    assert FlexBackend(compile=False, kernels="dflash", fused_qk_norm_rope=True).fused_qk_norm_rope
    with pytest.raises(ValueError, match="dflash's attention kernels"):
        FlexBackend(compile=False, fused_qk_norm_rope=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,T", [(32, 2 * 8192), (8, 2 * (4096 + 8192))])
def test_kernels_match_the_module_path_on_gpu(heads, T):
    """At the 8B drafter's q (32 heads x 8192 block tokens) and k (8 kv heads over context + block)
    sizes, bf16: against the module path in the same dtypes, and against float64."""
    x, weight, cos, sin, grad = (
        t.cuda() for t in case(torch.bfloat16, B=2, T=T // 2, H=heads, D=128, seed=3)
    )
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.bfloat16)
    ref64 = module_path(x, weight, cos, sin, grad, torch.float64)
    assert (got[0] == ref[0]).double().mean().item() > 0.99
    for name, a, b, c in zip(("out", "dx", "dweight"), got, ref, ref64, strict=True):
        assert rel(a, b) < 1e-2, f"{name}: {rel(a, b):.2e} against the module path"
        assert rel(a, c) <= 1.5 * rel(b, c) + 1e-4, f"{name}: {rel(a, c):.2e} vs {rel(b, c):.2e} from float64"


if __name__ == "__main__":
    main(CHECKS)
