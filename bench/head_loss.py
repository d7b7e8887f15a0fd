"""The LM-head cross-entropy of the DFlash objective, side by side: the job's loss (chunked, the
gradient taken in the forward pass) with each chunk's elementwise work fused (train.fused_loss =
true: on a GPU by the Triton kernel of dflash.step.loss_kernel, or as one compiled function) and run
eagerly (false); the same chunks under activation checkpointing (each chunk's logits recomputed in
backward); plain autograd through the full [N, V] logits; and, where installed, the kernel libraries
that fuse the head and the loss: liger-kernel's fused linear cross-entropy and cut-cross-entropy,
both with reduction="none" times the per-position weights (the DFlash loss weights every token,
which neither supports otherwise; both then recompute the logits in backward).

H200 (the 8B drafter's head: 16384 block tokens x hidden 4096 x vocab 151936, bf16 autocast):
    python bench/head_loss.py --out $OUT/head_loss.json
    python bench/head_loss.py --skip-unchunked --ce-sweep --out $OUT/head_loss.json  # + the kernel's tiles
CPU (a smaller head; fp32):
    python bench/head_loss.py --tokens 4096 --hidden 512 --vocab 32768 --chunk 1024 --reps 3 --out /tmp/head_loss.json

Times forward + backward into the hidden states (the head is frozen, as in training), on CUDA the
peak memory above the inputs, and each variant's relative error in loss and input gradient against
the job's eager path. FLOPs counted: 4 x N x V x H (logits + input gradient) for every variant,
whatever it really does (checkpointing and the libraries do 6 x N x V x H).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_ms, default_out, write_report  # noqa: E402

from dflash.step.objective import dflash_loss, position_weights  # noqa: E402


def _chunk_ce(
    head_VH: torch.Tensor, h_CH: torch.Tensor, y_C: torch.Tensor, w_C: torch.Tensor
) -> torch.Tensor:
    return (F.cross_entropy((h_CH @ head_VH.t()).float(), y_C, reduction="none") * w_C).sum()


def checkpointed(
    hidden_NH: torch.Tensor, head_VH: torch.Tensor, y_N: torch.Tensor, w_N: torch.Tensor, chunk: int
) -> torch.Tensor:
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for s in range(0, hidden_NH.shape[0], chunk):
        sl = slice(s, s + chunk)
        total = total + checkpoint(_chunk_ce, head_VH, hidden_NH[sl], y_N[sl], w_N[sl], use_reentrant=False)
    return total / w_N.sum()


def unchunked(
    hidden_NH: torch.Tensor, head_VH: torch.Tensor, y_N: torch.Tensor, w_N: torch.Tensor, _chunk: int
) -> torch.Tensor:
    return _chunk_ce(head_VH, hidden_NH, y_N, w_N) / w_N.sum()


def _weighted(per_token: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A library's reduction="none" fused linear cross-entropy as the DFlash per-token weighted loss."""

    def loss(h: torch.Tensor, head: torch.Tensor, y: torch.Tensor, w: torch.Tensor, _c: int) -> torch.Tensor:
        return (per_token(h.to(head.dtype), head, y, reduction="none").float() * w).sum() / w.sum()

    return loss


def library_losses() -> dict[str, Callable[..., torch.Tensor]]:
    """The fused linear cross-entropy of each installed kernel library, as a per-token weighted loss."""
    out: dict[str, Callable[..., torch.Tensor]] = {}
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out["liger-kernel FLCE (none x w)"] = _weighted(liger_fused_linear_cross_entropy)
    except ImportError:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy

        out["cut-cross-entropy (none x w)"] = _weighted(linear_cross_entropy)
    except ImportError:
        pass
    return out


CE_SWEEP = [(2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 8), (8192, 16), (8192, 32), (16384, 32)]
"""(tile, warps) of the loss kernel timed by --ce-sweep; dflash.step.loss_kernel's defaults come from it."""


def ce_sweep(chunk: int, vocab: int, reps: int) -> list[dict[str, object]]:
    """The chunk's elementwise work alone, on bf16 logits of one chunk: the kernel at each (tile,
    warps), and the compiled chunk function, with the bytes each moves per ms (the kernel reads the
    logits twice and writes the gradient once)."""
    from dflash.step import loss_kernel
    from dflash.step.objective import _chunk_loss

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(chunk, vocab, device="cuda", dtype=torch.bfloat16, generator=g)
    y = torch.randint(0, vocab, (chunk,), device="cuda", generator=g)
    w = torch.rand(chunk, device="cuda", generator=g)
    work = logits.clone()
    nbytes = 3 * logits.numel() * logits.element_size()
    rows: list[dict[str, object]] = []

    def timed(name: str, fn: Callable[[], object], **extra: object) -> None:
        def run() -> object:
            work.copy_(logits)  # the kernel consumes its logits: every rep starts from the same ones
            return fn()

        copy_ms = bench_ms(lambda: work.copy_(logits), "cuda", reps)
        ms = bench_ms(run, "cuda", reps) - copy_ms
        rows.append({"variant": name, "ms": ms, "tb_s": nbytes / ms / 1e9, **extra})
        print(
            f"  ce {name:28s} {ms:7.3f} ms  {nbytes / ms / 1e9:5.2f} TB/s (3 passes of bf16 logits)",
            flush=True,
        )

    for block, warps in CE_SWEEP:
        timed(
            f"kernel tile {block} warps {warps}",
            lambda b=block, nw=warps: loss_kernel.chunk_cross_entropy_kernel(
                work, y, w, True, block=b, num_warps=nw
            ),
            block=block,
            warps=warps,
        )
    timed("compiled chunk", lambda: _chunk_loss(work, y, w, torch.float32, True, True, kernel=False))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="trained block tokens N")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument(
        "--chunk", type=int, default=8192, help="block tokens per chunk (train.loss_chunk_tokens)"
    )
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-unchunked", action="store_true", help="skip the full-logits baseline (memory)")
    ap.add_argument(
        "--ce-sweep",
        action="store_true",
        help="also time the loss kernel alone on one chunk's logits for each (tile, warps) of CE_SWEEP "
        "against the compiled chunk function (GPU)",
    )
    ap.add_argument("--out", default=default_out("head_loss"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    K = args.block
    blocks = args.tokens // (K - 1)
    hidden_BAKH = torch.randn(1, blocks, K, args.hidden, device=device, dtype=dtype, requires_grad=True)
    head_VH = torch.randn(args.vocab, args.hidden, device=device, dtype=dtype) * 0.02
    labels_BAK = torch.randint(0, args.vocab, (1, blocks, K), device=device)
    valid_BAK = torch.ones(1, blocks, K, dtype=torch.bool, device=device)
    valid_BAK[..., 0] = False
    n = int(valid_BAK.sum())
    # The baselines get the same selected rows and weights the job's loss builds internally.
    hidden_NH = hidden_BAKH.detach()[valid_BAK].requires_grad_()
    y_N = labels_BAK[valid_BAK]
    w_N = position_weights(K, 7.0, torch.device(device)).expand(1, blocks, K)[valid_BAK]
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def job(fused: bool, kernel: bool = True) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            hidden_BAKH.grad = None
            with autocast:
                out = dflash_loss(
                    hidden_BAKH, head_VH, labels_BAK, valid_BAK, 7.0, args.chunk, fused=fused, kernel=kernel
                )
            out.loss.backward()
            return out.loss

        return run

    def baseline(fn: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            hidden_NH.grad = None
            with autocast:
                loss = fn(hidden_NH, head_VH, y_N, w_N, args.chunk)
            loss.backward()
            return loss

        return run

    variants: dict[str, tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]] = {
        "job, fused (compiled chunk)": (job(True, kernel=False), lambda: hidden_BAKH.grad[valid_BAK]),
        "job, eager chunk": (job(False), lambda: hidden_BAKH.grad[valid_BAK]),
        "checkpointed chunks": (baseline(checkpointed), lambda: hidden_NH.grad),
    }
    if device == "cuda":  # the kernel's path (elsewhere fused=True is the compiled chunk)
        variants = {
            "job, fused (Triton kernel)": (job(True), lambda: hidden_BAKH.grad[valid_BAK]),
            **variants,
        }
    if not args.skip_unchunked:
        variants["unchunked autograd"] = (baseline(unchunked), lambda: hidden_NH.grad)
    for name, fn in library_losses().items():
        variants[name] = (baseline(fn), lambda: hidden_NH.grad)
    flops = 4 * n * args.vocab * args.hidden
    results = []
    outputs: dict[str, tuple[float, torch.Tensor]] = {}
    for name, (fn, grad_of) in variants.items():
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        try:
            loss = float(fn().detach())
            outputs[name] = (loss, grad_of().float().clone())
            ms = bench_ms(fn, device, args.reps)
        except Exception as e:  # a library that does not run here is reported, not fatal
            results.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(f"{name:28s} failed: {results[-1]['error']}", flush=True)
            continue
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device == "cuda" else None
        results.append({"variant": name, "ms": ms, "tflops": flops / ms / 1e9, "peak_extra_gb": peak})
        print(
            f"{name:28s} {ms:9.2f} ms  {flops / ms / 1e9:7.1f} TFLOP/s  peak +{peak or 0:.2f} GiB", flush=True
        )
    sweep = ce_sweep(args.chunk, args.vocab, args.reps) if args.ce_sweep and device == "cuda" else None
    ref = outputs.get("job, eager chunk")
    for r in results:
        if ref is None or r["variant"] not in outputs:
            continue
        loss, grad = outputs[r["variant"]]
        r["loss_rel_err_vs_eager"] = abs(loss - ref[0]) / max(abs(ref[0]), 1e-30)
        r["grad_rel_err_vs_eager"] = ((grad - ref[1]).norm() / ref[1].norm().clamp(min=1e-30)).item()
    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "trained_tokens": n,
        "flops": flops,
        "results": results,
        "ce_sweep": sweep,
    }
    write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
