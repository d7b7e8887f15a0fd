"""The GPU drafter's optimizer (dflash.optim_kernel.KernelAdamW): its Triton kernel against torch's
own fused AdamW, on the CPU through Triton's interpreter (the kernel's own code on CPU tensors) and
on the GPU compiled. The check_* functions run in a process of their own with the interpreter on
(tests/interpreter_helpers.py says why)."""

from __future__ import annotations

import copy

import pytest
import torch
from interpreter_helpers import main, run_interpreted
from torch import nn

from dflash import optim_kernel
from dflash.trainer import clip_and_step

SHAPES = ((7, 5), (5,), (3, 4, 2), (1000,), (0,))
"""Small tensors, one that takes several programs at the test's tile with a masked last one, and
an empty one."""
BLOCK = 256


def _params(device: str, shapes: tuple[tuple[int, ...], ...] = SHAPES) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]


def _set_grads(groups: list[list[nn.Parameter]], step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=gen) * scale for p in groups[0]]
    for params in groups:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.device).clone()


def assert_ulps(x: torch.Tensor, y: torch.Tensor, ulps: float = 4.0) -> None:
    """x equals y to a few float32 roundings at y's scale: torch's kernels order the same float32
    (CPU: partly double) operations differently, about one rounding apart per step, not growing."""
    if y.numel():
        scale = float(y.abs().max())
        assert float((x - y).abs().max()) <= ulps * torch.finfo(torch.float32).eps * scale, (
            (x - y).abs().max()
        )


def _run_against_torch(
    device: str, steps: int, scale: float, block: int, shapes: tuple[tuple[int, ...], ...] = SHAPES
) -> None:
    """Both optimizers from the same parameters and gradients through clip_and_step (the trainer's
    call: the clip factor rides in grad_scale when scale clips), with a learning rate that changes
    every step as the scheduler's does; parameters and moments agree after every step."""
    ref, mine = _params(device, shapes), _params(device, shapes)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt_ref = torch.optim.AdamW(ref, fused=True, **kw)
    opt = optim_kernel.KernelAdamW(mine, block=block, **kw)
    for step in range(steps):
        _set_grads([ref, mine], step, scale)
        for o in (opt_ref, opt):
            for group in o.param_groups:
                group["lr"] = 1e-2 * (0.5 + step)
        want = clip_and_step(opt_ref, ref, 1.0)
        got = clip_and_step(opt, mine, 1.0)
        assert torch.equal(got, want)
        for a, b in zip(mine, ref, strict=True):
            sa, sb = opt.state[a], opt_ref.state[b]
            assert float(sa["step"]) == float(sb["step"]) == step + 1
            assert sa["step"].device == sb["step"].device and sa["step"].dtype == sb["step"].dtype
            for x, y in ((a, b), (sa["exp_avg"], sb["exp_avg"]), (sa["exp_avg_sq"], sb["exp_avg_sq"])):
                assert_ulps(x.detach(), y.detach())
    start = _params(device, shapes)
    moved = max(float((a - b).abs().max()) for a, b in zip(mine, start, strict=True) if a.numel())
    assert moved > 1e-2, "the parameters did not move"


def check_kernel_matches_torch_fused_adamw() -> None:
    """Clipped (the grad_scale path) and under the limit (no scale), on several programs."""
    assert all(optim_kernel.supports(p) for p in _with_grads(_params("cpu")))
    _run_against_torch("cpu", steps=4, scale=100.0, block=BLOCK)
    _run_against_torch("cpu", steps=3, scale=1e-3, block=BLOCK)


def _with_grads(params: list[nn.Parameter]) -> list[nn.Parameter]:
    _set_grads([params], 0, 1.0)
    return params


def check_state_dict_is_torch_adamw_s() -> None:
    """A checkpoint moves either way between KernelAdamW and torch's AdamW, and the step after a
    load continues from the loaded step count (its bias corrections)."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    mine = _params("cpu")
    opt = optim_kernel.KernelAdamW(mine, **kw)
    for step in range(2):
        _set_grads([mine], step, 1.0)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it: not the live tensors
    ref_params = [nn.Parameter(p.detach().clone()) for p in mine]
    ref = torch.optim.AdamW(ref_params, fused=True, **kw)
    ref.load_state_dict(saved)
    assert ref.state_dict()["param_groups"] == saved["param_groups"]
    back_params = [nn.Parameter(p.detach().clone()) for p in mine]
    back = optim_kernel.KernelAdamW(back_params, **kw)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))
    _set_grads([ref_params, back_params], 2, 1.0)
    ref.step()
    back.step()
    for a, b in zip(back_params, ref_params, strict=True):
        assert_ulps(a.detach(), b.detach())
        assert float(back.state[a]["step"]) == 3.0


def check_unsupported_parameter_takes_torch_step() -> None:
    """A float64 parameter (no kernel for it): the whole step is the parent's fused step, and the
    host's step counts stay in line with the device's, so kernel steps after it correct the bias as
    torch does."""
    gen = torch.Generator().manual_seed(1)
    p64 = nn.Parameter(torch.randn(6, dtype=torch.float64, generator=gen))
    p32 = nn.Parameter(torch.randn(6, generator=gen))
    ref = [nn.Parameter(p32.detach().clone())]
    opt = optim_kernel.KernelAdamW([p64, p32], lr=1e-2)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    p64.grad = torch.ones(6, dtype=torch.float64)
    for step in range(3):
        g = torch.randn(6, generator=gen)
        p32.grad, ref[0].grad = g.clone(), g.clone()
        if step == 1:
            p64.grad = None  # from here on every parameter with a gradient is the kernel's
        assert optim_kernel.supports(p32) and not optim_kernel.supports(p64)
        opt.step()
        opt_ref.step()
        assert_ulps(p32.detach(), ref[0].detach())
    assert opt._host_steps[p32] == 3.0 and opt._host_steps[p64] == 1.0


CHECKS = {
    "against torch": check_kernel_matches_torch_fused_adamw,
    "state_dict": check_state_dict_is_torch_adamw_s,
    "fallback": check_unsupported_parameter_takes_torch_step,
}


def test_kernel_through_the_interpreter():
    """Every check_* above, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def test_off_cuda_without_the_interpreter_the_parent_steps():
    """The job's CPU path never reaches Triton: the CPU parameters are not the kernel's."""
    params = _with_grads(_params("cpu"))
    assert not any(optim_kernel.supports(p) for p in params)


def test_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="amsgrad"):
        optim_kernel.KernelAdamW(_params("cpu"), amsgrad=True)


@pytest.mark.gpu
def test_kernel_on_gpu_matches_torch_fused_adamw():
    """Compiled on the GPU at its own tile, against torch's CUDA fused AdamW, a parameter of 8B-layer
    width among them (several thousand programs)."""
    shapes = (*SHAPES, (4096, 1024))
    _run_against_torch("cuda", steps=4, scale=100.0, block=optim_kernel.BLOCK, shapes=shapes)
    _run_against_torch("cuda", steps=2, scale=1e-3, block=optim_kernel.BLOCK, shapes=shapes)


if __name__ == "__main__":
    main(CHECKS)
