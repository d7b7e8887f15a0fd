"""The drafter's optimizer step (clipping and AdamW through dflash.step.trainer.clip_and_step, as the
trainer calls it) on the 8B drafter's own trainable parameters: the job's KernelAdamW
(dflash.step.optim_kernel) against torch's fused AdamW, and the kernel's tile and warps swept.

H200:  python bench/optimizer.py --sweep --out $OUT/optimizer.json
CPU:   python bench/optimizer.py --tiny --out /tmp/optimizer.json   (smoke run: off CUDA both are torch's)

Gradients are random, in each parameter's dtype as the backward makes them (the clip factor
applies: the grad_scale path). GB/s counts the bytes each update must move: 28 per parameter for
the kernel (parameter, gradient and two moments read; parameter and moments written; with bf16
weights (train.bf16_weights) the float32 master, a bf16 gradient and the moments read, master,
moments and the bf16 weight written: 28 too), 32 for torch's fused AdamW (it also writes the
unscaled gradient back; timed only on float32 weights), plus the gradient norm's read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_ms, default_out, report_header, write_report  # noqa: E402
from drafter_step import build_trainer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also the kernel at other tiles and warps")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model on CPU (smoke run)")
    ap.add_argument("--out", default=default_out("optimizer"))
    args = ap.parse_args()
    import torch

    from dflash.step.optim_kernel import BLOCK, NUM_WARPS, KernelAdamW
    from dflash.step.trainer import clip_and_step

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke run")
    # drafter_step's trainer at its batch shape (the shape does not matter here: no step is taken).
    ns = argparse.Namespace(
        batch=2, seq_len=96 if args.tiny else 4096, anchors=8 if args.tiny else 512,
        loss_chunk=24 if args.tiny else 8192, sdpa_chunk_blocks=64, tiny=args.tiny, set=[],
    )  # fmt: skip
    trainer, cfg, _ = build_trainer(ns, "sdpa" if args.tiny else "flex")
    device = "cpu" if args.tiny else "cuda"
    params = trainer.params
    n = sum(p.numel() for p in params)
    gen = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 10.0).to(p.dtype)  # clipped
    clip = cfg.train.grad_clip
    t = cfg.train
    adamw = dict(lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)

    norm_bytes = sum(p.numel() * p.grad.element_size() for p in params)

    def timed(name: str, opt: Any, bytes_per_param: int) -> dict[str, Any]:
        ms = bench_ms(lambda: clip_and_step(opt, params, clip), device, args.reps)
        gbs = (n * bytes_per_param + norm_bytes) / ms / 1e6
        row = {"variant": name, "ms": round(ms, 3), "GB_per_s": round(gbs, 1)}
        print(f"{name:<48} {ms:8.3f} ms  {gbs:8.1f} GB/s", flush=True)
        return row

    rows = [timed(f"job: {type(trainer.optimizer).__name__} (the trainer's)", trainer.optimizer, 28)]
    if not trainer.masters:  # torch's would update bf16 weights themselves: not the same step
        rows.append(timed("torch AdamW(fused=True)", torch.optim.AdamW(params, fused=True, **adamw), 32))
    if args.sweep and not args.tiny:
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 16)):
            if (block, warps) != (BLOCK, NUM_WARPS):
                opt = KernelAdamW(params, masters=trainer.masters, block=block, num_warps=warps, **adamw)
                rows.append(timed(f"KernelAdamW tile {block}, {warps} warps", opt, 28))
                del opt
    report = {
        **report_header("optimizer", device == "cuda"),
        "params": n,
        "tensors": len(params),
        "bf16_weights": trainer.bf16_weights,
        "kernel_default": {"block": BLOCK, "num_warps": NUM_WARPS},
        "results": rows,
    }
    write_report(args.out, report)


if __name__ == "__main__":
    main()
