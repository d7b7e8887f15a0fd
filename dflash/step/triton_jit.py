"""What the hand-written Triton kernels (dflash.step.loss_kernel, dflash.step.optim_kernel) share: where they
run, and jitting each once per interpreter mode.

Triton is imported at a kernel's first use, never at import of this module: on the CPU the job
never calls the kernels, and the CPU tests run them through Triton's interpreter
(TRITON_INTERPRET=1, set before Triton is first imported: tests/interpreter_helpers.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def interpreted() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET=1): the kernels then run on CPU tensors too."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device(device: torch.device) -> bool:
    """The kernels run on this device: CUDA, or the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def on_kernel_device(x: torch.Tensor) -> bool:
    """x lives where the kernels run (kernel_device)."""
    return kernel_device(x.device)


def unit_stride_last(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The tensors as the kernels index them, stepping by 1 along the last dim: any other layout is
    copied (the layers' tensors never are)."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def jit_per_mode(build: Callable[[], Any]) -> Callable[[], Any]:
    """build() defines and returns a @triton.jit kernel; the result returns it, built once per
    interpreter mode (triton.jit reads TRITON_INTERPRET when it decorates)."""
    built: dict[bool, Any] = {}

    def kernel() -> Any:
        mode = interpreted()
        if mode not in built:
            built[mode] = build()
        return built[mode]

    kernel.__doc__ = build.__doc__
    return kernel
