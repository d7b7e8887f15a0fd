"""Warm the compile cache: compile every shape this config can produce, in this one process and thread.

    python -m dflash.warm configs/demo-cpu.toml --out DIR [--set key=value ...]

Points TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR at DIR/inductor and DIR/triton before torch
compiles anything, builds the drafter exactly as a drafter worker does (DrafterTrainer: the same
apply_compile, attention backend, block masks, autocast; random drafter weights, which do not change
the compiled code) and runs one real training step (forward, backward, optimizer) per shape bucket on
synthetic tokens. With target.compile on, the drafter is then freed, the target is loaded as a target
worker loads it, and it runs its forward per bucket, unpadded and padded (the two graphs a batch can
take): "shape" events with part "target".

Each shape is compiled once per compile context (dflash.plan.resolve.compile_contexts): every distinct way
a job process runs that part. The compiled code depends on process state beyond the config: on the
CPU inductor keys and specialises graphs on the intra-op thread count (the single-process job runs
torch's default, a pipeline drafter 1 unless OMP_NUM_THREADS says otherwise), and a drafter group of
more than one rank runs under DDP, whose DDPOptimizer compiles each layer split at gradient-bucket
boundaries (warm wraps the drafter the same way, in a process group of one). Between contexts dynamo
forgets what it compiled, so the next call compiles again under the other key. Run warm in the
environment the job runs in (same OMP_NUM_THREADS, same core count).

Prints one JSON object per line (the protocol runner/cache/warmrun.py reads):

    {"event": "fingerprint", "key": ..., "fingerprint": {...}}
    {"event": "plan", "shapes": [[rows, length], ...], "shape_plan": {...}, "contexts": {...}}
    {"event": "shape", "part": "drafter"|"target", "index": i, "total": n,
     "shape": {"rows", "length", "anchors"}, "seconds": s, "counters": {...},
     "memory": {"peak_allocated", "peak_reserved"} (bytes; null off CUDA)}
    {"event": "done", "seconds": s, "counters": {...}}

and writes DIR/warm.json ({key, fingerprint, shapes, contexts, seconds, counters, shape_plan,
memory}); a shape's counters, seconds and peak memory cover all its contexts. `memory` is the
record dflash.plan.placement checks: per part, the peak device memory of every planned shape. A shape
that runs out of memory, or a worst shape that does not fit the device less run.memory_headroom_gb,
is refused (exit 2, naming the shape and what to change) and no warm.json is written. Compiling from more than one thread of a process
deadlocks cold inductor caches (field fact), hence no threads here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.cache.job_side import counters_delta, use_cache_dir
from dflash.config import add_config_args
from dflash.exiting import without_final_gc
from dflash.rundir import atomic_write_json

if TYPE_CHECKING:  # dflash.plan.resolve imports torch: only after main() has pointed inductor at --out
    from dflash.plan.resolve import CompileContext

WARM_STATS = "warm.json"


def _emit(event: str, **fields: Any) -> None:
    sys.__stdout__.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")  # type: ignore[union-attr]
    sys.__stdout__.flush()  # type: ignore[union-attr]


def synthetic_step_inputs(cfg: Any, spec: Any, rows: int, length: int, device: Any) -> tuple[Any, ...]:
    """Full-length rows of random tokens, every position trained: values do not change compiled code."""
    import torch

    from dflash.plan.resolve import torch_dtype

    # Made on the device: the 8B drafter's target features are 12 x 4096 x 20480 values, seconds of
    # CPU randn per shape that the H200's restored warm counted as compile time (2026-12-01).
    gen = torch.Generator(device=device).manual_seed(cfg.run.seed)
    input_ids_BL = torch.randint(0, spec.vocab_size, (rows, length), generator=gen, device=device)
    loss_mask_BL = torch.ones(rows, length, dtype=torch.bool, device=device)
    seq_lens_B = torch.full((rows,), length, dtype=torch.long, device=device)
    features = len(spec.target_layer_ids) * spec.target_hidden_size
    dtype = torch_dtype(cfg.target.dtype)
    hidden_BLF = torch.randn(rows, length, features, generator=gen, device=device, dtype=dtype)
    return input_ids_BL, loss_mask_BL, seq_lens_B, hidden_BLF


def _compile_seconds() -> dict[str, float]:
    """Cumulative compile-time phases of this process (dynamo's own accounting) and block-mask time."""
    import torch._dynamo.utils

    from dflash.step.attention.flex import BLOCK_MASK_SECONDS

    spent = dict(torch._dynamo.utils.calculate_time_spent())
    spent["block_mask"] = BLOCK_MASK_SECONDS[0]
    return spent


def _breakdown(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    """Where one shape's seconds went (dynamo's own accounting): dynamo tracing and guards (frame
    compile less its backend), AOT autograd and inductor for forward and backward (cache lookups and
    loads on a warm cache, compiling on a cold one; kernels_wait_s of it waiting for Triton / C++
    kernels), eager block masks, and the rest: running the steps."""

    def d(key: str) -> float:
        return max(0.0, after.get(key, 0.0) - before.get(key, 0.0))

    frame, forward, backward = d("entire_frame_compile"), d("backend_compile"), d("entire_backward_compile")
    parts = {
        "dynamo_s": max(0.0, frame - forward),
        "aot_inductor_s": forward + backward,
        "block_mask_s": d("block_mask"),
    }
    parts["run_and_other_s"] = max(0.0, seconds - sum(parts.values()))
    parts["kernels_wait_s"] = d("async_compile.wait")
    return {k: round(v, 3) for k, v in parts.items()}


class _ContextSwitch:
    """Puts this process into one compile context after another (see the module doc)."""

    def __init__(self, on_enter: Callable[[CompileContext], None] | None = None) -> None:
        self.current: CompileContext | None = None
        self.on_enter = on_enter

    def enter(self, ctx: CompileContext) -> None:
        import torch

        if self.current is not None and ctx != self.current:
            torch._dynamo.reset()  # forget the compiled frames: the next call compiles under ctx's key
        if torch.get_num_threads() != ctx.threads:
            torch.set_num_threads(ctx.threads)
        if self.on_enter is not None:
            self.on_enter(ctx)
        self.current = ctx


def warm(cfg: Any, out: Path) -> dict[str, Any]:
    import torch

    from dflash.cache.fingerprint import cache_fingerprint, fingerprint_key, plan_for_cache
    from dflash.plan.placement import PeakMeter, device_total, fit_problems, is_oom, oom_error
    from dflash.plan.resolve import compile_contexts, torch_dtype
    from dflash.step.guard import KernelGuard, compile_counters
    from dflash.step.trainer import DrafterTrainer, wrap_ddp
    from dflash.target import load_frozen_head

    planned = plan_for_cache(cfg)
    job, target_path = planned
    spec, device = job.spec, job.torch_device
    fp = cache_fingerprint(cfg, planned=planned)
    key = fingerprint_key(fp)
    _emit("fingerprint", key=key, fingerprint=fp)
    plan = job.shapes
    contexts = {"drafter": compile_contexts(cfg, "drafter", device)}
    if plan.target_compile:
        contexts["target"] = compile_contexts(cfg, "target", device)
    plan_contexts = {part: [c.to_dict() for c in cs] for part, cs in contexts.items()}
    _emit("plan", shapes=plan.buckets(), shape_plan=plan.to_dict(), contexts=plan_contexts)
    embed, head, _ = load_frozen_head(target_path, dtype=torch_dtype(cfg.target.dtype), device=device)
    trainer = DrafterTrainer(cfg, spec, embed, head, device, plan=job)
    total_bytes = device_total(device)
    memory: dict[str, Any] = {
        "device": str(device),
        "total_bytes": total_bytes,
        "headroom_gb": cfg.run.memory_headroom_gb,
        "drafter": {},
        "target": {},
    }
    degraded: list[dict[str, str]] = []
    guard = KernelGuard(
        lambda kind, detail: degraded.append({"kind": kind, "detail": detail}),
        strict=job.attention.strict,
    )
    start_counters = compile_counters()
    started = time.perf_counter()
    per_shape: list[dict[str, Any]] = []

    def each_shape(part: str, switch: _ContextSwitch, run_one: Any) -> None:
        for i, shape in enumerate(plan.shapes, 1):
            before = compile_counters()
            time_before = _compile_seconds()
            t0 = time.perf_counter()
            inputs = synthetic_step_inputs(cfg, spec, shape.rows, shape.length, device)
            meter = PeakMeter(device)
            try:
                with meter.measure():
                    for ctx in contexts[part]:
                        switch.enter(ctx)
                        run_one(inputs)
                        guard.check()
            except Exception as e:
                guard.check()  # a recompile limit hit first (then eager kernels) is the cause: say so
                if is_oom(e):
                    raise oom_error(part, shape, device, total_bytes) from None
                raise
            peak = None
            breakdown = _breakdown(time_before, _compile_seconds(), time.perf_counter() - t0)
            if meter.reserved is not None:
                peak = {"peak_allocated": meter.allocated, "peak_reserved": meter.reserved}
                memory[part][shape.name] = peak
            record = {
                "part": part,
                "shape": {"rows": shape.rows, "length": shape.length, "anchors": shape.anchors},
                "seconds": round(time.perf_counter() - t0, 3),
                "counters": counters_delta(before, compile_counters()),
                "memory": peak,
                "breakdown": breakdown,
            }
            per_shape.append(record)
            _emit("shape", index=i, total=len(plan.shapes), **record)
            del inputs

    with guard, _ddp_group_of_one(device if any(c.ddp for c in contexts["drafter"]) else None):
        wrapped: dict[str, Any] = {}

        def drafter_module(ctx: CompileContext) -> None:
            # The module train_step runs: the bare drafter, or the DDP wrapper a pipeline rank runs.
            if ctx.ddp and "ddp" not in wrapped:
                wrapped["ddp"] = wrap_ddp(trainer.model, device)
            trainer.module = wrapped["ddp"] if ctx.ddp else trainer.model

        each_shape("drafter", _ContextSwitch(drafter_module), lambda inputs: trainer.train_step(*inputs))
        if plan.target_compile:  # the target's regional compile is compiled code of this job too
            from dflash.target import TargetCapture

            # In a job the target has a device of its own: free the drafter's first (weights,
            # optimizer state, grads) so a large target fits beside nothing else.
            del trainer, embed, head
            wrapped.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            target = TargetCapture(
                target_path,
                spec.target_layer_ids,
                dtype=torch_dtype(cfg.target.dtype),
                device=device,
                compile=True,
            )

            def forward_both(inputs: tuple[Any, ...]) -> None:
                # Both graphs a bucket can take: unpadded (causal mask only) and padded (a key mask).
                ids_BL, _, seq_lens_B, _ = inputs
                target(ids_BL, seq_lens_B)
                padded_B = seq_lens_B.clone()
                padded_B[-1] -= 1
                target(ids_BL, padded_B)

            each_shape("target", _ContextSwitch(), forward_both)
    total = time.perf_counter() - started
    counters = counters_delta(start_counters, compile_counters())
    problems = fit_problems(memory, total_bytes, cfg.run.memory_headroom_gb, where=str(device))
    if problems:  # no artifact for a plan that cannot run: refused before any training
        from dflash.plan.placement import MemoryPlanError

        raise MemoryPlanError(problems[0])
    stats = {
        "key": key,
        "fingerprint": fp,
        "shapes": per_shape,
        "contexts": plan_contexts,
        "seconds": round(total, 3),
        "counters": counters,
        "degraded": degraded,
        "device": str(device),
        "shape_plan": plan.to_dict(),
        "memory": memory,
        "breakdown": {
            k: round(sum(r["breakdown"][k] for r in per_shape), 3) for k in per_shape[0]["breakdown"]
        }
        if per_shape
        else {},
    }
    atomic_write_json(out / WARM_STATS, stats)
    _emit("done", seconds=round(total, 3), counters=counters, breakdown=stats["breakdown"])
    return stats


@contextlib.contextmanager
def _ddp_group_of_one(device: Any) -> Iterator[None]:
    """A process group of this one process (device None: none needed), so the drafter can be wrapped
    in DDP exactly as a rank of a pipeline drafter group is. No network: an in-memory store."""
    if device is None:
        yield
        return
    import torch.distributed as dist

    from dflash.step.trainer import ddp_backend

    dist.init_process_group(ddp_backend(device), store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.warm", description=__doc__.splitlines()[0])
    add_config_args(p, run_dir=None)
    p.add_argument("--out", required=True, help="cache dir to fill: DIR/inductor, DIR/triton, DIR/warm.json")
    args = p.parse_args(argv)
    out = use_cache_dir(args.out)  # before torch is imported: inductor must never see another dir
    from dflash.config import load_config
    from dflash.errors import DFlashError

    try:
        cfg = load_config(args.config, args.overrides)
        # Everything but our JSON lines goes to stderr, so the runner's parser sees only events.
        with contextlib.redirect_stdout(sys.stderr):
            warm(cfg, out)
    except DFlashError as e:  # bad input (config, data, a plan that does not fit): one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    with without_final_gc():
        main()
