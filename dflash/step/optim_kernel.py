"""AdamW's update as one hand-written Triton kernel per parameter (the GPU drafter's optimizer step).

torch's fused AdamW (`_fused_adamw_`) reads parameter, gradient and both moments and writes
parameter and moments back; given a `grad_scale` (clip_and_step folds the clip factor into it) it
also writes the unscaled gradient back over the gradient. That write is 4 of its 32 bytes per
element, and nothing reads the gradient after the step (the trainer drops it: zero_grad with
set_to_none). Here the same update makes 16 bytes of reads and 12 of writes per element. On the 8B
drafter's 1.05 G parameters that is 29.4 GB a step against 33.6 (fused AdamW took 10.1 ms of the step
on the H200, 3.3 TB/s; docs/BENCHMARKS.md).

`KernelAdamW` is torch.optim.AdamW(fused=True) with that step: the same state (step, exp_avg,
exp_avg_sq per parameter), so its state_dict is torch's and checkpoints load either way. The
update is fused AdamW's maths in the same order (decay, moments, bias-corrected step); the bias
corrections and step size are computed on the host in double precision from a host-side copy of
the step count (so the step never waits for the device), the element maths in float32 with IEEE
division and square root (`div_rn`, `sqrt_rn`), as torch's CUDA kernel. Off CUDA the parent's step
runs, except under Triton's interpreter (TRITON_INTERPRET=1), where the CPU tests run this kernel's
own code on CPU tensors.

Master weights (train.bf16_weights): a parameter that the model holds in bf16 is updated through a
float32 master the optimizer keeps (`masters`). The kernel reads master, bf16 gradient and moments,
and writes master, moments and the bf16 parameter (the master rounded to nearest): 28 bytes per
element as before, with no cast of the weight in each forward nor of its gradient in each backward.
The moments are float32 like the master's, and state_dict is still torch's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dflash.step.triton_jit import jit_per_mode, on_kernel_device

BLOCK = 1024
"""Elements per program. bench/optimizer.py --sweep on the H200 (2026-12-02, the 8B drafter's 1.05 G
parameters, clipped): tile 1024 / 4 warps 8.42 ms (3.98 TB/s), 2048 / 8 8.74, 4096 / 8 8.84, 8192 /
16 9.02, 4096 / 4 10.23; torch's fused AdamW 11.19 ms."""
NUM_WARPS = 4


@jit_per_mode
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_update(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        scale_ptr,
        w_ptr,
        n,
        decay,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        step_size,
        bias_correction2_sqrt,
        eps,
        HAS_SCALE: tl.constexpr,
        HAS_WORKING: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        p = tl.load(p_ptr + offs, mask=inside)
        g = tl.load(g_ptr + offs, mask=inside).to(tl.float32)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        m = tl.load(m_ptr + offs, mask=inside)
        v = tl.load(v_ptr + offs, mask=inside)
        p = p - decay * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(p_ptr + offs, p, mask=inside)
        tl.store(m_ptr + offs, m, mask=inside)
        tl.store(v_ptr + offs, v, mask=inside)
        if HAS_WORKING:
            # The bf16 copy the model computes with: the master rounded to nearest even, as torch's
            # .to(bfloat16) and autocast round, spelled on the bits (Triton's interpreter, which the
            # CPU tests run, truncates in its own conversion); NaN stays NaN.
            bits = p.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            rounded = tl.where(p != p, 0x7FC0, rounded)
            tl.store(w_ptr + offs, rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)

    return adamw_update


def supports(p: torch.Tensor, master: torch.Tensor | None = None) -> bool:
    """Whether the kernel updates this parameter: float32 (or bf16 with a float32 `master` of its
    shape) on CUDA (CPU under the interpreter), contiguous, with a contiguous gradient of its
    shape, float32 (or the parameter's dtype, with a master)."""
    g = p.grad
    if g is None or not (on_kernel_device(p) and p.is_contiguous() and g.is_contiguous()):
        return False
    if master is None:
        return p.dtype == g.dtype == torch.float32 and g.shape == p.shape
    return (
        p.dtype == torch.bfloat16
        and master.dtype == torch.float32
        and master.is_contiguous()
        and master.device == p.device
        and master.shape == g.shape == p.shape
        and g.dtype in (torch.float32, p.dtype)
    )


def adamw_update(
    p: torch.Tensor,
    g: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    grad_scale: torch.Tensor | None = None,
    working: torch.Tensor | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> None:
    """One AdamW update of p and its moments in place, `step` being the step count after this
    update (1 for the first). grad_scale: a device scalar the gradient is divided by; working: the
    bf16 copy of p (p being its float32 master), written with the updated value."""
    n = p.numel()
    if not n:
        return
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    _kernel()[(-(-n // block),)](
        p,
        g,
        exp_avg,
        exp_avg_sq,
        grad_scale if grad_scale is not None else p,  # not read without HAS_SCALE
        working if working is not None else p,  # not written without HAS_WORKING
        n,
        lr * weight_decay,
        beta1,
        1 - beta1,
        beta2,
        1 - beta2,
        lr / bias_correction1,
        bias_correction2_sqrt,
        eps,
        HAS_SCALE=grad_scale is not None,
        HAS_WORKING=working is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


class KernelAdamW(torch.optim.AdamW):
    """torch.optim.AdamW(fused=True) whose step runs `adamw_update` where every parameter with a
    gradient `supports` it, and the parent's fused step otherwise. The same state and state_dict;
    clip_and_step's `grad_scale` is honoured as the parent does.

    masters: float32 masters of bf16 parameters (module docstring). Those parameters are updated
    through their masters only: a step that the kernel cannot take for them is an error, never the
    parent's step on the bf16 values."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        masters: Mapping[torch.Tensor, torch.Tensor] | None = None,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("amsgrad") or kwargs.get("maximize") or kwargs.get("capturable"):
            raise ValueError("KernelAdamW implements plain AdamW: no amsgrad, maximize or capturable")
        super().__init__(params, fused=True, **kwargs)
        self.block, self.num_warps = block, num_warps
        self.masters: dict[torch.Tensor, torch.Tensor] = dict(masters or {})
        listed = {p for group in self.param_groups for p in group["params"]}
        if not set(self.masters) <= listed:
            raise ValueError("KernelAdamW: masters given for tensors that are not its parameters")
        self._host_steps: dict[torch.Tensor, float] = {}
        """Each parameter's step count as the device holds it in state['step'], kept on the host so
        the bias corrections need no read-back."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # The parent casts floating state to its parameter's dtype: a bf16 parameter's moments are
        # its float32 master's, and come back as saved.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for i, p in zip(saved_ids, params, strict=True):
            if p in self.masters and i in state_dict["state"]:
                for key in ("exp_avg", "exp_avg_sq"):
                    saved = state_dict["state"][i][key]
                    self.state[p][key] = saved.to(device=p.device, dtype=torch.float32, copy=True)
        # A checkpoint load already waits for the device: read the step counts here, once.
        self._host_steps = {p: float(s["step"]) for p, s in self.state.items() if "step" in s}

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("KernelAdamW takes no closure")
        with_grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        unsupported = [p for p in with_grads if not supports(p, self.masters.get(p))]
        if unsupported:
            bad = next((p for p in unsupported if p in self.masters), None)
            if bad is not None:
                grad = bad.grad
                raise RuntimeError(
                    f"KernelAdamW cannot update a {bad.dtype} parameter of shape {tuple(bad.shape)} "
                    f"on {bad.device} (gradient {grad.dtype if grad is not None else None}) through "
                    "its float32 master; run with train.bf16_weights=false"
                )
            super().step()
            # The parent stepped these: keep the host's counts in line with the device's.
            for p in with_grads:
                self._host_steps[p] = self._host_steps.get(p, 0.0) + 1
            return None
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:  # as the parent initialises a fused parameter's state
                    like = self.masters.get(p, p)
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                    self._host_steps[p] = 0.0
            torch._foreach_add_([self.state[p]["step"] for p in params], 1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                self._host_steps[p] += 1
                master = self.masters.get(p)
                adamw_update(
                    p if master is None else master,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=self._host_steps[p],
                    lr=float(group["lr"]),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    weight_decay=float(group["weight_decay"]),
                    eps=float(group["eps"]),
                    grad_scale=grad_scale,
                    working=None if master is None else p,
                    block=self.block,
                    num_warps=self.num_warps,
                )
        return None
