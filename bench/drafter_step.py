"""Drafter training step (fwd + bwd + AdamW) throughput and MFU at the Qwen3-8B drafter size.

H200 (hidden 4096, 32 heads / 8 kv heads, head dim 128, intermediate 12288, vocab 151936, 5 layers =
4 sliding (window 2048) + 1 full, k=5 target layers, block 16, 512 anchors per sequence, bf16
autocast with fp32 master weights and fp32 AdamW state; random target features):
    .venv/bin/python bench/drafter_step.py --out $OUT/drafter_step.json
CPU smoke run at a tiny size (sdpa only: flex has no backward on CPU):
    .venv/bin/python bench/drafter_step.py --tiny --out /tmp/drafter_step.json

FLOPs (stated once, counted per step):
  trainable linears: 6 * params * tokens they see (fc over B*S context tokens; q_proj, o_proj, MLP over
      the N = B*A*K block tokens; k_proj, v_proj over B*S + N tokens);
  frozen LM head: 4 * V * H * N (forward + input gradient; no weight gradient: it is the target's);
  attention: 4 * D * heads * unmasked query-key pairs forward, x3.5 for fwd+bwd (FlashAttention
      convention), summed over layers with each layer's mask.
MFU = FLOPs / step time / 989 TFLOP/s (H200 dense bf16); also reported against the measured 790.
The loss is the job's own (dflash.objective.dflash_loss, as the trainer calls it): cross-entropy on
block positions 1..K-1 against the tokens at anchor+k, weighted exp(-(k-1)/gamma), in chunks of
--loss-chunk block tokens with the head's input gradient taken in the forward pass, so the [N, V]
logits never exist in full and are never recomputed.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import default_out, write_report  # noqa: E402  (bench/, the script's own directory)

from dflash.attention.mask import allowed_pairs  # noqa: E402
from dflash.model import DFlashDrafter, DrafterSpec  # noqa: E402
from dflash.objective import block_labels, dflash_loss  # noqa: E402

PEAK_TFLOPS, MEASURED_TFLOPS = 989.0, 790.0


def make_spec(tiny: bool) -> DrafterSpec:
    if tiny:
        return DrafterSpec(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_layers=3,
            layer_types=["sliding_attention"] * 2 + ["full_attention"],
            sliding_window=32,
            block_size=4,
            target_layer_ids=[1, 3, 5],
            mask_token_id=255,
            vocab_size=256,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=4096,
            target_hidden_size=64,
            target_num_hidden_layers=8,
        )
    return DrafterSpec(
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        num_layers=5,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        sliding_window=2048,
        block_size=16,
        target_layer_ids=[1, 9, 17, 25, 33],
        mask_token_id=151669,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
        target_hidden_size=4096,
        target_num_hidden_layers=36,
    )


def step_flops(spec: DrafterSpec, B: int, S: int, anchors_BA: torch.Tensor, seq_lens_B: torch.Tensor) -> dict:
    H, D, Hq, G, Fi, V = (
        spec.hidden_size,
        spec.head_dim,
        spec.num_attention_heads,
        spec.num_key_value_heads,
        spec.intermediate_size,
        spec.vocab_size,
    )
    N = anchors_BA.numel() * spec.block_size
    ctx = B * S
    fc = 6 * len(spec.target_layer_ids) * spec.target_hidden_size * H * ctx
    per_layer = 6 * (2 * H * Hq * D * N + 2 * H * G * D * (ctx + N) + 3 * H * Fi * N)
    linears = fc + spec.num_layers * per_layer
    lm_head = 4 * V * H * N
    attention = sum(
        3.5
        * 4
        * D
        * Hq
        * allowed_pairs(
            anchors_BA.cpu(),
            seq_lens_B.cpu(),
            context_len=S,
            block_size=spec.block_size,
            window=spec.window(i),
        )
        for i in range(spec.num_layers)
    )
    return {
        "linears": linears,
        "lm_head": lm_head,
        "attention": attention,
        "total": linears + lm_head + attention,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="flex,sdpa")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="block tokens per LM-head/CE chunk")
    ap.add_argument("--sdpa-chunk-blocks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model on CPU (smoke run)")
    ap.add_argument("--out", default=default_out("drafter_step"))
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.tiny:
        args.batch, args.seq_len, args.anchors, args.steps, args.warmup, args.loss_chunk = 2, 96, 8, 2, 1, 24
    backends = [b for b in args.backends.split(",") if b]
    if device == "cpu" and "flex" in backends:
        print("flex skipped: no flex backward on CPU")
        backends.remove("flex")
    spec = make_spec(args.tiny)
    torch.manual_seed(0)
    B, S, A = args.batch, args.seq_len, args.anchors
    wdtype = torch.bfloat16 if device == "cuda" else torch.float32
    embed = torch.randn(spec.vocab_size, spec.hidden_size, device=device, dtype=wdtype) * 0.02
    head = torch.randn(spec.vocab_size, spec.hidden_size, device=device, dtype=wdtype) * 0.02
    input_ids = torch.randint(0, spec.vocab_size - 1, (B, S), device=device)
    feats = torch.randn(
        B, S, len(spec.target_layer_ids) * spec.target_hidden_size, device=device, dtype=wdtype
    )
    anchors = torch.stack([torch.sort(torch.randperm(S - spec.block_size)[:A]).values for _ in range(B)]).to(
        device
    )
    seq_lens = torch.full((B,), S, device=device)
    labels, valid = block_labels(
        input_ids, torch.ones_like(input_ids, dtype=torch.bool), seq_lens, anchors, spec.block_size
    )
    flops = step_flops(spec, B, S, anchors, seq_lens)
    results = []
    for backend in backends:
        model = DFlashDrafter(
            spec, embed, head, backend=backend, sdpa_chunk_blocks=args.sdpa_chunk_blocks
        ).to(device)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=device == "cuda")
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

        def step(model=model, opt=opt, params=params, autocast=autocast) -> float:
            opt.zero_grad(set_to_none=True)
            with autocast:
                hidden = model(input_ids, feats, anchors, seq_lens, noise_std=0.0)
                out = dflash_loss(
                    hidden, model.lm_head_weight_VH, labels, valid, gamma=7.0, chunk_tokens=args.loss_chunk
                )
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            return float(out.loss.detach())

        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        warm_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        losses = [step() for _ in range(args.steps)]
        if device == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        tflops = flops["total"] / dt / 1e12
        results.append(
            {
                "backend": backend,
                "step_ms": dt * 1000,
                "warmup_s": warm_s,
                "seq_tokens_per_s": B * S / dt,
                "block_tokens_per_s": anchors.numel() * spec.block_size / dt,
                "tflops": tflops,
                "mfu": tflops / PEAK_TFLOPS,
                "mfu_vs_measured_790": tflops / MEASURED_TFLOPS,
                "loss_first": losses[0],
                "loss_last": losses[-1],
                "loss_finite": all(math.isfinite(x) for x in losses),
                "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                "params_trainable": sum(p.numel() for p in params),
            }
        )
        del model, opt
        if device == "cuda":
            torch.cuda.empty_cache()
    report = {
        "bench": "drafter_step",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "config": vars(args),
        "spec": spec.to_dict(),
        "flops_per_step": flops,
        "flops_formula": "6*trainable_params*tokens (fc on context, q/o/MLP on block, k/v on context+block) "
        "+ 4*V*H*block_tokens (frozen LM head) + 3.5*4*D*heads*unmasked_pairs (attention)",
        "peak_tflops": PEAK_TFLOPS,
        "results": results,
    }
    write_report(args.out, report)
    print(
        f"FLOPs/step: {flops['total'] / 1e12:.2f} T (linears {flops['linears'] / 1e12:.2f}, "
        f"lm_head {flops['lm_head'] / 1e12:.2f}, attention {flops['attention'] / 1e12:.2f})"
    )
    print(
        f"{'backend':>8} {'step ms':>9} {'seq tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'MFU/790':>8} {'loss':>8}"
    )
    for r in results:
        print(
            f"{r['backend']:>8} {r['step_ms']:9.1f} {r['seq_tokens_per_s']:10.0f} {r['tflops']:8.1f} "
            f"{r['mfu']:6.1%} {r['mfu_vs_measured_790']:8.1%} {r['loss_last']:8.4f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
