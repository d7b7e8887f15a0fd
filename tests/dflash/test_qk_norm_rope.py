"""dflash.step.attention.qk_norm_rope: the q/k RMSNorm + rotary embedding kernels, through Triton's
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

from dflash.step.attention import qk_norm_rope as qnr
from dflash.step.attention.flex import FlexBackend
from dflash.step.attention.qk_norm_rope import qk_norm_rope, qk_norm_rope_backward, unsupported
from dflash.step.model import rms_norm

EPS = 1e-6


def test_kernels_through_the_interpreter():
    """Every check_* below, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def case(  # noqa: ANN201
    dtype: torch.dtype,
    B: int = 2,
    T: int = 7,
    H: int = 3,
    D: int = 64,
    seed: int = 0,
    cos_dtype: torch.dtype = torch.float32,
):
    """x [B, T, H, D] as a projection's view (a slice of a wider row: not contiguous), a float32
    weight near 1, cos/sin of rotary angles [B, T, D] (float32, as the job's rotary embedding gives
    them under autocast: the block's hidden states are float32 there), and the output's gradient in
    the attention backward's layout ([B, H, T, D] memory)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(B, T, H * D + 8, generator=g).to(dtype)
    x = wide[..., 8:].view(B, T, H, D)
    weight = 1 + 0.1 * torch.randn(D, generator=g)
    pos = torch.randint(0, 4096, (B, T), generator=g).double()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, D, 2).double() / D))
    angles = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    cos, sin = angles.cos().to(cos_dtype), angles.sin().to(cos_dtype)
    grad = torch.randn(B, H, T, D, generator=g).to(dtype).transpose(1, 2)
    return x, weight, cos, sin, grad


def module_path(x, weight, cos, sin, grad, dtype: torch.dtype):  # noqa: ANN001, ANN201
    """out, dx, dweight as DrafterAttention's module path computes them, in `dtype` (float64: no
    roundings; x's dtype: the job's)."""
    x = x.detach().to(dtype if dtype == torch.float64 else x.dtype).requires_grad_()
    w = weight.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    c, s = (t.double() if dtype == torch.float64 else t for t in (cos, sin))
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
    assert unsupported(x, weight, cos, sin) is None
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.float64)
    assert got[0].dtype == torch.float32 and got[1].shape == x.shape and got[2].shape == weight.shape
    for name, a, b in zip(("out", "dx", "dweight"), got, ref, strict=True):
        assert rel(a, b) < 1e-5, f"{name}: relative error {rel(a, b):.2e}"


def check_bf16_rounds_as_the_module_path(cos_dtype: torch.dtype) -> None:
    """x in bf16, the weight float32, cos/sin float32 (the job's dtypes under autocast) or bf16: the
    module path's roundings, to bf16's precision (Triton's interpreter rounds float32 to bf16 toward
    zero, the GPU to nearest: the GPU test below checks the outputs bitwise)."""
    x, weight, cos, sin, grad = case(torch.bfloat16, B=4, T=40, H=8, D=32, seed=1, cos_dtype=cos_dtype)
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.bfloat16)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.bfloat16 and got[2].dtype == torch.float32
    errors = [rel(a, b) for a, b in zip(got, ref, strict=True)]
    assert errors[0] < 8e-3 and errors[1] < 2e-2 and errors[2] < 1e-2, errors


def check_backward_programs_loop_over_their_blocks() -> None:
    """On 3 programs each loops over its share of the blocks (2 x 40 x 8 = 640 rows: 40 blocks of 16,
    14 a program, and the last program's final 2 past the rows, all masked): the same dx, bitwise, as
    one block per program (each row's arithmetic is the same), and the weight's gradient, summed in
    another order, to float32."""
    x, weight, cos, sin, grad = case(torch.float32, B=2, T=40, H=8, D=32, seed=4)
    blocks = x.shape[0] * x.shape[1] * x.shape[2] // qnr.BACKWARD.rows
    assert blocks == 40 and 3 * -(-blocks // 3) > blocks  # a tail of whole blocks past the rows
    looped = qk_norm_rope_backward(grad, x, weight, cos, sin, EPS, qnr.BACKWARD._replace(programs=3))
    single = qk_norm_rope_backward(grad, x, weight, cos, sin, EPS, qnr.BACKWARD._replace(programs=0))
    assert torch.equal(looped[0], single[0]) and rel(looped[1], single[1]) < 1e-6
    ref = module_path(x, weight, cos, sin, grad, torch.float64)
    assert rel(looped[0], ref[1]) < 1e-5 and rel(looped[1], ref[2]) < 1e-5


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
    kernels on and off. Without autocast: the same hidden states and gradients to float32's
    precision. Under bf16 autocast the kernels take the job's dtypes (bf16 projections, float32
    cos/sin) for every layer's q and k; this tiny random drafter is too sensitive there for a
    precision check (its bf16 hidden states differ from its own float32 ones by 133%, and the
    interpreter rounds to bf16 toward zero where torch rounds to nearest: fused and module paths
    differ by 4.5%, measured 2026-12-03), so it checks the wiring and a loose agreement; the op's
    bf16 roundings are checked above and on the GPU."""
    from test_model import ANCHORS, SEQ_LENS, batch, build, tiny_spec

    spec = tiny_spec(head_dim=16)
    ids, feats = batch(spec)
    results = []
    calls = []
    op = qnr.qk_norm_rope

    def counted(x, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(x.dtype)
        return op(x, *args)

    qnr.qk_norm_rope = counted  # the layers call it through the module
    try:
        for fused in (True, False):
            model = build(spec, "flex")
            model.backend = FlexBackend(compile=False, kernels="dflash", fused_qk_norm_rope=fused)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                hidden = model(ids, feats, ANCHORS, SEQ_LENS)
                loss = model.lm_head(hidden.flatten(0, 2)).float().logsumexp(-1).mean()
            loss.backward()
            results.append(
                (hidden.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters()})
            )
    finally:
        qnr.qk_norm_rope = op
    # q and k of every layer, with it on only; under autocast from the bf16 projections.
    assert calls == [torch.bfloat16 if autocast else torch.float32] * (2 * spec.num_layers), calls
    (h, g), (h_ref, g_ref) = results
    assert g.keys() == g_ref.keys() and any("q_norm" in n for n in g)
    if autocast:
        assert rel(h, h_ref) < 0.1, rel(h, h_ref)
        assert all(bool(torch.isfinite(x).all()) for x in g.values())
        assert all(float(g[n].abs().sum()) > 0 for n in g if "q_norm" in n or "k_norm" in n)
        return
    assert rel(h, h_ref) < 1e-5, rel(h, h_ref)
    for name in g:
        assert rel(g[name], g_ref[name]) < 1e-5, f"{name}: {rel(g[name], g_ref[name]):.2e}"


CHECKS = {
    "float32 against float64": check_float32_matches_float64,
    "bf16 roundings, float32 cos": lambda: check_bf16_rounds_as_the_module_path(torch.float32),
    "bf16 roundings, bf16 cos": lambda: check_bf16_rounds_as_the_module_path(torch.bfloat16),
    "backward loop": check_backward_programs_loop_over_their_blocks,
    "compiled layer": check_compiled_layer_is_one_graph_and_the_same,
    "drafter, float32": lambda: check_drafter_with_and_without_the_kernels(False),
    "drafter, bf16 autocast": lambda: check_drafter_with_and_without_the_kernels(True),
}


def test_inputs_the_kernels_would_not_compute_as_the_module_path_are_refused():
    """Never a silent fallback and never a different result: the op refuses (before any kernel, here
    without Triton) what it would not compute as the module path does, saying why; a drafter whose
    head_dim the kernels cannot take is refused at construction, naming the config key."""
    from test_model import build, tiny_spec

    from dflash.errors import ConfigError
    from dflash.step.model import DFlashDrafter

    x, weight, cos, sin, _ = case(torch.bfloat16)
    assert unsupported(x, weight, cos, sin) is None
    assert unsupported(x, weight, cos.bfloat16(), sin.bfloat16()) is None
    for args, says in (
        ((x, weight.bfloat16(), cos, sin), "not float32"),  # the module path would round w * y to bf16
        ((x, weight, cos.double(), sin.double()), "float32 or narrower"),  # it would compute in float64
        ((x, weight, cos, sin.bfloat16()), "cos and sin alike"),
        ((x, weight, cos[:1], sin[:1]), "shapes"),  # would read past cos's end for the second batch
        (case(torch.bfloat16, D=48)[:4], "head_dim 48 is not a power of two"),
    ):
        assert says in (unsupported(*args) or ""), (says, unsupported(*args))
        with pytest.raises(ValueError, match="cannot take these inputs"):
            qk_norm_rope(*args, EPS)
    assert not FlexBackend(compile=False, kernels="dflash").fused_qk_norm_rope
    assert FlexBackend(compile=False, kernels="dflash", fused_qk_norm_rope=True).fused_qk_norm_rope
    with pytest.raises(ValueError, match="dflash's attention kernels"):
        FlexBackend(compile=False, fused_qk_norm_rope=True)
    spec = tiny_spec(head_dim=12)
    model = build(spec, "sdpa")
    with pytest.raises(ConfigError) as e:
        DFlashDrafter(
            spec,
            model.embed_weight_VH,
            model.lm_head_weight_VH,
            backend="flex",
            flex_kernels="dflash",
            fused_qk_norm_rope=True,
        )
    assert (
        e.value.key == "attention.fused_qk_norm_rope"
        and "head_dim (4 or more); this drafter's is 12" in str(e.value)
    )


def test_kernels_compile_for_the_h200_without_spilling(tmp_path):
    """Compiled for sm_90 (the H200) by Triton's own ptxas, here without a GPU: both kernels build at
    their shipped rows and warps (qk_norm_rope.FORWARD, BACKWARD) for head dim 128 (bf16 x, float32
    weight and cos/sin, as in the job), nothing spills to local memory (64 rows at 4 warps spilled
    1,088 bytes of stack), and as many programs fit an SM as when they were timed on the H200 (the
    forward at 16 rows / 4 warps: 80 registers, 6 programs; the backward at 16 rows / 2 warps: 240
    registers, 4 programs, which only a spill could lower). Measured so on 2026-12-03."""
    import subprocess
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert cuobjdump.exists(), "Triton's nvidia backend ships cuobjdump"
    pointers = {"X": "bf16", "OUT": "bf16", "G": "bf16", "DX": "bf16", "W": "fp32", "DW": "fp32"}
    pointers |= {"COS": "fp32", "SIN": "fp32"}
    for kernel, launch, timed_programs in zip(
        qnr._kernels(), (qnr.FORWARD, qnr.BACKWARD), (6, 4), strict=True
    ):
        signature = {
            n: f"*{pointers[n]}"
            if n in pointers
            else "fp32"
            if n == "eps"
            else "constexpr"
            if n in ("D", "BLOCK")
            else "i32"
            for n in kernel.arg_names
        }
        source = ASTSource(fn=kernel, signature=signature, constexprs={"D": 128, "BLOCK": launch.rows})
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": launch.num_warps}
        )
        cubin = tmp_path / f"{kernel.__name__}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
        fields = dict(f.split(":") for line in usage.splitlines() if "REG:" in line for f in line.split())
        assert fields["STACK"] == "0" and fields["LOCAL"] == "0", (kernel.__name__, fields)
        programs = 65536 // (int(fields["REG"]) * 32 * launch.num_warps)
        assert programs >= timed_programs, (kernel.__name__, fields)


@pytest.mark.gpu
@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.bfloat16], ids=["float32 cos", "bf16 cos"])
@pytest.mark.parametrize("heads,T", [(32, 8192), (8, 4096 + 8192)], ids=["q", "k"])
def test_kernels_match_the_module_path_on_gpu(heads, T, cos_dtype):
    """At the 8B drafter's q (32 heads x 8192 block tokens a sequence) and k (8 kv heads over context
    + block) sizes, x bf16, cos/sin float32 as the job's (and bf16): outputs bitwise the module
    path's but for a few (the GPU rounds to nearest as torch does; a float32 sum in another order
    moves a rounding here and there), dx nearly so (a missing bf16 rounding of the gradient reaching
    y would move many), all of them as close to float64 as the module path is."""
    x, weight, cos, sin, grad = (
        t.cuda() for t in case(torch.bfloat16, B=2, T=T, H=heads, D=128, seed=3, cos_dtype=cos_dtype)
    )
    got = run_op(x, weight, cos, sin, grad)
    ref = module_path(x, weight, cos, sin, grad, torch.bfloat16)
    ref64 = module_path(x, weight, cos, sin, grad, torch.float64)
    assert (got[0] == ref[0]).double().mean().item() > 0.99
    assert (got[1] == ref[1]).double().mean().item() > 0.9
    for name, a, b, c in zip(("out", "dx", "dweight"), got, ref, ref64, strict=True):
        assert rel(a, b) < 1e-2, f"{name}: {rel(a, b):.2e} against the module path"
        assert rel(a, c) <= 1.5 * rel(b, c) + 1e-4, f"{name}: {rel(a, c):.2e} vs {rel(b, c):.2e} from float64"


if __name__ == "__main__":
    main(CHECKS)
