"""The DFlash training objective, as plain maths.

Anchors: up to `num_anchors` positions a per sequence, sampled without replacement among loss-mask
positions whose next token is a loss token too (loss_mask[a] and loss_mask[a+1]), sorted. Each anchor becomes a block
[x_a, MASK, ..., MASK] of K tokens; block position k (1..K-1) is trained to predict x_{a+k} with
weight w_k = exp(-(k-1)/gamma): early positions matter most, because a draft is accepted only up to
its first wrong token.

streak = expected accepted length per block under per-position accuracies p_k, treating positions as
independent: sum_{k=1}^{K-1} prod_{j<=k} p_j.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from dflash.step import loss_kernel


def host_to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """x on `device` without the host waiting for the device. A CUDA copy from pageable host memory
    returns only once the copy is done, which is after everything already queued on the stream: it
    would hold the host until the step queued before is finished (dflash.step.trainer.StepAhead). From
    pinned memory the copy is queued like a kernel; the pinned buffer is kept until it ran."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device, non_blocking=True)
    return (x if x.is_pinned() else x.pin_memory()).to(device, non_blocking=True)


def sample_anchors(
    loss_mask_BL: torch.Tensor,
    seq_lens_B: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """[B, num_anchors] sorted anchor positions, -1 where a sequence has fewer eligible positions.

    The anchor count is fixed (not the per-batch maximum) so every batch of one length bucket has
    one shape: each distinct shape is a separate compile."""
    B, L = loss_mask_BL.shape
    pos_L = torch.arange(L, device=loss_mask_BL.device)
    # An anchor is a trained (assistant) token whose next token is trained too: at inference the
    # first block is anchored on the first generated token, never on the prompt's last one.
    next_is_loss_BL = torch.zeros_like(loss_mask_BL)
    next_is_loss_BL[:, :-1] = loss_mask_BL[:, 1:]
    eligible_BL = loss_mask_BL & next_is_loss_BL & (pos_L[None, :] < (seq_lens_B[:, None] - 1))
    # Random keys for eligible positions, +inf elsewhere; the smallest num_anchors keys win.
    keys_BL = host_to_device(torch.rand(B, L, generator=generator, device="cpu"), loss_mask_BL.device)
    keys_BL = keys_BL.masked_fill(~eligible_BL, float("inf"))
    take = min(num_anchors, L)
    keys_BA, idx_BA = keys_BL.topk(take, dim=1, largest=False)
    idx_BA = idx_BA.masked_fill(torch.isinf(keys_BA), -1)
    # Sort valid anchors ascending, padding (-1) last.
    sort_key_BA = torch.where(idx_BA < 0, torch.full_like(idx_BA, L + 1), idx_BA)
    anchors_BA = idx_BA.gather(1, sort_key_BA.argsort(dim=1))
    if take < num_anchors:
        pad = torch.full((B, num_anchors - take), -1, dtype=anchors_BA.dtype, device=anchors_BA.device)
        anchors_BA = torch.cat([anchors_BA, pad], dim=1)
    return anchors_BA


def block_labels(
    input_ids_BL: torch.Tensor,
    loss_mask_BL: torch.Tensor,
    seq_lens_B: torch.Tensor,
    anchors_BA: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels_BAK, valid_BAK): the data token at anchor+k and whether position k is trained.
    Position 0 (the anchor itself, given) is never trained."""
    B, L = input_ids_BL.shape
    k_K = torch.arange(block_size, device=input_ids_BL.device)
    pos_BAK = anchors_BA[:, :, None] + k_K[None, None, :]
    in_range_BAK = (anchors_BA[:, :, None] >= 0) & (pos_BAK < seq_lens_B[:, None, None]) & (k_K > 0)
    safe_BAK = pos_BAK.clamp(0, L - 1)
    flat = safe_BAK.reshape(B, -1)
    labels_BAK = input_ids_BL.gather(1, flat).reshape_as(pos_BAK)
    valid_BAK = in_range_BAK & loss_mask_BL.gather(1, flat).reshape_as(pos_BAK)
    return labels_BAK, valid_BAK


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k >= 1; w_0 = 0."""
    k_K = torch.arange(block_size, device=device, dtype=torch.float32)
    # torch.where, not `w_K[0] = 0.0`: assigning a Python number copies it from the host and waits
    # for the device (the step would stall there; tests/dflash/test_trainer_step.py).
    return torch.where(k_K > 0, torch.exp(-(k_K - 1) / gamma), 0.0)


KERNEL_READS = True
"""HostCopy writes its values into the pinned buffer with a kernel (below); False: a copy_."""
_CAI_TYPES = {
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.float16: "<f2",
    torch.int64: "<i8",
    torch.int32: "<i4",
}
_PENDING: list[tuple[torch.Tensor, Any]] = []
"""Pinned buffers written by a kernel whose HostCopy was dropped unread: kept until the kernel ran
(the host allocator, which knows only its own copies, would hand the block out again at once)."""


class _DevicePointer:
    """A pinned host buffer as CUDA sees it (UVA: the same address), for torch.as_tensor."""

    def __init__(self, host: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "data": (host.data_ptr(), False),
            "shape": tuple(host.shape),
            "typestr": _CAI_TYPES[host.dtype],
            "version": 3,
        }


def _write_by_kernel(x: torch.Tensor, host: torch.Tensor) -> bool:
    """Write x into the pinned `host` with an elementwise kernel on x's stream instead of a copy.
    A device-to-host copy goes through the copy engine, and there it waits behind a long copy
    queued on another stream (dflash.pipeline.state_copy's 12.6 GB at the 8B size): the stream that
    queued it stalls the whole time, and the step with it. A kernel's stores to mapped host memory
    pass beside the copy engine. False (nothing written) where the buffer cannot be mapped so."""
    if not KERNEL_READS or x.dtype not in _CAI_TYPES or not x.is_contiguous():
        return False
    try:
        alias = torch.as_tensor(_DevicePointer(host), device=x.device)  # no copy: checked below
    except (RuntimeError, TypeError, ValueError):
        return False
    if alias.data_ptr() != host.data_ptr():  # as_tensor copied it (another device's buffer)
        return False
    torch.mul(x, 1, out=alias)  # x * 1 is x, bit for bit (NaN stays NaN, -0.0 stays -0.0)
    return True


class HostCopy:
    """A device tensor on its way to the host: written now, right behind the work that made the
    tensor and ahead of anything queued later, into pinned memory (by a kernel: _write_by_kernel).
    `get()` then waits for that point of the device's queue only, not for the work queued after it.
    On the CPU it is the tensor itself."""

    def __init__(self, x: torch.Tensor) -> None:
        self._event: Any = None
        self.by_kernel = False
        if x.device.type == "cuda":
            if _PENDING:
                _PENDING[:] = [(h, e) for h, e in _PENDING if not e.query()]
            self._host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.by_kernel = _write_by_kernel(x, self._host)
            if not self.by_kernel:
                self._host.copy_(x, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(x.device))
        else:
            self._host = x

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host

    def __del__(self) -> None:
        if self.by_kernel and self._event is not None:
            try:
                if not self._event.query():
                    _PENDING.append((self._host, self._event))
            except Exception:  # interpreter shutdown: the process and its buffers are going
                pass


@dataclass(slots=True)
class LossOutput:
    loss: torch.Tensor
    """Weighted mean cross-entropy (scalar, differentiable)."""
    hits_K: torch.Tensor
    """Top-1 hits per block position (0..K-1; position 0 is never trained), on the device."""
    counts_K: torch.Tensor
    """Trained positions per block position, on the device."""
    _host: tuple[list[float], list[float]] | None = None
    _copy: HostCopy | None = None
    _extras: list[float] | None = None

    def _values(self, *extra: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.hits_K.float(), self.counts_K.float(), *(x.float().reshape(1) for x in extra)])

    def _split(self, host: list[float]) -> list[float]:
        K = self.hits_K.numel()
        self._host = (host[:K], host[K : 2 * K])
        return host[2 * K :]

    def start_read(self, *extra: torch.Tensor) -> None:
        """Queue the copy to the host of the accuracy counts and `extra` scalars now (the trainer
        calls it right after queuing the optimizer step); `read_started` returns the extras. With
        the next step queued behind it, a read at the time of use (`read_with`) would wait for that
        step too: the device then idles while the host queues the step after (bench/drafter_step.py's
        host waits, docs/BENCHMARKS.md)."""
        self._copy = HostCopy(self._values(*extra))

    def read_started(self) -> list[float]:
        """The values of `start_read`'s copy (waits for the device to reach it the first time); its
        extras. Any number of calls, before or after a metric is read."""
        if self._copy is not None:
            copy, self._copy = self._copy, None
            self._extras = self._split(copy.get().tolist())
        assert self._extras is not None, "start_read first"
        return self._extras

    def read_with(self, *extra: torch.Tensor) -> list[float]:
        """Read the accuracy counts to the host together with `extra` scalars, in one transfer, at
        the time of the call; returns the extras' values."""
        return self._split(self._values(*extra).tolist())

    def _read(self) -> tuple[list[float], list[float]]:
        """(hits, counts) on the host, read the first time a metric is read."""
        if self._host is None and self._copy is not None:
            self.read_started()
        elif self._host is None:
            self.read_with()
        assert self._host is not None
        return self._host

    @property
    def acc_per_pos(self) -> list[float]:
        """Top-1 accuracy per block position 1..K-1 (nan where no position was trained)."""
        hits, counts = self._read()
        return [h / c if c > 0 else math.nan for h, c in zip(hits[1:], counts[1:], strict=True)]

    @property
    def acc(self) -> float:
        hits, counts = self._read()
        n = sum(counts)
        return sum(hits) / n if n else math.nan

    @property
    def streak(self) -> float:
        return expected_streak(self.acc_per_pos)

    @property
    def tokens(self) -> int:
        """Trained block positions in this batch."""
        return int(sum(self._read()[1]))


def chunk_cross_entropy(
    logits_CV: torch.Tensor, y_C: torch.Tensor, w_C: torch.Tensor, ce_dtype: torch.dtype, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk of the head's loss from its logits: (sum of w * CE, top-1 hit per token, and with
    want_grad dL/dlogits = w * (softmax - onehot) in the logits' dtype). Softmax and CE in ce_dtype.

    Written as one pure function so torch.compile generates it as one fused kernel (on the H200 one
    looped row reduction for logsumexp, argmax and the gradient) instead of the eager chain of exp,
    sub, mul, scatter and copies over fp32 [chunk, vocab]: the 8B step's loss went from 67 ms to 8 ms
    (docs/BENCHMARKS.md, 2026-12-01). The same function runs eagerly where the loss is not compiled."""
    x_CV = logits_CV.to(ce_dtype)
    lse_C = torch.logsumexp(x_CV, dim=-1)
    picked_C = x_CV.gather(1, y_C[:, None]).squeeze(1)
    total = ((lse_C - picked_C) * w_C).sum()
    correct_C = x_CV.argmax(dim=-1) == y_C
    if not want_grad:
        return total, correct_C, None
    # Pure, so the compiled version fuses it into one pass (eagerly it holds a few fp32 [chunk, vocab]
    # temporaries: keep train.loss_chunk_tokens small where the loss is not compiled).
    p_CV = torch.exp(x_CV - lse_C[:, None])
    hit_CV = torch.arange(x_CV.shape[1], device=x_CV.device)[None, :] == y_C[:, None]
    g_CV = (torch.where(hit_CV, p_CV - 1.0, p_CV) * w_C[:, None]).to(logits_CV.dtype)
    return total, correct_C, g_CV


@functools.cache
def _chunk_cross_entropy_compiled() -> Any:
    """chunk_cross_entropy compiled, made at first use (torch.compile imports inductor). The chunk's
    row count is marked dynamic at every call (the last chunk's size depends on the length bucket),
    so one graph per (dtype, want_grad) serves every bucket: dflash.plan.shapes counts it."""
    return torch.compile(chunk_cross_entropy)


LOSS_ROW_MULTIPLE = 64
"""Fused, the loss rows are padded (weight 0) to a multiple of this and chunks are whole multiples
of it, so no chunk has 0 or 1 rows: dynamo specialises those sizes, a graph each."""


def _chunk_loss(
    logits_CV: torch.Tensor,
    y_C: torch.Tensor,
    w_C: torch.Tensor,
    ce_dtype: torch.dtype,
    want_grad: bool,
    fused: bool,
    kernel: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's loss: eagerly, or fused: by the Triton kernel where it applies (a GPU, float32
    softmax; dflash.step.loss_kernel, which overwrites the logits with their gradient), else the compiled
    chunk function."""
    if not fused:
        return chunk_cross_entropy(logits_CV, y_C, w_C, ce_dtype, want_grad)
    if kernel and loss_kernel.supports(logits_CV, ce_dtype):
        return loss_kernel.chunk_cross_entropy_kernel(logits_CV, y_C, w_C, want_grad)
    for t in (logits_CV, y_C, w_C):
        torch._dynamo.mark_dynamic(t, 0)
    with torch.autocast(logits_CV.device.type, enabled=False):
        return _chunk_cross_entropy_compiled()(logits_CV, y_C, w_C, ce_dtype, want_grad)


class _HeadCrossEntropy(torch.autograd.Function):
    """Sum over N tokens of w_n * CE(h_n @ W^T, y_n), chunked over N, with the gradient computed in the
    forward pass: per chunk, dL/dlogits = w * (softmax - onehot) is known as soon as the logits
    are, so dL/dh = dL/dlogits @ W is taken there and then and the [chunk, vocab] logits are freed.
    Backward only scales the stored gradient. Against recomputing each chunk in backward (activation
    checkpointing, as cut-cross-entropy and liger-kernel do for per-token losses) this saves one
    [N, H] x [H, V] matmul per step: for the 8B drafter's 152K-entry vocab that is 2 x N x V x H =
    20 TFLOP of a ~150 TFLOP step. The [N, V] logits of a large vocab never exist at once, in forward
    or backward; each chunk's elementwise work is chunk_cross_entropy (compiled with fused=True).

    The head is the target's and normally frozen; when it does require grad, dL/dW is accumulated
    the same way."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_NH: torch.Tensor,
        head_weight_VH: torch.Tensor,
        labels_N: torch.Tensor,
        weights_N: torch.Tensor,
        chunk_tokens: int,
        fused: bool,
        kernel: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Under autocast the matmuls run in the autocast dtype; outside it, in the hidden's dtype.
        mm_dtype = (
            torch.get_autocast_dtype(hidden_NH.device.type)
            if torch.is_autocast_enabled(hidden_NH.device.type)
            else hidden_NH.dtype
        )
        w_VH = head_weight_VH.to(mm_dtype)
        ce_dtype = torch.promote_types(mm_dtype, torch.float32)  # softmax/CE in fp32 (or wider)
        n = hidden_NH.shape[0]
        total = torch.zeros((), dtype=ce_dtype, device=hidden_NH.device)
        correct_N = torch.zeros(n, dtype=torch.bool, device=hidden_NH.device)
        grad_h_NH = torch.empty_like(hidden_NH) if want_h else None
        grad_w_VH = torch.zeros_like(head_weight_VH, dtype=ce_dtype) if want_w else None
        for start in range(0, n, chunk_tokens):
            end = min(n, start + chunk_tokens)
            h_CH = hidden_NH[start:end].to(mm_dtype)
            y_C, w_C = labels_N[start:end], weights_N[start:end].to(ce_dtype)
            logits_CV = h_CH @ w_VH.t()
            part, correct_N[start:end], g_CV = _chunk_loss(
                logits_CV, y_C, w_C, ce_dtype, want_h or want_w, fused, kernel
            )
            total += part
            del logits_CV  # the [chunk, vocab] logits go before the gradient's matmuls (the kernel's
            # gradient is written over them: then g_CV holds their storage)
            if g_CV is None:
                continue
            if grad_h_NH is not None:
                grad_h_NH[start:end] = (g_CV @ w_VH).to(hidden_NH.dtype)
            if grad_w_VH is not None:
                grad_w_VH += (g_CV.t() @ h_CH).to(ce_dtype)
            del g_CV
        ctx.save_for_backward(*(t for t in (grad_h_NH, grad_w_VH) if t is not None))
        ctx.weight_dtype = head_weight_VH.dtype
        ctx.mark_non_differentiable(correct_N)
        return total, correct_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_total: torch.Tensor, _grad_correct: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = grad_w = None
        if want_h:
            g_h = saved.pop(0)
            grad_h = g_h * grad_total.to(g_h.dtype)
        if want_w:
            g_w = saved.pop(0)
            grad_w = (g_w * grad_total.to(g_w.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


class _TakeRows(torch.autograd.Function):
    """x_NH.index_select(0, sel), its backward writing each row's gradient (index_copy_) where
    index_select's adds it (index_add_: float atomics, 0.53 ms of the 8B step on the H200). The
    same gradient: sel's first n rows are distinct (the trained positions); the rows after them are
    the padding's, whose gradients are exactly zero (weight 0), so they are left out."""

    @staticmethod
    def forward(ctx: Any, x_NH: torch.Tensor, sel: torch.Tensor, n: int) -> torch.Tensor:
        ctx.save_for_backward(sel[:n])
        ctx.rows = x_NH.shape[0]
        return x_NH.index_select(0, sel)

    @staticmethod
    def backward(ctx: Any, grad_nH: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (sel,) = ctx.saved_tensors
        grad_NH = grad_nH.new_zeros(ctx.rows, grad_nH.shape[1])
        return grad_NH.index_copy_(0, sel, grad_nH[: sel.shape[0]]), None, None


def trained_count(valid_BAK: torch.Tensor) -> HostCopy:
    """The batch's trained block positions, on its way to the host.

    The trainer counts them from the labels before it queues the forward; the copy is queued right
    behind that count. The loss reads it after the forward is queued, so the read waits only for the
    count, never for the forward. Reading the count where the loss needs it, as `nonzero` did, waits
    for the whole forward: the GPU then idles while the host queues the rest of the step (13 ms of
    host gaps in the 8B step on the H200, docs/BENCHMARKS.md)."""
    return HostCopy(valid_BAK.sum())


def dflash_loss(
    hidden_BAKH: torch.Tensor,
    head_weight_VH: torch.Tensor,
    labels_BAK: torch.Tensor,
    valid_BAK: torch.Tensor,
    gamma: float,
    chunk_tokens: int = 8192,
    *,
    fused: bool = False,
    trained: HostCopy | None = None,
    kernel: bool = True,
) -> LossOutput:
    """Weighted cross-entropy over trained block positions through the frozen head, in chunks of
    `chunk_tokens` with the gradient taken in the forward pass (see _HeadCrossEntropy). fused=True
    runs each chunk's softmax, loss, accuracy and gradient fused (train.fused_loss): on a GPU by the
    Triton kernel of dflash.step.loss_kernel, elsewhere (or with kernel=False) as one compiled function.

    Only the trained positions go through the head: their indices are the valid ones, ascending, and
    their count comes from `trained` (trained_count(valid_BAK), started before the forward: then
    nothing here waits for the device; without it the count is read here, after the forward).
    Accuracy stays on the device until LossOutput is read."""
    B, A, K, H = hidden_BAKH.shape
    dev = hidden_BAKH.device
    w_K = position_weights(K, gamma, dev)
    n = int((trained or trained_count(valid_BAK)).get())
    valid_N = valid_BAK.reshape(-1)
    # The valid indices in ascending order, as nonzero gives them, with their count known: a stable
    # sort puts the valid rows first.
    sel = torch.argsort((~valid_N).to(torch.int8), stable=True)[:n]
    k_N = sel % K
    weights_N = w_K[k_N]
    if fused:
        # Chunks of whole multiples too, so the last one is never 0 or 1 rows either.
        chunk_tokens = max(LOSS_ROW_MULTIPLE, chunk_tokens // LOSS_ROW_MULTIPLE * LOSS_ROW_MULTIPLE)
    if fused and n % LOSS_ROW_MULTIPLE:
        # Padding rows repeat token 0 with weight 0: their gradient is exactly zero.
        pad = LOSS_ROW_MULTIPLE - n % LOSS_ROW_MULTIPLE
        sel = torch.cat([sel, sel.new_zeros(pad)])
        weights_N = torch.cat([weights_N, weights_N.new_zeros(pad)])
    hidden_NH = _TakeRows.apply(hidden_BAKH.reshape(-1, H), sel, n)
    labels_N = labels_BAK.reshape(-1).index_select(0, sel)
    total, correct_N = _HeadCrossEntropy.apply(
        hidden_NH, head_weight_VH, labels_N, weights_N, chunk_tokens, fused, kernel
    )
    loss = total / weights_N.sum().clamp_min(1e-6)
    with torch.no_grad():
        hits_K = torch.zeros(K, device=dev).index_add_(0, k_N, correct_N[:n].float())
        counts_K = torch.zeros(K, device=dev).index_add_(0, k_N, torch.ones(n, device=dev))
    return LossOutput(loss=loss, hits_K=hits_K, counts_K=counts_K)


def expected_streak(acc_per_pos: list[float]) -> float:
    """Expected accepted draft length: sum_k prod_{j<=k} p_j (positions with no data count as 0)."""
    total, run = 0.0, 1.0
    for p in acc_per_pos:
        run *= 0.0 if math.isnan(p) else p
        total += run
    return total
