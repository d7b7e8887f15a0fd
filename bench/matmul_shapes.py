"""The 8B drafter step's matrix products one by one at the step's shapes, and fused alternatives.

A probe for design choices, not the step's measurement (that is bench/drafter_step.py, whose
--profile reports the step's own products by shape): for each linear of the step, its forward
(F.linear, as the layers call it), input gradient and weight gradient, timed alone in bf16 with
CUDA events, with TFLOP/s; then the same work as one product where two linears read the same
input (k_proj + v_proj over the block, gate_proj + up_proj): whether concatenating their weights
would be faster. The context's keys and values of all layers are one product in the step
(DFlashDrafter.context_kv): "context kv", against one layer's k_proj over the context ("k_proj ctx").

    python bench/matmul_shapes.py --out $OUT/matmul_shapes.json

Shapes (Qwen3-8B drafter of configs/qwen3-8b.toml at the bench's 2 x 4096 tokens, 512 anchors of 16):
block tokens 16,384, context tokens 8,192, 5 layers, hidden 4096, 32/8 heads of 128, intermediate
12,288, fc 5 x 4096 -> 4096 over the context, LM head 151,936 x 4096 over a loss chunk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # dflash, for the report's atomic write (bench/common.py)

from common import default_out, report_header, time_loop, write_report  # noqa: E402  (bench/, the script's own directory)

H, HQ, G, D, FI, V = 4096, 32, 8, 128, 12288, 151936
N_BLOCK, N_CTX, CHUNK, N_TARGET, LAYERS = 16384, 8192, 8192, 5, 5

# (name, tokens M, in K, out N, passes): passes are the products the step runs for the linear.
LINEARS = [
    ("q_proj", N_BLOCK, H, HQ * D, ("fwd", "dgrad", "wgrad")),
    ("k_proj", N_BLOCK, H, G * D, ("fwd", "dgrad", "wgrad")),
    ("v_proj", N_BLOCK, H, G * D, ("fwd", "dgrad", "wgrad")),
    ("kv fused", N_BLOCK, H, 2 * G * D, ("fwd", "dgrad", "wgrad")),
    ("context kv", N_CTX, H, LAYERS * 2 * G * D, ("fwd", "dgrad", "wgrad")),
    ("k_proj ctx", N_CTX, H, G * D, ("fwd", "dgrad", "wgrad")),
    ("o_proj", N_BLOCK, HQ * D, H, ("fwd", "dgrad", "wgrad")),
    ("gate_proj", N_BLOCK, H, FI, ("fwd", "dgrad", "wgrad")),
    ("up_proj", N_BLOCK, H, FI, ("fwd", "dgrad", "wgrad")),
    ("gate+up fused", N_BLOCK, H, 2 * FI, ("fwd", "dgrad", "wgrad")),
    ("down_proj", N_BLOCK, FI, H, ("fwd", "dgrad", "wgrad")),
    ("fc", N_CTX, N_TARGET * H, H, ("fwd", "wgrad")),
    ("lm_head chunk", CHUNK, H, V, ("fwd", "dgrad")),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=default_out("matmul_shapes"))
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this probe times GPU matrix products")
    rows: list[dict[str, Any]] = []
    report = {**report_header("matmul_shapes", True), "reps": args.reps, "rows": rows}
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    for name, M, K, N, passes in LINEARS:
        x = torch.randn(M, K, **bf16)
        w = torch.randn(N, K, **bf16) * 0.02
        dy = torch.randn(M, N, **bf16)
        fns = {
            "fwd": lambda x=x, w=w: F.linear(x, w),
            "dgrad": lambda dy=dy, w=w: dy @ w,
            "wgrad": lambda dy=dy, x=x: dy.t() @ x,
        }
        for p in passes:
            ms = time_loop(fns[p], "cuda", args.reps, warmup=3)
            tflops = 2 * M * K * N / (ms * 1e-3) / 1e12
            rows.append(
                {
                    "linear": name,
                    "pass": p,
                    "M": M,
                    "K": K,
                    "N": N,
                    "ms": round(ms, 4),
                    "tflops": round(tflops, 1),
                }
            )
            print(f"{name:>14} {p:>5} [{M} x {K}] -> {N}: {ms:7.3f} ms {tflops:6.1f} TFLOP/s", flush=True)
        del x, w, dy
    write_report(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
