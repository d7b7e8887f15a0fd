"""The attention's q/k RMSNorm + rotary embedding at the 8B drafter step's sizes: the module path as
dflash.step.model.DrafterAttention runs it (Qwen3RMSNorm, transpose, apply_rotary_pos_emb, the cast to
bf16), compiled by inductor as the trainer's regional compile does, against dflash's kernel
(`attention.fused_qk_norm_rope`, the op dflash.step.attention.qk_norm_rope.qk_norm_rope), forward and
forward + backward; then the kernel alone for each (rows per program, warps, backward programs).

H200:  python bench/qk_norm_rope.py --sweep --out $OUT/qk_norm_rope.json
CPU:   TRITON_INTERPRET=1 python bench/qk_norm_rope.py --tiny --sweep --out /tmp/qk.json  (mechanics only)

Shapes (the 8B step: 2 sequences, 512 anchors x 16 block tokens, 4096 context tokens, 32 query and
8 key/value heads of 128): q [2, 8192, 32, 128], k [2, 12288, 8, 128] in bf16, cos/sin float32 as
in the job. GB/s counts the bytes the pass must move: forward x read and out written, backward the
gradient and x read and dx written (cos/sin and the weight are small and cached).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_ms, default_out, report_header, write_report  # noqa: E402

# (rows per program, warps, backward programs; 0: one row block per program). The shipped
# qk_norm_rope.FORWARD and BACKWARD are this sweep's winners on the H200 (16, 4) and (16, 2, 4096).
SWEEP = [
    (32, 8, 1024),
    (32, 8, 4096),
    (32, 8, 0),
    (32, 4, 1024),
    (16, 4, 1024),
    (16, 4, 4096),
    (16, 2, 4096),
    (64, 8, 1024),
    (8, 2, 4096),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also the kernel alone at each of SWEEP's settings")
    ap.add_argument("--tiny", action="store_true", help="small shapes (CPU: through Triton's interpreter)")
    ap.add_argument("--out", default=default_out("qk_norm_rope"))
    args = ap.parse_args()
    import torch
    from transformers import Qwen3Config

    from dflash.step.attention import qk_norm_rope as qk
    from dflash.step.model import Qwen3RMSNorm, Qwen3RotaryEmbedding, norm_rope

    on_gpu = torch.cuda.is_available() and not args.tiny
    if not args.tiny and not on_gpu:
        raise SystemExit("no CUDA device: run with --tiny (and TRITON_INTERPRET=1) for the CPU smoke run")
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit(
            "on the CPU the kernels run only through Triton's interpreter: set TRITON_INTERPRET=1"
        )
    device = "cuda" if on_gpu else "cpu"
    B, Tq, Tk, H, G, D = (2, 8192, 12288, 32, 8, 128) if not args.tiny else (1, 24, 40, 4, 2, 16)
    gen = torch.Generator(device=device).manual_seed(0)

    # The drafter's rotary embedding, as DFlashDrafter builds it; float32 cos/sin as in the job.
    rotary = Qwen3RotaryEmbedding(
        Qwen3Config(hidden_size=H * D, num_attention_heads=H, head_dim=D, rope_theta=1e6)
    )
    rotary = rotary.to(device)

    def rope(T: int) -> tuple[Any, Any]:
        pos = torch.arange(T, device=device)[None].expand(B, T)
        return rotary(torch.zeros(1, device=device), pos)

    # The job's own q/k path (dflash.step.model.norm_rope), cast to the dtype the attention takes.
    compiled = {
        path: torch.compile(
            lambda x, norm, cos, sin, fused=fused: norm_rope(x, norm, (cos, sin), fused).to(torch.bfloat16),
            fullgraph=True,
        )
        for path, fused in (("module", False), ("dflash", True))
    }

    def measure(name: str, T: int, heads: int) -> list[dict[str, Any]]:
        """The module path and the kernel for one tensor (q or k); rows of the report."""
        rows: list[dict[str, Any]] = []
        x = torch.randn(B, T, heads, D, generator=gen, device=device).to(torch.bfloat16).requires_grad_()
        norm = Qwen3RMSNorm(D, eps=1e-6).to(device)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(D, generator=gen, device=device))
        cos, sin = rope(T)
        g = torch.randn(B, heads, T, D, generator=gen, device=device).to(torch.bfloat16)
        bytes_fwd = 2 * x.numel() * x.element_size()
        bytes_bwd = 3 * x.numel() * x.element_size()
        outs = {}
        for path, fn in compiled.items():

            def fwd(fn: Any = fn) -> Any:
                with torch.no_grad():
                    return fn(x, norm, cos, sin)

            def fwd_bwd(fn: Any = fn) -> Any:
                return torch.autograd.grad(fn(x, norm, cos, sin), (x, norm.weight), g)

            outs[path] = (fwd(), fwd_bwd())
            f_ms = bench_ms(fwd, device, args.reps)
            fb_ms = bench_ms(fwd_bwd, device, args.reps)
            row = {
                "tensor": name, "shape": [B, T, heads, D], "path": path, "fwd_ms": round(f_ms, 4),
                "fwd_bwd_ms": round(fb_ms, 4), "bwd_ms": round(fb_ms - f_ms, 4),
                "fwd_GB_per_s": round(bytes_fwd / f_ms / 1e6, 1),
                "bwd_GB_per_s": round(bytes_bwd / max(fb_ms - f_ms, 1e-6) / 1e6, 1),
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name} {path:<7} fwd {f_ms:7.4f} ms ({row['fwd_GB_per_s']:7.1f} GB/s)  "
                f"fwd+bwd {fb_ms:7.4f} ms  bwd {row['bwd_ms']:7.4f} ms ({row['bwd_GB_per_s']:7.1f} GB/s)",
                flush=True,
            )
        (out_m, (dx_m, dw_m)), (out_d, (dx_d, dw_d)) = outs["module"], outs["dflash"]
        agree = {
            "out_equal_share": float((out_m == out_d).float().mean()),
            "dx_max_abs": float((dx_m.float() - dx_d.float()).abs().max()),
            "dweight_rel": float((dw_m - dw_d).norm() / dw_m.norm()),
        }
        rows[-1]["agreement"] = agree
        print(f"{name} agreement: {agree}", flush=True)
        if args.sweep:
            xd, gd = x.detach(), g.transpose(1, 2)
            for rpp, warps, programs in SWEEP:
                fwd_launch, bwd_launch = qk.Launch(rpp, warps), qk.Launch(rpp, warps, programs)
                p, _ = qk.backward_grid(B * T * heads, bwd_launch)
                f_ms = bench_ms(
                    lambda launch=fwd_launch: qk.qk_norm_rope_forward(
                        xd, norm.weight, cos, sin, 1e-6, launch
                    ),
                    device,
                    args.reps,
                )
                b_ms = bench_ms(
                    lambda launch=bwd_launch: qk.qk_norm_rope_backward(
                        gd, xd, norm.weight, cos, sin, 1e-6, launch
                    ),
                    device,
                    args.reps,
                )
                row = {
                    "tensor": name, "path": "kernel", "rows_per_program": rpp, "num_warps": warps,
                    "programs": p, "fwd_ms": round(f_ms, 4), "bwd_ms": round(b_ms, 4),
                    "fwd_GB_per_s": round(bytes_fwd / f_ms / 1e6, 1), "bwd_GB_per_s": round(bytes_bwd / b_ms / 1e6, 1),
                }  # fmt: skip
                rows.append(row)
                print(
                    f"{name} kernel rows {rpp:3d} warps {warps} programs {p:6d}: fwd {f_ms:7.4f} ms "
                    f"({row['fwd_GB_per_s']:7.1f} GB/s)  bwd {b_ms:7.4f} ms ({row['bwd_GB_per_s']:7.1f} GB/s)",
                    flush=True,
                )
        return rows

    rows = [row for name, T, heads in (("q", Tq, H), ("k", Tk, G)) for row in measure(name, T, heads)]
    write_report(
        args.out,
        {
            **report_header("qk_norm_rope", on_gpu),
            "forward": qk.FORWARD._asdict(),
            "backward": qk.BACKWARD._asdict(),
            "rows": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
