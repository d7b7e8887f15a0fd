"""Pipeline benchmark: target-only, drafter-only and end-to-end tokens/s, on the job's own batches.

H200 (random-weight Qwen3-8B-size target built once under --work, bf16; the shipped 8B shape):
    python bench/pipeline.py --work /tmp/dflash-bench --batch 12 --out $OUT/pipeline.json
Two GPUs (target on cuda:0, drafter on cuda:1: the bound is then min(target, drafter)):
    python bench/pipeline.py --work /tmp/dflash-bench --batch 12 --drafter-device cuda:1
CPU smoke run (tiny target, sdpa, no compile; about 2 minutes):
    .venv/bin/python bench/pipeline.py --tiny --work /tmp/dflash-bench-tiny --out /tmp/pipeline.json

Phases, in one process (each frees the GPU before the next):
  1. target dir: a random Qwen3 (Qwen3-8B sizes) built on the device in bf16, save_pretrained as
     safetensors with the demo's byte-level tokenizer (reused when complete);
  2. the phases' batches: the first --batches batches target worker 0 of the job draws (the job's
     own data path, dflash.data.prepare.prepare_data and make_batcher), so every phase runs the same
     rows, buckets and padding as the end-to-end job;
  3. baseline: plain transformers forward (AutoModel -> Qwen3Model, output_hidden_states=True, sdpa);
  4. target-only: TargetCapture (k layers, stops after the last needed one), as the job resolves
     target.compile on the device;
  5. drafter-only: DrafterTrainer.train_step (one queued ahead, as the job steps) on random target
     features of each batch's shape;
  6. end-to-end: the real multi-process job (python -m dflash.launch) for a fixed wall time; steady
     state tok_s from metrics.jsonl (records whose interval compiled anything are dropped), and the
     workers' heartbeats sampled each second for the gap profile. The job is stopped with two signals
     (the second kills at once), so no 12 GB final drafter checkpoint is written.
Units: real (unpadded) sequence tokens per second everywhere, as the job's tok_s counts them.
The bound (pipeline_bound): each GPU's work per token is 1/target for the target share it hosts plus
1/drafter for the drafter share; the job cannot beat the busiest GPU. Co-located on one GPU that is
the serial bound 1 / (1/target + 1/drafter); on separate GPUs min(target, drafter).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import default_out, report_header, time_loop, write_report  # noqa: E402  (bench/, the script's own directory)

CONFIG = REPO / "configs" / "qwen3-8b.toml"
GOAL_EFFICIENCY = 0.90  # of the bound (issue 38: the co-located shipped 8B job on one H200)
MARKER = "dflash_bench_target.json"

QWEN3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1e6,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 1e6,
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, help="scratch dir: target model, data, compile cache, run dir")
    ap.add_argument("--out", default=default_out("pipeline"))
    ap.add_argument("--tiny", action="store_true", help="tiny float32 target on CPU (smoke run)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--k", type=int, default=5, help="target layers captured")
    ap.add_argument(
        "--batches", type=int, default=10, help="the job's batches every in-process phase times, in order"
    )
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls on each distinct batch shape first")
    ap.add_argument(
        "--drafter-device",
        default=None,
        help="the drafter's device (default: the target's, co-located); another GPU makes the bound "
        "min(target, drafter)",
    )
    ap.add_argument("--e2e-seconds", type=float, default=150.0, help="wall time of the end-to-end job")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="whole-script wall budget; shortens the end-to-end run to fit (0 = no limit)",
    )
    ap.add_argument("--records", type=int, default=512, help="data records (each truncated to --seq-len)")
    ap.add_argument(
        "--buckets",
        type=int,
        default=1,
        help="length buckets of the end-to-end job's data (data.bucket_multiple = seq-len / N; record i "
        "falls in bucket i mod N): the batcher's and the shape plan's multi-bucket path",
    )
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument(
        "--make-target-only",
        action="store_true",
        help="build (or reuse) the random target under --work, print its directory, and exit",
    )
    ap.add_argument(
        "--target-compile",
        choices=("auto", "true", "false"),
        default="auto",
        help="target.compile in every phase (auto: as the config resolves it on the device: compiled "
        "on a GPU with attention.compile on)",
    )
    args = ap.parse_args()
    if args.tiny:
        args.seq_len, args.batches, args.warmup = 256, 4, 1
        args.e2e_seconds, args.records = min(args.e2e_seconds, 40.0), 64
    return args


# ---- phase 1: target dir ----------------------------------------------------------------------


def target_spec(args: argparse.Namespace, dtype_name: str) -> dict[str, Any]:
    return {"version": 1, "sizes": TINY if args.tiny else QWEN3_8B, "dtype": dtype_name, "seed": 0}


def make_target(path: Path, spec: dict[str, Any], device: str) -> tuple[Path, float]:
    """Random Qwen3ForCausalLM built directly on the device in its dtype (no fp32 copy, no CPU init of
    8B parameters), saved with the demo tokenizer; reused when the marker matches."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.data.demo import build_tiny_tokenizer

    marker = path / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return path, 0.0
    t0 = time.perf_counter()
    tok = build_tiny_tokenizer()
    config = Qwen3Config(
        **spec["sizes"],
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    dtype = getattr(torch, spec["dtype"])
    torch.manual_seed(spec["seed"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if path.exists():
        shutil.rmtree(path)
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / MARKER).write_text(json.dumps(spec))
    os.replace(tmp, path)
    return path, time.perf_counter() - t0


def write_data(path: Path, records: int, seq_len: int, tokenizer_dir: Path, buckets: int = 1) -> Path:
    """Random-word text, long enough that every record is truncated to exactly seq_len tokens: all rows
    are full, so no batch carries padding and every throughput counts the same tokens. With buckets N
    above 1, record i is sized for bucket (i mod N) + 1 of N (about 85% of that bucket's length; the
    last bucket's records are truncated to seq_len as before)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(0)

    def text(chars: int) -> str:
        words, n = [], 0
        while n < chars:
            w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
            words.append(w)
            n += len(w) + 1
        return " ".join(words)

    chars = seq_len * 2
    while len(tok(text(chars))["input_ids"]) < seq_len * 1.2:
        chars *= 2
    meta = path.with_suffix(".json")  # what the data file was written for: reused when it matches
    if path.is_file() and meta.is_file() and json.loads(meta.read_text()) == [records, chars, buckets]:
        return path
    per_token = len(text(4000)) / len(tok(text(4000))["input_ids"])  # characters per token, about
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(records):
            b = i % buckets + 1
            n = chars if b == buckets else int(per_token * seq_len * (b - 0.15) / buckets)
            f.write(json.dumps({"text": text(n)}) + "\n")
    os.replace(tmp, path)
    meta.write_text(json.dumps([records, chars, buckets]))
    return path


# ---- timing helpers ---------------------------------------------------------------------------


def free_device(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def timed_batches(fn: Any, batches: list[Any], *, warmup: int, device: str) -> float:
    """Seconds for one pass of fn over the batches in order, after `warmup` untimed calls on the first
    batch of each distinct shape (compiles and caches happen there, not in the timed pass). CUDA
    events around the pass on a GPU (common.time_loop), perf_counter on the CPU."""
    first_of_shape: dict[tuple[int, ...], Any] = {}
    for b in batches:
        first_of_shape.setdefault(tuple(b.input_ids_BL.shape), b)
    for b in first_of_shape.values():
        for _ in range(warmup):
            fn(b)
    it = iter(batches)
    return time_loop(lambda: fn(next(it)), device, len(batches), 0) * len(batches) / 1000


def peak_gb(device: str) -> float | None:
    import torch

    if not device.startswith("cuda"):
        return None
    gb = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return round(gb, 2)


def phase_result(batches: list[Any], sec: float, **fields: Any) -> dict[str, Any]:
    """A phase's rate in real tokens, and the batches it ran (so a reader sees every phase ran the
    same ones)."""
    real = sum(b.num_tokens for b in batches)
    return {
        **fields,
        "batches": len(batches),
        "shapes": batch_shapes(batches),
        "real_tokens": real,
        "padded_tokens": sum(b.padded_tokens for b in batches),
        "step_ms": sec * 1000 / len(batches),
        "tok_s": real / sec,
    }


def batch_shapes(batches: list[Any]) -> dict[str, int]:
    """'rows x length' -> how many of the batches have it."""
    out: dict[str, int] = {}
    for b in batches:
        key = "x".join(map(str, b.input_ids_BL.shape))
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


# ---- phase 2: the job's batches ---------------------------------------------------------------


def job_batches(cfg: Any, work: Path, count: int) -> list[Any]:
    """The first `count` batches target worker 0 of the end-to-end job draws: the job's own data
    path (tokenized-cache, buckets, rows per bucket, shuffle seed), so the in-process phases and the
    job train on the same rows, buckets and padding."""
    from itertools import islice

    from dflash.data.prepare import make_batcher, plan_job, prepare_data
    from dflash.rundir import RunDir

    scratch = work / "phase-data"
    shutil.rmtree(scratch, ignore_errors=True)
    run = RunDir(scratch).create()
    parts = prepare_data(cfg, run)
    return list(islice(make_batcher(cfg, parts.dataset, plan=plan_job(cfg, parts).shapes), count))


# ---- phases 3-5: in-process throughputs -------------------------------------------------------


def bench_baseline(
    target_dir: Path, batches: list[Any], args: argparse.Namespace, device: str, dtype: Any
) -> dict:
    import importlib.util

    import torch
    from transformers import AutoModel

    place = {"device_map": device} if device != "cpu" and importlib.util.find_spec("accelerate") else {}
    t0 = time.perf_counter()
    model = AutoModel.from_pretrained(str(target_dir), dtype=dtype, attn_implementation="sdpa", **place)
    model = model.to(device).eval().requires_grad_(False)
    load_s = time.perf_counter() - t0
    on_device = {}  # ids and the attention mask of each batch's real tokens (rows are right-padded)
    for b in batches:
        real_BL = torch.arange(b.input_ids_BL.shape[1])[None, :] < b.seq_lens_B[:, None]
        on_device[id(b)] = (b.input_ids_BL.to(device), real_BL.to(device))

    @torch.no_grad()
    def forward(b: Any) -> None:
        ids_BL, real_BL = on_device[id(b)]
        out = model(input_ids=ids_BL, attention_mask=real_BL, output_hidden_states=True, use_cache=False)
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1

    sec = timed_batches(forward, batches, warmup=args.warmup, device=device)
    return phase_result(
        batches,
        sec,
        **{"class": type(model).__name__, "load_s": round(load_s, 1), "peak_mem_gb": peak_gb(device)},
    )


def bench_target(
    cfg: Any,
    target_dir: Path,
    batches: list[Any],
    layer_ids: list[int],
    args: argparse.Namespace,
    device: str,
) -> dict:
    import torch

    from dflash.plan.builder import build_plan
    from dflash.plan.resolve import torch_dtype
    from dflash.plan.shapes import apply_recompile_limit
    from dflash.target import TargetCapture

    dev = torch.device(device)
    plan = build_plan(cfg, device=dev, target_path=str(target_dir)).shapes  # as the target worker plans it
    if plan.target_compile:
        apply_recompile_limit(plan)
    t0 = time.perf_counter()
    target = TargetCapture(
        str(target_dir),
        layer_ids,
        dtype=torch_dtype(cfg.target.dtype),
        device=dev,
        compile=plan.target_compile,
    )
    load_s = time.perf_counter() - t0
    on_device = {id(b): (b.input_ids_BL.to(dev), b.seq_lens_B.to(dev)) for b in batches}

    def forward(b: Any) -> None:
        target(*on_device[id(b)])

    sec = timed_batches(forward, batches, warmup=args.warmup, device=device)
    return phase_result(
        batches,
        sec,
        layer_ids=layer_ids,
        compiled=plan.target_compile,
        layers_loaded=max(layer_ids) + 1,
        load_s=round(load_s, 1),
        peak_mem_gb=peak_gb(device),
    )


def bench_drafter(
    cfg: Any, target_dir: Path, batches: list[Any], mask_id: int, args: argparse.Namespace, device: str
) -> dict:
    import torch
    from transformers import AutoConfig

    from dflash.plan.resolve import torch_dtype
    from dflash.step.model import resolve_spec
    from dflash.step.trainer import DrafterTrainer, StepAhead
    from dflash.target import load_frozen_head

    dev = torch.device(device)
    spec = resolve_spec(cfg.drafter, AutoConfig.from_pretrained(str(target_dir)), mask_id)
    embed, head, _ = load_frozen_head(str(target_dir), dtype=torch_dtype(cfg.target.dtype), device=dev)
    trainer = DrafterTrainer(cfg, spec, embed, head, dev)
    features = len(spec.target_layer_ids) * spec.target_hidden_size
    hidden: dict[tuple[int, ...], Any] = {}  # random target features, one tensor per batch shape
    for b in batches:
        shape = tuple(b.input_ids_BL.shape)
        if shape not in hidden:
            hidden[shape] = torch.randn(*shape, features, device=dev, dtype=torch_dtype(cfg.target.dtype))
    on_device = {
        id(b): (
            b.input_ids_BL.to(dev),
            b.loss_mask_BL.to(dev),
            b.seq_lens_B.to(dev),
            hidden[tuple(b.input_ids_BL.shape)],
        )
        for b in batches
    }
    t0 = time.perf_counter()
    trainer.train_step(*on_device[id(batches[0])])  # compiles (or loads) the first shape's graphs
    first_s = time.perf_counter() - t0
    losses: list[float] = []
    ahead = StepAhead(trainer)  # as the job's drafter loop steps: one queued ahead of the one read

    def step(b: Any) -> None:
        losses.extend(r.loss for r, _ in ahead.push(*on_device[id(b)]))

    sec = timed_batches(step, batches, warmup=args.warmup, device=device)
    losses.extend(r.loss for r, _ in ahead.flush())
    return phase_result(
        batches,
        sec,
        backend=trainer.backend,
        compile=cfg.attention.compile,
        first_step_s=round(first_s, 1),
        loss_last=losses[-1],
        peak_mem_gb=peak_gb(device),
    )


# ---- phase 6: end-to-end ----------------------------------------------------------------------


def stop_job(proc: subprocess.Popen) -> None:
    """Two SIGTERMs: the first asks the drafters to stop, the second makes the supervisor SIGKILL its
    workers (no final checkpoint) and still unlink the shared-memory queue. SIGKILL of the group last."""
    for _ in range(2):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(2)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def steady_state(records: list[dict], tokens_per_batch: int) -> dict:
    """Drop the first record and every record whose interval compiled something (its compile counters
    moved); the rest give token-weighted tok/s over their summed intervals."""
    keep: list[dict] = []
    prev_t, prev_compile = None, None
    for i, rec in enumerate(records):
        dt = rec["t"] - prev_t if prev_t is not None else None
        compiled = prev_compile is not None and rec.get("compile") != prev_compile
        if i > 0 and dt and not compiled:
            keep.append({**rec, "dt": dt})
        prev_t, prev_compile = rec["t"], rec.get("compile")
    if not keep:
        return {"records_total": len(records), "records_used": 0, "tok_s": None}
    first = records.index(next(r for r in records if r["t"] == keep[0]["t"]))
    window = (records[first - 1]["t"], keep[-1]["t"])  # from the record before the first kept one
    span = sum(r["dt"] for r in keep)
    tok_s = sum(r["tok_s"] * r["dt"] for r in keep) / span
    tgt_bps = sum(r["tgt_bps"] * r["dt"] for r in keep) / span
    ordered = sorted(r["tok_s"] for r in keep)
    return {
        "records_total": len(records),
        "records_used": len(keep),
        "seconds_used": round(span, 1),
        "window": window,
        "tok_s": tok_s,
        "tok_s_median": ordered[len(ordered) // 2],
        "target_tok_s": tgt_bps * tokens_per_batch,
        "dft_bps": sum(r["dft_bps"] * r["dt"] for r in keep) / span,
    }


def read_heartbeats(run_dir: Path) -> dict[str, dict]:
    """Every worker's heartbeat now ({'target-0': {...}, 'drafter-0': {...}}); a torn read is skipped."""
    out = {}
    for path in sorted((run_dir / "workers").glob("*.json")) if (run_dir / "workers").is_dir() else []:
        try:
            out[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def nearest(samples: list[tuple[float, dict]], t: float) -> dict:
    return min(samples, key=lambda s: abs(s[0] - t))[1] if samples else {}


BUSY = ("computing", "compiling")
WAITS = {"target": "waiting_output", "drafter": "waiting_input"}


def gap_profile(
    before: dict[str, dict], after: dict[str, dict], solo_ms: dict[str, float], e2e: float, bound: float
) -> dict[str, Any]:
    """Where the end-to-end job's time went in its steady window, from two heartbeat samples (their
    state_s, step and alloc_retries): per worker the share of the window in each state, its busy
    time per unit of work (a target's published batch, a drafter's step) against the same work alone
    (stretch: above 1 where the other process's kernels ran beside it), and the allocator's retries.
    The causes name the gap: queue waits, memory pressure, kernels interleaving, host work."""
    workers: dict[str, Any] = {}
    causes: list[tuple[float, str]] = []
    for name in sorted(set(before) & set(after)):
        a, b = before[name], after[name]
        window = b.get("updated_at", 0) - a.get("updated_at", 0)
        sa, sb = a.get("state_s") or {}, b.get("state_s") or {}
        if window <= 0 or not sb:
            continue
        share = {k: round((sb.get(k, 0.0) - sa.get(k, 0.0)) / window, 4) for k in sorted(set(sa) | set(sb))}
        work = (b.get("step") or 0) - (a.get("step") or 0)
        role = b.get("role", name.split("-")[0])
        busy_s = sum(sb.get(k, 0.0) - sa.get(k, 0.0) for k in BUSY)
        retries = (b.get("alloc_retries") or 0) - (a.get("alloc_retries") or 0)
        w: dict[str, Any] = {
            "window_s": round(window, 1),
            "work": work,
            "share": share,
            "alloc_retries": retries,
        }
        if work > 0 and solo_ms.get(role):
            w["busy_ms_per_work"] = round(busy_s * 1000 / work, 1)
            w["solo_ms_per_work"] = round(solo_ms[role], 1)
            w["stretch"] = round(busy_s * 1000 / work / solo_ms[role], 3)
        workers[name] = w
        wait = share.get(WAITS.get(role, ""), 0.0)
        if wait >= 0.03:
            side = "the target side is short" if role == "drafter" else "the drafter side is short"
            causes.append((wait, f"queue waits: {name} {WAITS[role]} {wait:.0%} of the window ({side})"))
        if retries > 0:
            causes.append((1.0, f"memory pressure: {name} had {retries} allocator retries in the window"))
        other = 1.0 - sum(v for k, v in share.items() if k in BUSY or k == WAITS.get(role))
        if other >= 0.03:
            causes.append(
                (other, f"host work: {name} {other:.0%} of the window in neither its work nor its queue wait")
            )
    stretched = {n: w["stretch"] for n, w in workers.items() if w.get("stretch", 0) >= 1.05}
    if stretched:
        worst = max(stretched.values())
        causes.append(
            (
                worst - 1.0,
                "kernels interleaving: "
                + ", ".join(f"{n}'s work took {x:.2f}x its time alone" for n, x in sorted(stretched.items())),
            )
        )
    return {
        "efficiency": e2e / bound if bound else None,
        "workers": workers,
        "causes": [text for _, text in sorted(causes, key=lambda c: -c[0])],
    }


def run_e2e(
    overrides: list[str], work: Path, seconds: float, tokens_per_batch: float, env: dict
) -> tuple[dict, list[tuple[float, dict]]]:
    from dflash.config import set_args
    from dflash.rundir import read_jsonl

    run_dir = work / "e2e-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        sys.executable,
        "-m",
        "dflash.launch",
        str(CONFIG),
        *set_args(overrides),
        "--run-dir",
        str(run_dir),
    ]
    log_path = work / "e2e-launch.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        samples: list[tuple[float, dict]] = []  # (time, every heartbeat): the gap profile's window
        try:
            while time.time() - t0 < seconds and proc.poll() is None:
                time.sleep(1)
                samples.append((time.time(), read_heartbeats(run_dir)))
        finally:
            exit_early = proc.poll()
            stop_job(proc)
    records = list(read_jsonl(run_dir / "metrics.jsonl")) if (run_dir / "metrics.jsonl").is_file() else []
    events = list(read_jsonl(run_dir / "events.jsonl")) if (run_dir / "events.jsonl").is_file() else []
    compiled = [e for e in events if e.get("event") in ("compiled", "cache_miss")]
    res = {
        "command": " ".join(argv),
        "wall_s": round(time.time() - t0, 1),
        "exited_early": exit_early,
        **steady_state(records, tokens_per_batch),
        "first_metric_elapsed_s": records[0]["elapsed_s"] if records else None,
        "compile_events": compiled[:4],
        "metrics": [
            {
                k: r.get(k)
                for k in ("elapsed_s", "step", "tok_s", "tgt_bps", "dft_bps", "q_hs", "q_pre", "gpu_mem_gb")
            }
            for r in records[-40:]
        ],
    }
    if not records:
        res["log_tail"] = log_path.read_text()[-3000:]
        for p in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
            res[f"log_tail_{p.stem}"] = p.read_text()[-2000:]
    shutil.rmtree(run_dir, ignore_errors=True)  # partial checkpoints of a killed drafter are GBs
    return res, samples


def pipeline_bound(
    target_devices: list[str], drafter_devices: list[str], target_tok_s: float, drafter_tok_s: float
) -> tuple[float, str]:
    """The end-to-end rate the job cannot beat, and its name. The tokens split evenly over the T
    target workers and over the D drafter ranks; a GPU hosting t of the targets and d of the ranks
    spends t/T / target + d/D / drafter seconds per token, and the busiest GPU bounds the job. One
    GPU shared by one of each: the serial bound 1 / (1/target + 1/drafter); separate GPUs: min."""
    T, D = len(target_devices), len(drafter_devices)
    per_token = {
        dev: target_devices.count(dev) / T / target_tok_s + drafter_devices.count(dev) / D / drafter_tok_s
        for dev in set(target_devices) | set(drafter_devices)
    }
    shared = set(target_devices) & set(drafter_devices)
    return 1 / max(per_token.values()), "serial" if shared else "min"


# ---- main -------------------------------------------------------------------------------------


def job_overrides(
    args: argparse.Namespace, target_dir: Path, data: Path, work: Path, devices: tuple[str, str], mask_id: int
) -> list[str]:
    """One override list for both the in-process drafter and the launched job, so they compile and run
    the same configuration (and the job hits the compile cache the drafter-only phase filled)."""
    sets = [
        f"target.path={target_dir}",
        f"data.path={data}",
        f"data.cache_dir={work / 'tokcache'}",
        f"data.max_seq_len={args.seq_len}",
        f"data.bucket_multiple={args.seq_len // args.buckets}",
        f"data.min_seq_len={min(32, args.seq_len // args.buckets)}",
        f"train.token_budget={args.batch * args.seq_len}",
        f"train.max_batch_size={args.batch}",
        "train.total_steps=1000000",
        "train.checkpoint_every=1000000",
        f"drafter.mask_token_id={mask_id}",
        f'pipeline.target_devices=["{devices[0]}"]',
        f'pipeline.drafter_devices=["{devices[1]}"]',
        "pipeline.max_restarts=0",
        "run.status_interval_s=5",
        f"run.runs_root={work / 'runs'}",
        f'target.compile="{args.target_compile}"',
    ]
    if args.tiny:
        sets += [
            "run.device=cpu",
            "target.dtype=float32",
            "attention.backend=sdpa",
            "attention.compile=false",
            "attention.strict_kernels=false",
            "train.num_anchors=16",
            "run.status_interval_s=3",
        ]
    return sets


def main() -> None:
    args = parse_args()
    started = time.time()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from dflash.cache.job_side import use_cache_dir

    use_cache_dir(work / "compile")  # before torch compiles anything; the e2e job inherits it via env
    import torch

    from dflash.config import load_config
    from dflash.step.model import default_target_layer_ids

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke run")
    device = "cpu" if args.tiny else "cuda:0"
    dtype_name = "float32" if args.tiny else "bfloat16"
    dtype = getattr(torch, dtype_name)
    spec = target_spec(args, dtype_name)
    target_dir, build_s = make_target(
        work / ("target-tiny" if args.tiny else "target-qwen3-8b"), spec, "cpu" if args.tiny else "cuda"
    )
    free_device(device)  # the random model built for saving is gone once make_target returns
    if args.make_target_only:
        print(target_dir)
        return
    from transformers import AutoTokenizer

    mask_id = int(AutoTokenizer.from_pretrained(str(target_dir)).mask_token_id)
    data = write_data(
        work / f"data-{args.seq_len}-b{args.buckets}.jsonl",
        args.records,
        args.seq_len,
        target_dir,
        args.buckets,
    )
    drafter_device = "cpu" if args.tiny else (args.drafter_device or device)
    overrides = job_overrides(args, target_dir, data, work, (device, drafter_device), mask_id)
    cfg = load_config(CONFIG, overrides)

    n_layers = spec["sizes"]["num_hidden_layers"]
    layer_ids = default_target_layer_ids(n_layers, args.k)
    batches = job_batches(cfg, work, args.batches)
    results: dict[str, Any] = {"target_build_s": round(build_s, 1)}
    results["baseline"] = bench_baseline(target_dir, batches, args, device, dtype)
    free_device(device)  # the bench functions' locals (model, activations) are gone once they return
    print(f"baseline: {results['baseline']['tok_s']:.0f} tok/s", flush=True)
    results["target_only"] = bench_target(cfg, target_dir, batches, layer_ids, args, device)
    free_device(device)
    print(f"target-only: {results['target_only']['tok_s']:.0f} tok/s", flush=True)
    results["drafter_only"] = bench_drafter(cfg, target_dir, batches, mask_id, args, drafter_device)
    free_device(drafter_device)  # the launched job needs the whole GPU
    print(f"drafter-only: {results['drafter_only']['tok_s']:.0f} tok/s", flush=True)

    t_only, d_only = results["target_only"]["tok_s"], results["drafter_only"]["tok_s"]
    bound, bound_kind = pipeline_bound(
        cfg.pipeline.target_devices, cfg.pipeline.drafter_devices, t_only, d_only
    )
    seconds = args.e2e_seconds
    if args.budget_s:
        seconds = min(seconds, args.budget_s - (time.time() - started) - 30)  # 30 s: stop + report
    profile = None
    if args.skip_e2e or seconds < 30:
        results["e2e"] = {"skipped": "--skip-e2e" if args.skip_e2e else f"{seconds:.0f} s left in --budget-s"}
    else:
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        real_per_batch = results["target_only"]["real_tokens"] / len(batches)
        results["e2e"], samples = run_e2e(overrides, work, seconds, real_per_batch, env)
        e2e_rate = results["e2e"].get("tok_s")
        if e2e_rate and results["e2e"].get("window"):
            start, end = results["e2e"]["window"]
            solo = {
                "target": results["target_only"]["step_ms"],
                "drafter": results["drafter_only"]["step_ms"],
            }
            profile = gap_profile(nearest(samples, start), nearest(samples, end), solo, e2e_rate, bound)
            results["e2e"]["gap_profile"] = profile
    e2e = results["e2e"].get("tok_s")
    summary = {
        "baseline_tok_s": results["baseline"]["tok_s"],
        "target_only_tok_s": t_only,
        "drafter_only_tok_s": d_only,
        "e2e_tok_s": e2e,
        "capture_speedup_vs_baseline": t_only / results["baseline"]["tok_s"],
        "bound": bound_kind,
        "bound_tok_s": bound,
        "efficiency": e2e / bound if e2e else None,
        "goal_efficiency": GOAL_EFFICIENCY,
        "goal_capture_speedup": 1.25,
    }
    summary["meets_efficiency"] = (
        summary["efficiency"] is not None and summary["efficiency"] >= GOAL_EFFICIENCY
    )
    summary["meets_capture_speedup"] = summary["capture_speedup_vs_baseline"] >= 1.25
    report = {
        **report_header("pipeline", device.startswith("cuda")),
        "target_sizes": spec["sizes"],
        "batch": {
            "rows": args.batch,
            "seq_len": args.seq_len,
            "buckets": args.buckets,
            "phase_batches": len(batches),
            "shapes": batch_shapes(batches),
            "real_fraction": sum(b.num_tokens for b in batches) / sum(b.padded_tokens for b in batches),
        },
        "devices": {"target": cfg.pipeline.target_devices, "drafter": cfg.pipeline.drafter_devices},
        "overrides": overrides,
        "summary": summary,
        **results,
        "wall_s": round(time.time() - started, 1),
    }
    write_report(args.out, report)

    def fmt(x: float | None) -> str:
        return f"{x:12.0f}" if x is not None else f"{'n/a':>12}"

    shapes = ", ".join(f"{n} x {k}" for k, n in batch_shapes(batches).items())
    print(f"\nevery phase: the job's first {len(batches)} batches ({shapes}; real tokens only)")
    print(f"{'':28}{'tok/s':>12}  {'ms/batch':>9}")
    for name, key in [
        ("baseline (HF, all hidden)", "baseline"),
        ("target-only (capture)", "target_only"),
        ("drafter-only (train_step)", "drafter_only"),
    ]:
        print(f"{name:28}{fmt(results[key]['tok_s'])}  {results[key]['step_ms']:9.1f}")
    print(f"{'end-to-end (launch)':28}{fmt(e2e)}")
    print(f"capture speedup vs baseline: {summary['capture_speedup_vs_baseline']:.2f}x (goal >= 1.25x)")
    where = (
        "target and drafter share a GPU" if bound_kind == "serial" else "target and drafter on separate GPUs"
    )
    print(f"bound ({bound_kind}: {where}): {bound:.0f} tok/s")
    eff = summary["efficiency"]
    print(f"end-to-end / bound: {f'{eff:.1%}' if eff is not None else 'n/a'} (goal >= {GOAL_EFFICIENCY:.0%})")
    if profile is not None:
        for cause in profile["causes"] or ["no gap cause above 3% found"]:
            print(f"  gap: {cause}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
