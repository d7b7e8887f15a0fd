"""The DFlash loss run the way the loss tests compare its paths: on a fresh copy of the hidden
states, backward taken, the output and the hidden states' gradient returned."""

from __future__ import annotations

import torch

from dflash.step.objective import LossOutput, dflash_loss


def loss_and_grad(
    h0: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    *,
    chunk_tokens: int,
    fused: bool,
    gamma: float = 7.0,
) -> tuple[LossOutput, torch.Tensor]:
    hidden = h0.clone().requires_grad_()
    out = dflash_loss(hidden, head, labels, valid, gamma=gamma, chunk_tokens=chunk_tokens, fused=fused)
    out.loss.backward()
    assert hidden.grad is not None
    return out, hidden.grad
