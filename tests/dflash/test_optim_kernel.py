"""The GPU drafter's optimizer (dflash.step.optim_kernel.KernelAdamW): its Triton kernel against torch's
own fused AdamW, on the CPU through Triton's interpreter (the kernel's own code on CPU tensors) and
on the GPU compiled. The check_* functions run in a process of their own with the interpreter on
(tests/interpreter_helpers.py says why)."""

from __future__ import annotations

import copy

import pytest
import torch
from interpreter_helpers import main, run_interpreted
from torch import nn

from dflash.step import optim_kernel
from dflash.step.trainer import clip_and_step

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


def _bf16_grads(params: list[nn.Parameter], step: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(torch.bfloat16) for p in params]


def _with_masters(
    values: list[torch.Tensor], device: str
) -> tuple[list[nn.Parameter], dict[torch.Tensor, torch.Tensor]]:
    """bf16 parameters and their float32 masters, as trainer.bf16_working_weights makes them."""
    params = [nn.Parameter(v.to(device, torch.bfloat16)) for v in values]
    return params, {p: v.to(device, torch.float32).clone() for p, v in zip(params, values, strict=True)}


def _run_masters_against_float32(device: str, steps: int, scale: float, shapes=SHAPES) -> None:
    """bf16 parameters updated through float32 masters from bf16 gradients, against float32
    parameters updated from the same gradient values in float32 (what autocast gives float32
    weights): norm, masters and moments bitwise equal to the float32 run's, and every bf16
    parameter the master rounded to nearest."""
    start = _params(device, shapes)
    ref = [nn.Parameter(p.detach().clone()) for p in start]
    mine, masters = _with_masters([p.detach() for p in start], device)
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    opt_ref = optim_kernel.KernelAdamW(ref, **kw)
    opt = optim_kernel.KernelAdamW(mine, masters=masters, **kw)
    for step in range(steps):
        for p, q, g in zip(ref, mine, _bf16_grads(ref, step, scale), strict=True):
            p.grad, q.grad = g.to(device, torch.float32), g.to(device)
        assert all(optim_kernel.supports(p, masters[p]) for p in mine)
        want = clip_and_step(opt_ref, ref, 1.0)
        got = clip_and_step(opt, mine, 1.0)
        assert torch.equal(got, want)
        for a, b in zip(mine, ref, strict=True):
            sa, sb = opt.state[a], opt_ref.state[b]
            assert sa["exp_avg"].dtype == sa["exp_avg_sq"].dtype == torch.float32
            assert torch.equal(masters[a], b.detach())
            assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(
                sa["exp_avg_sq"], sb["exp_avg_sq"]
            )
            assert a.dtype == torch.bfloat16 and torch.equal(a.detach(), b.detach().to(torch.bfloat16))
    moved = max(float((masters[a] - b).abs().max()) for a, b in zip(mine, start, strict=True) if a.numel())
    assert moved > 1e-2, "the parameters did not move"


def check_masters_update_as_float32_parameters() -> None:
    _run_masters_against_float32("cpu", steps=3, scale=100.0)
    _run_masters_against_float32("cpu", steps=2, scale=1e-3)


def check_masters_state_dict_keeps_float32_moments() -> None:
    """torch's load_state_dict casts moments to the parameter's dtype; a bf16 parameter's moments
    are its master's and must come back float32, exactly, and the next step continue as before."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    values = [p.detach() for p in _params("cpu")]
    mine, masters = _with_masters(values, "cpu")
    opt = optim_kernel.KernelAdamW(mine, masters=masters, **kw)
    for step in range(2):
        for p, g in zip(mine, _bf16_grads(mine, step, 1.0), strict=True):
            p.grad = g
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    back, back_masters = _with_masters([masters[p] for p in mine], "cpu")
    opt_back = optim_kernel.KernelAdamW(back, masters=back_masters, **kw)
    opt_back.load_state_dict(saved)
    for a, b in zip(back, mine, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt_back.state[a][key].dtype == torch.float32
            assert torch.equal(opt_back.state[a][key], opt.state[b][key])
    for params in (mine, back):
        for p, g in zip(params, _bf16_grads(params, 2, 1.0), strict=True):
            p.grad = g
    opt.step()
    opt_back.step()
    for a, b in zip(back, mine, strict=True):
        assert torch.equal(back_masters[a], masters[b]) and torch.equal(a.detach(), b.detach())


CHECKS = {
    "against torch": check_kernel_matches_torch_fused_adamw,
    "state_dict": check_state_dict_is_torch_adamw_s,
    "fallback": check_unsupported_parameter_takes_torch_step,
    "masters": check_masters_update_as_float32_parameters,
    "masters state_dict": check_masters_state_dict_keeps_float32_moments,
}


def test_kernel_through_the_interpreter():
    """Every check_* above, in a fresh process with the interpreter on."""
    run_interpreted(__file__, CHECKS)


def test_off_cuda_without_the_interpreter_the_parent_steps():
    """The job's CPU path never reaches Triton: the CPU parameters are not the kernel's."""
    params = _with_grads(_params("cpu"))
    assert not any(optim_kernel.supports(p) for p in params)


def test_a_bf16_parameter_is_never_stepped_without_its_master():
    """Where the kernel cannot run (here: the CPU without the interpreter), the parent's step would
    update the bf16 values themselves and lose the float32 master: an error that names the way out."""
    params, masters = _with_masters([p.detach() for p in _params("cpu")], "cpu")
    for p, g in zip(params, _bf16_grads(params, 0, 1.0), strict=True):
        p.grad = g
    opt = optim_kernel.KernelAdamW(params, masters=masters, lr=1e-2)
    with pytest.raises(RuntimeError, match="train.bf16_weights=false"):
        opt.step()
    with pytest.raises(ValueError, match="not its parameters"):
        optim_kernel.KernelAdamW(params[:1], masters=masters, lr=1e-2)


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


@pytest.mark.gpu
def test_masters_on_gpu_update_as_float32_parameters():
    """The bf16-weights path compiled on the GPU: bitwise the float32 parameters' update."""
    shapes = (*SHAPES, (4096, 1024))
    _run_masters_against_float32("cuda", steps=3, scale=100.0, shapes=shapes)


if __name__ == "__main__":
    main(CHECKS)
