"""The fused loss's Triton kernel (dflash.step.loss_kernel): on the CPU through Triton's interpreter (the
kernel's own code, run on CPU tensors), on the GPU compiled, both against a float64 reference.

The check_* functions run in a process of their own with the interpreter on
(tests/interpreter_helpers.py says why)."""

import pytest
import torch
from interpreter_helpers import main, run_interpreted
from loss_helpers import loss_and_grad

from dflash.step import loss_kernel
from dflash.step.objective import chunk_cross_entropy


def test_kernel_through_the_interpreter():
    """Every check_* below, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def _logits_with_ties(C: int, V: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(C, V, generator=g) * 3
    x[1, 10] = x[1, V - 5] = 40.0  # the same maximum in the first and the last tile: the first wins
    x[2, 300] = x[2, 301] = 41.0  # and twice in one tile
    y = torch.randint(0, V, (C,), generator=g)
    y[1], y[2], y[3] = 10, 301, int(x[3].argmax())
    w = torch.rand(C, generator=g)
    w[4] = 0.0  # a padding row: weight 0, gradient exactly 0
    return x.to(dtype).to(device), y.to(device), w.to(device)


def check_kernel_matches_the_float64_chunk(dtype: torch.dtype) -> None:
    """Loss, top-1 hits (first index of a tied maximum, as torch.argmax) and the gradient, for a
    vocabulary that is not a multiple of the tile (a masked last tile), against chunk_cross_entropy in
    float64 on the same logits."""
    C, V = 9, 1000
    x, y, w = _logits_with_ties(C, V, dtype)
    ref_total, ref_correct, ref_g = chunk_cross_entropy(x.double(), y, w.double(), torch.float64, True)
    logits = x.clone()
    total, correct, g = loss_kernel.chunk_cross_entropy_kernel(logits, y, w, True, block=256, num_warps=4)
    assert g is not None and g.data_ptr() == logits.data_ptr(), "the gradient is written over the logits"
    assert g.dtype == dtype and correct.dtype == torch.bool
    assert abs(total.item() - ref_total.item()) < 1e-5 * ref_total.item()
    assert correct.tolist() == ref_correct.tolist()
    assert correct[1] and not correct[2] and correct[3]
    tol = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: the gradient's own rounding
    assert (g.double() - ref_g).abs().max().item() < tol
    assert g[4].abs().max().item() == 0.0

    untouched = x.clone()
    total2, correct2, none = loss_kernel.chunk_cross_entropy_kernel(untouched, y, w, False, block=256)
    assert none is None and torch.equal(untouched, x), "without a gradient the logits stay as they are"
    assert total2.item() == total.item() and torch.equal(correct2, correct)


def check_kernel_one_tile_and_no_rows() -> None:
    """A vocabulary inside one tile (no second tile at all), and an empty chunk."""
    x, y, w = _logits_with_ties(6, 400, torch.float32)
    ref_total, ref_correct, ref_g = chunk_cross_entropy(x.double(), y, w.double(), torch.float64, True)
    total, correct, g = loss_kernel.chunk_cross_entropy_kernel(x.clone(), y, w, True, block=512)
    assert abs(total.item() - ref_total.item()) < 1e-5 * ref_total.item()
    assert correct.tolist() == ref_correct.tolist()
    assert g is not None and (g.double() - ref_g).abs().max().item() < 1e-6
    empty = torch.empty(0, 400)
    total0, correct0, g0 = loss_kernel.chunk_cross_entropy_kernel(empty, y[:0], w[:0], True)
    assert total0.item() == 0.0 and correct0.numel() == 0 and g0 is not None and g0.numel() == 0


def check_fused_loss_runs_the_kernel_where_it_applies() -> None:
    """dflash_loss with fused=True takes the kernel wherever loss_kernel.supports the chunk (here the
    interpreter's CPU tensors, float32): same loss, accuracy and gradient as the eager chunks; with
    kernel=False the compiled chunk function runs instead."""
    torch.manual_seed(5)
    B, A, K, H, V = 2, 6, 8, 16, 300
    labels = torch.randint(0, V, (B, A, K))
    valid = torch.rand(B, A, K) > 0.3
    valid[..., 0] = False
    head = torch.randn(V, H)
    h0 = torch.randn(B, A, K, H)
    assert loss_kernel.supports(torch.empty(4, V), torch.float32)
    assert not loss_kernel.supports(torch.empty(4, V, dtype=torch.float64), torch.float64)
    (eager, g_eager), (kern, g_kern) = (
        loss_and_grad(h0, head, labels, valid, chunk_tokens=64, fused=fused) for fused in (False, True)
    )
    assert kern.tokens == eager.tokens == int(valid.sum())
    assert torch.allclose(kern.loss, eager.loss, rtol=1e-6)
    assert torch.allclose(g_kern, g_eager, atol=1e-7, rtol=1e-5)
    assert kern.acc_per_pos == eager.acc_per_pos


def test_kernel_is_used_only_where_it_applies(monkeypatch: pytest.MonkeyPatch):
    """Without the interpreter a CPU chunk never goes to Triton (the job's CPU runs use the compiled
    or eager chunk); a float64 softmax never does anywhere."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not loss_kernel.supports(torch.empty(4, 8), torch.float32)
    assert not loss_kernel.supports(torch.empty(4, 8, dtype=torch.bfloat16), torch.float64)
    assert not loss_kernel.supports(torch.empty(8, 4).t(), torch.float32), "rows must be unit stride"


CHECKS = {
    "fp32 chunk": lambda: check_kernel_matches_the_float64_chunk(torch.float32),
    "bf16 chunk": lambda: check_kernel_matches_the_float64_chunk(torch.bfloat16),
    "one tile, no rows": check_kernel_one_tile_and_no_rows,
    "fused loss": check_fused_loss_runs_the_kernel_where_it_applies,
}


@pytest.mark.gpu
def test_kernel_on_gpu_matches_float64_at_the_8b_vocab():
    """Compiled on the GPU, at the 8B head's vocabulary (151,936: 75 tiles of 2,048, the last one
    masked) and bf16 logits as the head's matmul writes them: loss, hits and gradient against the
    float64 chunk."""
    C, V = 256, 151936
    x, y, w = _logits_with_ties(C, V, torch.bfloat16, "cuda")
    ref_total, ref_correct, ref_g = chunk_cross_entropy(x.double(), y, w.double(), torch.float64, True)
    total, correct, g = loss_kernel.chunk_cross_entropy_kernel(x.clone(), y, w, True)
    assert abs(total.item() - ref_total.item()) < 1e-5 * ref_total.item()
    assert correct.tolist() == ref_correct.tolist()
    assert g is not None and (g.double() - ref_g).abs().max().item() < 4e-3
    assert g[4].abs().max().item() == 0.0


if __name__ == "__main__":
    main(CHECKS)
