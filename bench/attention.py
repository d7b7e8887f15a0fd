"""DFlash attention: flex vs the sdpa backend vs dense-mask SDPA, fwd and fwd+bwd, effective TFLOP/s.

H200 (the issue's shape: 32 heads, 8 kv heads, head dim 128, block 16, 512 anchors, 3072 context, bf16):
    .venv/bin/python bench/attention.py --out $OUT/attention.json
CPU smoke run at a tiny size (flex runs forward only there: it has no CPU backward):
    .venv/bin/python bench/attention.py --tiny --out /tmp/attention.json

Effective TFLOP/s counts only unmasked query-key pairs, per query head: 4*D FLOPs per pair forward
(QK^T and PV); the backward is 2.5x the forward (the FlashAttention convention: 5 matmuls with the
recomputed scores), so fwd+bwd = 3.5x forward. Mask/plan construction is timed separately (it runs
once per batch, shared by all layers of a type). The same run checks numerics: relative error of
the sdpa backend and of dense SDPA against flex (out and grads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import bench_ms, default_out, report_header, write_report  # noqa: E402  (bench/, the script's own directory)

from dflash.step.attention.mask import allowed_pairs, dense_mask  # noqa: E402
from dflash.step.model import make_backend  # noqa: E402

FWD_BWD_FACTOR = 3.5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--windows", default="full,2048", help="comma list: full and/or sliding window sizes")
    ap.add_argument("--sdpa-chunk-blocks", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="tiny float32 shape (CPU smoke run)")
    ap.add_argument("--out", default=default_out("attention"))
    args = ap.parse_args()
    if args.tiny:
        args.heads, args.kv_heads, args.head_dim, args.block, args.anchors, args.context = 4, 2, 16, 7, 6, 100
        args.windows, args.reps = "full,13", 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" and not args.tiny else torch.float32
    torch.manual_seed(0)
    B, A, K, S, H, G, D = (
        args.batch,
        args.anchors,
        args.block,
        args.context,
        args.heads,
        args.kv_heads,
        args.head_dim,
    )
    anchors = torch.stack([torch.sort(torch.randperm(S - 1)[:A] + 1).values for _ in range(B)]).to(device)
    seq_lens = torch.full((B,), S, device=device)
    q = torch.randn(B, H, A * K, D, device=device, dtype=dtype)
    k = torch.randn(B, G, S + A * K, D, device=device, dtype=dtype)
    v = torch.randn(B, G, S + A * K, D, device=device, dtype=dtype)
    grad = torch.randn_like(q)
    backends = {
        "flex": make_backend("flex"),
        "sdpa": make_backend("sdpa", sdpa_chunk_blocks=args.sdpa_chunk_blocks),
    }
    can_backward = {"flex": device == "cuda", "sdpa": True, "dense_sdpa": True}

    results, numerics = [], {}
    for wname in args.windows.split(","):
        window = None if wname == "full" else int(wname)
        pairs = allowed_pairs(anchors, seq_lens, context_len=S, block_size=K, window=window) * H
        density = pairs / (B * H * A * K * (S + A * K))
        fwd_flops = 4 * D * pairs
        plans, prep_ms = {}, {}
        for name, be in backends.items():

            def prepare(be=be, window=window):
                return be.prepare(anchors, seq_lens, context_len=S, block_size=K, windows=[window])[window]

            plans[name] = prepare()  # first call compiles (flex)
            prep_ms[name] = bench_ms(prepare, device, 3)
        dense_B1QL = dense_mask(anchors.cpu(), seq_lens.cpu(), context_len=S, block_size=K, window=window)[
            :, None
        ].to(device)
        k_rep, v_rep = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
        fns = {
            "flex": lambda qq, kk, vv, p=plans: backends["flex"].attend(qq, kk, vv, p["flex"]),
            "sdpa": lambda qq, kk, vv, p=plans: backends["sdpa"].attend(qq, kk, vv, p["sdpa"]),
            "dense_sdpa": lambda qq, kk, vv, m=dense_B1QL: F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=m
            ),
        }
        outs = {}
        for name, fn in fns.items():
            kk, vv = (k_rep, v_rep) if name == "dense_sdpa" else (k, v)
            with torch.no_grad():
                ms = bench_ms(lambda fn=fn, kk=kk, vv=vv: fn(q, kk, vv), device, args.reps)
            results.append(dict(window=wname, method=name, mode="fwd", ms=ms, tflops=fwd_flops / ms / 1e9))
            if not can_backward[name]:
                with torch.no_grad():
                    outs[name] = (fn(q, kk, vv),)
                continue
            qq, kg, vg = (t.detach().clone().requires_grad_() for t in (q, kk, vv))

            def step(fn=fn, qq=qq, kg=kg, vg=vg):
                qq.grad = kg.grad = vg.grad = None
                fn(qq, kg, vg).backward(grad)

            ms = bench_ms(step, device, args.reps)
            results.append(
                dict(
                    window=wname,
                    method=name,
                    mode="fwd+bwd",
                    ms=ms,
                    tflops=FWD_BWD_FACTOR * fwd_flops / ms / 1e9,
                )
            )
            step()
            dk, dv = kg.grad, vg.grad
            if name == "dense_sdpa":  # fold the repeated kv heads back onto the shared ones
                dk, dv = (t.view(B, G, H // G, *t.shape[2:]).sum(2) for t in (dk, dv))
            outs[name] = (fn(qq, kg, vg).detach(), qq.grad, dk, dv)
        ref = "flex" if len(outs["flex"]) == 4 else "dense_sdpa"
        numerics[wname] = {
            f"{name}_vs_{ref}": {
                t: rel_err(a, b)
                for t, a, b in zip(("out", "dq", "dk", "dv"), outs[name], outs[ref], strict=False)
            }
            for name in outs
            if name != ref
        }
        if ref != "flex":
            numerics[wname]["flex_vs_dense_sdpa"] = {"out": rel_err(outs["flex"][0], outs["dense_sdpa"][0])}
        numerics[wname]["density"] = density
        numerics[wname]["prepare_ms"] = prep_ms

    def find(w, m, mode):
        return next((r for r in results if (r["window"], r["method"], r["mode"]) == (w, m, mode)), None)

    summary = {}
    for wname in args.windows.split(","):
        f, s, d = (find(wname, m, "fwd+bwd") for m in ("flex", "sdpa", "dense_sdpa"))
        if f and d:
            summary[f"{wname}: flex speed-up over dense SDPA, fwd+bwd (target >= 3.5)"] = d["ms"] / f["ms"]
        if f and s:
            summary[f"{wname}: sdpa backend time / flex time, fwd+bwd (target <= 1.3)"] = s["ms"] / f["ms"]
    report = {
        **report_header("attention", device == "cuda"),
        "dtype": str(dtype),
        "config": vars(args),
        "flops": "unmasked query-key pairs x heads x 4*D (fwd); fwd+bwd = 3.5 x fwd",
        "results": results,
        "numerics": numerics,
        "summary": summary,
    }
    write_report(args.out, report)
    print(f"{'layer':>6} {'method':>11} {'mode':>8} {'ms':>9} {'TFLOP/s':>8}")
    for r in results:
        print(f"{r['window']:>6} {r['method']:>11} {r['mode']:>8} {r['ms']:9.3f} {r['tflops']:8.2f}")
    for key, val in summary.items():
        print(f"{key}: {val:.2f}")
    print(json.dumps(numerics, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
