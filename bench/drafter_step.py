"""The drafter's training step as the job runs it (`DrafterTrainer` steps through `StepAhead`, one
step queued ahead of the one read back, as the job's loops run them): tokens/s and MFU.

The trainer is built exactly as a drafter worker builds it (dflash.step.trainer.DrafterTrainer: regional
compile of every decoder layer, the fused loss where train.fused_loss resolves true, clipping, fused
AdamW, bf16 autocast, the shape plan), from configs/qwen3-8b.toml with the bench's batch shape set
on it, and a target config of Qwen3-8B's sizes (random frozen embedding and head, random target
features). Nothing here re-implements the step.

H200 (hidden 4096, 32/8 heads, head dim 128, intermediate 12288, vocab 151936; the config's drafter:
4 sliding (window 2048) + 1 full layer, 5 target layers, block 16; 2 x 4096 tokens, 512 anchors each):
    python bench/drafter_step.py --out $OUT/drafter_step.json
    python bench/drafter_step.py --backends flex --profile --out $OUT/drafter_step.json
    python bench/drafter_step.py --set train.fused_loss=false ...      # the step before the fused loss
CPU smoke run at a tiny size (sdpa only: flex has no backward on CPU):
    python bench/drafter_step.py --tiny --profile --out /tmp/drafter_step.json
The cost of the drafter state copies (pipeline.state_copy_every, dflash.pipeline.state_copy): the
same steps timed again with the job's copier attached, in the same process:
    python bench/drafter_step.py --backends flex --state-copy-every 1 --out $OUT/state_copy.json

FLOPs (stated once, counted per step, for the anchors the step really sampled): the model's, what
its forward and backward need, whatever the code does:
  trainable linears: 6 * params * tokens they see (q_proj, o_proj, MLP over the N = B*A*K block
      tokens; k_proj, v_proj over B*S + N tokens), but 4 * params * tokens for the fc over the B*S
      context tokens: its input is the target's features, which need no gradient;
  frozen LM head: 4 * V * H * T (forward + input gradient; no weight gradient: it is the target's)
      over the T trained block positions only (never position 0, the given anchor token, nor
      positions past a sequence's end or outside its loss mask): the loss takes only those rows
      through the head, and the other rows' logits are no part of the model's loss;
  attention: 4 * D * heads * unmasked query-key pairs forward, x3.5 for fwd+bwd (FlashAttention
      convention), summed over layers with each layer's mask.
The count of record until 2026-12-02 (issue 12's 149.5 TFLOP) took the fc at 6 * params * tokens and
the head over all N block positions: 4.0 TFLOP more per 8B step than the model needs (149.62
against 145.64 on the same anchors, docs/BENCHMARKS.md). Both are
reported (flops_per_step["total"], and ["total_first_count"] with mfu_first_count).
MFU = FLOPs / step time / 989 TFLOP/s (H200 dense bf16); also reported against the measured 790.

--profile: torch.profiler over --profile-steps steps after the timed ones (shapes recorded); the top
kernels by device time, the matrix products by shape with their TFLOP/s, and a split: matmul
(cuBLAS/CUTLASS GEMM kernels, the head's included), attention (flex templates, flash/efficient SDPA
kernels), loss (every other kernel launched inside the trainer's `dflash.loss` range), optimizer
(inside `dflash.optimizer`: clipping and AdamW), other (the rest: norms, rope, activations, copies,
the attention backward's preprocessing).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import default_out, report_header, write_report  # noqa: E402  (bench/, the script's own directory)
from pipeline import QWEN3_8B, TINY  # noqa: E402

PEAK_TFLOPS, MEASURED_TFLOPS = 989.0, 790.0
CONFIG = REPO / "configs" / "qwen3-8b.toml"
TINY_DRAFTER = [
    "drafter.num_layers=3",
    'drafter.layer_types=["sliding_attention","sliding_attention","full_attention"]',
    "drafter.sliding_window=32",
    "drafter.block_size=4",
    "drafter.num_target_layers=3",
    f"drafter.mask_token_id={TINY['vocab_size'] - 1}",
    "run.device=cpu",
    "target.dtype=float32",
    "attention.strict_kernels=false",
]


def step_flops(spec: Any, B: int, S: int, anchors_BA: Any, seq_lens_B: Any, trained: int) -> dict[str, float]:
    """The step's model FLOPs (the module docstring's count); `trained` is T, its trained block
    positions."""
    from dflash.step.attention.mask import allowed_pairs

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
    fc_params = len(spec.target_layer_ids) * spec.target_hidden_size * H
    per_layer = 6 * (2 * H * Hq * D * N + 2 * H * G * D * (ctx + N) + 3 * H * Fi * N)
    linears = 4 * fc_params * ctx + spec.num_layers * per_layer
    lm_head = 4 * V * H * trained
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
            causal_block=spec.sliding_block_causal and spec.window(i) is not None,
        )
        for i in range(spec.num_layers)
    )
    total = linears + lm_head + attention
    return {
        "linears": linears,
        "lm_head": lm_head,
        "attention": attention,
        "total": total,
        "trained_positions": trained,
        # The first count: the fc with an input gradient, the head over every block position.
        "total_first_count": total + 2 * fc_params * ctx + 4 * V * H * (N - trained),
    }


MATMUL_MARKS = ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "dot_kernel")
ATTENTION_MARKS = ("flex_attention", "flash", "fmha", "attention", "efficient_attention")


def kernel_category(name: str, phase: str) -> str:
    """matmul and attention by kernel name; the rest by the trainer's range it was launched in."""
    low = name.lower()
    if any(m in low for m in ATTENTION_MARKS):
        return "attention"
    if any(m in low for m in MATMUL_MARKS) or low.startswith(("ampere_", "sm80_", "sm90_", "sm100_")):
        return "matmul"
    return phase if phase in ("loss", "optimizer") else "other"


def profile_split(trace: dict[str, Any], top: int = 25) -> dict[str, Any]:
    """Device time per category and the top kernels, per step (ms), from trace_gaps.analyse's
    kernels: every device event of the Chrome trace once. (The profiler's per-op kernel lists, which
    this used before, counted some kernels many times: 406.8 ms of "optimizer" in a 330 ms sdpa step.)"""
    split: dict[str, float] = {k: 0.0 for k in ("matmul", "attention", "loss", "optimizer", "other")}
    rows = []
    for k in trace["kernels"]:
        cats: dict[str, float] = {}
        for phase, ms in k["ms_by_phase"].items():
            cat = kernel_category(k["name"], phase)
            cats[cat] = cats.get(cat, 0.0) + ms
            split[cat] += ms
        main = max(cats, key=lambda c: cats[c]) if cats else "other"
        rows.append(
            {
                "name": k["name"][:160],
                "category": main,
                "ms": k["ms"],
                "calls": k["calls"],
                "ms_by_phase": {p: round(v, 3) for p, v in k["ms_by_phase"].items()},
            }
        )
    return {
        "per_step_ms": {k: round(v, 3) for k, v in split.items()},
        "device_ms_per_step": round(sum(split.values()), 3),
        "top_kernels": rows[:top],
    }


def trace_report(prof: Any, steps: int) -> dict[str, Any]:
    """bench/trace_gaps.py over the profiler's Chrome trace: idle gaps with the host op behind each,
    and compiled against eager device time per phase of the step."""
    from trace_gaps import analyse

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return analyse(json.loads(path.read_text()), steps)


def build_trainer(args: argparse.Namespace, backend: str) -> tuple[Any, Any, dict[str, Any]]:
    import torch
    from transformers import Qwen3Config

    from dflash.config import load_config
    from dflash.plan.resolve import torch_dtype
    from dflash.step.model import resolve_spec
    from dflash.step.trainer import DrafterTrainer

    B, S, A = args.batch, args.seq_len, args.anchors
    sets = [
        f"data.max_seq_len={S}",
        f"data.bucket_multiple={S}",
        f"data.min_seq_len={min(32, S)}",
        f"train.token_budget={B * S}",
        f"train.max_batch_size={B}",
        f"train.num_anchors={A}",
        f"train.loss_chunk_tokens={args.loss_chunk}",
        f"attention.backend={backend}",
        f"attention.sdpa_chunk_blocks={args.sdpa_chunk_blocks}",
    ]
    sizes = dict(TINY if args.tiny else QWEN3_8B)
    if args.tiny:
        sets += TINY_DRAFTER
    cfg = load_config(CONFIG, sets + list(args.set))
    device = torch.device("cpu" if args.tiny else "cuda")
    target_config = Qwen3Config(**sizes)
    spec = resolve_spec(cfg.drafter, target_config, cfg.drafter.mask_token_id)
    dtype = torch_dtype(cfg.target.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    embed = (torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.02).to(device, dtype)
    head = (torch.randn(spec.vocab_size, spec.hidden_size, generator=gen) * 0.02).to(device, dtype)
    trainer = DrafterTrainer(cfg, spec, embed, head, device)
    shape = trainer.plan.shape_for(S)
    if shape.rows != B or shape.anchors != A:
        raise SystemExit(f"the plan made {shape.name} with {shape.anchors} anchors, not {B}x{S} with {A}")
    features = len(spec.target_layer_ids) * spec.target_hidden_size
    batch = {
        "input_ids_BL": torch.randint(0, spec.vocab_size - 1, (B, S), generator=gen).to(device),
        "loss_mask_BL": torch.ones(B, S, dtype=torch.bool, device=device),
        "seq_lens_B": torch.full((B,), S, device=device),
        "target_hidden_BLF": torch.randn(B, S, features, generator=gen).to(device, dtype),
    }
    return trainer, cfg, batch


def timed_steps(steps: Any, n: int, cuda: bool) -> tuple[float, list[Any]]:
    """Seconds per step over `n` pushes in the steady state, and the results they read back. On the
    GPU two CUDA events on the step's stream: one behind the step queued before the window, one
    behind the n-th timed step's work; on the CPU the host clock."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # behind the queued warm-up step
    t0 = time.perf_counter()
    results = steps(n)  # each push reads back the step queued before it
    if cuda:
        end.record()  # behind the last timed step
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / n, results
    return (time.perf_counter() - t0) / n, results


def bench_backend(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    import torch

    from dflash.step.objective import block_labels, sample_anchors
    from dflash.step.trainer import StepAhead

    trainer, cfg, batch = build_trainer(args, backend)
    cuda = trainer.device.type == "cuda"
    # As the job's loops run it: one step queued ahead of the one read back.
    ahead = StepAhead(trainer)

    def steps(n: int) -> list[Any]:
        return [r for _ in range(n) for r, _ in ahead.push(**batch)]

    # Timed in the job's steady state: the job's loop drains its queue only at a checkpoint or the
    # last step, so the warm-up leaves its last step queued. On the GPU the clock is two CUDA events
    # on the step's stream, one behind the last warm-up step's work and one behind the n-th timed
    # step's: n whole steps of the device's timeline, idle gaps included, none of the refill after a
    # drain (that is drain_ms below). Host clocks around the pushes are not: a push returns when
    # the step before it has been read back, plus however long the host then took to queue the rest
    # of its own step, which differs from push to push (the first fix of this bench timed 222.5 ms
    # for a step whose kernels alone take 262 ms).
    t0 = time.perf_counter()
    steps(max(1, args.warmup))
    warm_s = time.perf_counter() - t0
    anchor_state = trainer.anchor_gen.get_state()  # the next step's anchors: the FLOP count, after
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dt, results = timed_steps(steps, args.steps, cuda)
    results += [r for r, _ in ahead.flush()]
    # The anchors of the first timed step (the same generator state), for the FLOP count; counted
    # here, after the window: it copies them to the host, which would wait for the queued step.
    gen = torch.Generator().manual_seed(0)
    gen.set_state(anchor_state)
    anchors_BA = sample_anchors(
        batch["loss_mask_BL"], batch["seq_lens_B"], trainer.plan.shape_for(args.seq_len).anchors, gen
    )
    _, valid_BAK = block_labels(
        batch["input_ids_BL"], batch["loss_mask_BL"], batch["seq_lens_B"], anchors_BA, trainer.spec.block_size
    )
    flops = step_flops(
        trainer.spec, args.batch, args.seq_len, anchors_BA, batch["seq_lens_B"], int(valid_BAK.sum())
    )
    # What a drain costs (a checkpoint step, the last step): one step pushed and read at once, the
    # device idle before it and the host launching while it runs.
    t1 = time.perf_counter()
    results += [r for r, _ in ahead.push(**batch, read_now=True)] + [r for r, _ in ahead.flush()]
    drain_ms = (time.perf_counter() - t1) * 1000
    tflops = flops["total"] / dt / 1e12
    res: dict[str, Any] = {
        "backend": backend,
        "fused_loss": trainer.fused_loss,
        "fused_qk_norm_rope": trainer.model.backend.fused_qk_norm_rope,
        "bf16_weights": trainer.bf16_weights,
        "compile": cfg.attention.compile,
        "step_ms": dt * 1000,
        "drain_step_ms": drain_ms,
        "warmup_s": warm_s,
        "seq_tokens_per_s": args.batch * args.seq_len / dt,
        "block_tokens_per_s": anchors_BA.numel() * trainer.spec.block_size / dt,
        "tflops": tflops,
        "mfu": tflops / PEAK_TFLOPS,
        "mfu_vs_measured_790": tflops / MEASURED_TFLOPS,
        "mfu_first_count": flops["total_first_count"] / dt / 1e12 / PEAK_TFLOPS,
        "flops_per_step": flops,
        "loss_first": results[0].loss,  # the first step read back in the window (the last warm-up one)
        "loss_last": results[-1].loss,
        "loss_finite": all(math.isfinite(r.loss) for r in results),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "params_trainable": sum(p.numel() for p in trainer.params),
    }
    if args.state_copy_every:
        res["state_copy"] = time_state_copies(args, trainer, steps, cuda, dt)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        steps(1)  # steady state in the window too: a step already queued when it opens
        # Shapes recorded: the matrix products' device time and rate by shape (trace_gaps). One
        # warm-up step of the profiler first: starting it waits for the device, which then idled in
        # the first recorded step while the host caught up (the 3-6 ms of "host gaps" a step in the
        # records before 2026-12-04; 0.02 ms a step with the warm-up, on the H200).
        window = schedule(wait=0, warmup=1, active=args.profile_steps, repeat=1)
        with profile(activities=activities, record_shapes=True, schedule=window) as prof:
            for i in range(1 + args.profile_steps):
                steps(1)  # the last one stays queued: the sync below runs it inside the window
                if cuda and i == args.profile_steps:
                    torch.cuda.synchronize()
                prof.step()
        ahead.flush()
        trace = trace_report(prof, args.profile_steps) if cuda else {}
        res["profile"] = (
            profile_split(trace, top=args.profile_top)
            | {"trace": {k: v for k, v in trace.items() if k != "kernels"}}
            if cuda
            else {
                "cpu_top": [
                    {"name": e.key, "ms": e.self_cpu_time_total / 1000 / args.profile_steps}
                    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
                ]
            }
        )
    return res


def time_state_copies(
    args: argparse.Namespace, trainer: Any, steps: Any, cuda: bool, plain_s: float
) -> dict[str, Any]:
    """The same steps again with the job's state copier attached (dflash.pipeline.state_copy, as a
    drafter worker attaches it with pipeline.state_copy_every = N): its cost against the step just
    timed without it, in the same process on the same compiled graphs. The copies go to a scratch
    directory under --state-copy-dir (/dev/shm, where the job keeps them), removed after."""
    import shutil

    from dflash.pipeline.state_copy import StateCopier

    root = Path(tempfile.mkdtemp(prefix="dflash-bench-state-", dir=args.state_copy_dir))
    copier = StateCopier(trainer, root, rank=0, writes_tensors=True, every=args.state_copy_every)
    trainer.state_copy = copier
    try:
        # the first due step makes the file (page-locked in the background)
        for _ in range(args.state_copy_every + 1):
            steps(1)
            if copier.file is not None:
                break
        t0 = time.perf_counter()
        if not copier.wait_ready(timeout=600):
            raise SystemExit("the state copy's file was not ready (page-locking) within 600 s")
        ready_s = time.perf_counter() - t0
        steps(max(1, args.warmup))
        copies0 = copier.copies
        dt, _ = timed_steps(steps, args.steps, cuda)
        copies = copier.copies - copies0
        file_gb, pinned = copier.file_bytes / 1e9, copier.pinned  # before close() unmaps the file
        copier.close()
        return {
            "every": args.state_copy_every,
            "step_ms": dt * 1000,
            "plain_step_ms": plain_s * 1000,
            "cost": dt / plain_s - 1,
            "copies_in_window": copies,
            "copy_gb": file_gb,
            "pinned": pinned,
            "host_ms_per_copy": copier.host_seconds / max(copier.copies, 1) * 1000,
            "file_ready_s": ready_s,
            "committed": copier.committed(),
        }
    finally:
        trainer.state_copy = None
        shutil.rmtree(root, ignore_errors=True)


def bench_in_own_process(backend: str) -> dict[str, Any]:
    """This bench for one backend, in a new process with this command's other options."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a in ("--backends", "--out"):
            skip = True
        elif not a.startswith(("--backends=", "--out=")):
            argv.append(a)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--backends", backend, "--out", str(out)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())["results"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="flex,sdpa")
    ap.add_argument("--batch", type=int, default=2, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="train.loss_chunk_tokens")
    ap.add_argument("--sdpa-chunk-blocks", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="timed steps (--tiny: 2 unless set)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile and split the step's device time")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument(
        "--profile-top", type=int, default=40, help="kernels listed in the profile, by device time"
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 model on CPU (smoke run)")
    ap.add_argument(
        "--state-copy-every",
        type=int,
        default=0,
        metavar="N",
        help="also time the steps with the job's state copier (pipeline.state_copy_every = N) attached",
    )
    ap.add_argument("--state-copy-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run several backends one after another in this process (default: each in a process of its "
        "own, as a job runs one: the second backend in the first's process ran with its allocator and "
        "compile state)",
    )
    ap.add_argument("--out", default=default_out("drafter_step"))
    args = ap.parse_args()
    import torch

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke run")
    if args.tiny:
        args.batch, args.seq_len, args.anchors, args.loss_chunk = 2, 96, 8, 24
        args.steps, args.warmup, args.profile_steps = min(args.steps, 2 if args.steps == 10 else 200), 1, 1
    backends = [b for b in args.backends.split(",") if b]
    if args.tiny and "flex" in backends:
        print("flex skipped: no flex backward on CPU")
        backends.remove("flex")
    results: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        **report_header("drafter_step", not args.tiny),
        "config": vars(args),
        "flops_formula": "6*params*tokens for q/o/MLP on block and k/v on context+block tokens, 4*params*tokens "
        "for the fc on context tokens (no input gradient) + 4*V*H*trained_positions (frozen LM head) "
        "+ 3.5*4*D*heads*unmasked_pairs (attention)",
        "peak_tflops": PEAK_TFLOPS,
        "results": results,
    }
    for backend in backends:
        if len(backends) > 1 and not args.in_process:
            results.append(bench_in_own_process(backend))
        else:
            results.append(bench_backend(args, backend))
            # forget the compiled layers (graphs, recompile counts), free the trainer and its state
            torch._dynamo.reset()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        write_report(args.out, report)  # after each backend: a step cut by a time limit keeps the first
        r = results[-1]
        print(
            f"{backend}: {r['step_ms']:.1f} ms/step, {r['seq_tokens_per_s']:.0f} tok/s, MFU {r['mfu']:.1%}",
            flush=True,
        )
        c = r.get("state_copy")
        if c:
            print(
                f"{backend} with a state copy every {c['every']} step(s): {c['step_ms']:.1f} ms/step "
                f"({c['cost']:+.2%} against {c['plain_step_ms']:.1f}), {c['copy_gb']:.2f} GB file, "
                f"pinned {c['pinned']}, host {c['host_ms_per_copy']:.2f} ms/copy, "
                f"{c['copies_in_window']} copies timed",
                flush=True,
            )
    f = results[0]["flops_per_step"] if results else None
    if f:
        print(
            f"FLOPs/step: {f['total'] / 1e12:.2f} T (linears {f['linears'] / 1e12:.2f}, "
            f"lm_head {f['lm_head'] / 1e12:.2f} over {f['trained_positions']} trained positions, "
            f"attention {f['attention'] / 1e12:.2f}; {f['total_first_count'] / 1e12:.2f} T by the first count)"
        )
    print(
        f"{'backend':>8} {'step ms':>9} {'seq tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'MFU/790':>8} "
        f"{'MFU 1st':>8} {'loss':>8}"
    )
    for r in results:
        print(
            f"{r['backend']:>8} {r['step_ms']:9.1f} {r['seq_tokens_per_s']:10.0f} {r['tflops']:8.1f} "
            f"{r['mfu']:6.1%} {r['mfu_vs_measured_790']:8.1%} {r['mfu_first_count']:8.1%} {r['loss_last']:8.4f}"
        )
        split = (r.get("profile") or {}).get("per_step_ms")
        if split:
            print("   profile ms/step: " + ", ".join(f"{k} {v:.1f}" for k, v in split.items()))
            for k in r["profile"]["top_kernels"][:10]:
                print(f"     {k['ms']:8.2f} ms  {k['category']:9} x{k['calls']:.0f}  {k['name'][:90]}")
            tr = r["profile"].get("trace") or {}
            if tr:
                print(f"   gaps {tr['gaps_ms_per_step']:.1f} ms/step by phase {tr['gap_ms_by_phase']}")
                print(f"   device ms/step by phase: {tr['phases']}")
                for g in tr["top_gaps"][:5]:
                    print(
                        f"     gap {g['ms']:.2f} ms ({g['phase']}) before {g['launched_by']}: {g['host_during']}"
                    )
                for m in tr.get("matmul_by_shape", [])[:16]:
                    print(f"     matmul {m['ms']:7.2f} ms x{m['calls']:.0f} {m['tflops']} TFLOP/s  {m['op']}")
                for w in tr.get("host_waits", [])[:8]:
                    print(
                        f"     host wait {w['ms']:.2f} ms/step x{w['calls']} {w['call']} in {w['in']} ({w['phase']})"
                    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
