"""What the spec-decoding eval costs: `python -m dflash.eval` (the job's own eval, run as users run
it) on an export of a drafter of the config's sizes with random weights, beside its random target.
With random weights tau is about 1 (no draft token accepted): the cost is the point here. The eval
itself also times the target decoding alone on the same prompts, so the report gives both rates.

GPU (configs/qwen3-8b.toml's drafter; the random 8B-size target of bench/pipeline.py, reused):
    python bench/eval.py --work /tmp/dflash-bench --out $OUT/eval_8b.json
CPU (configs/demo-cpu.toml's drafter on bench/pipeline.py's tiny target; about a minute on 2 cores):
    .venv/bin/python bench/eval.py --tiny --work /tmp/dflash-bench-tiny --out /tmp/eval_tiny.json

Steps: 1. the target (bench/pipeline.py's make_target); 2. a drafter built as the job builds it
(the config's drafter section resolved against that target: dflash.plan.spec.resolve_spec), its
random weights written by the job's checkpoint writer and exported by `dflash.export`; 3. prompts of
random words (bench/pipeline.py's write_data); 4. `python -m dflash.eval EXPORT --target TARGET
--prompts FILE --json --ignore-eos` in a process of its own, timed from its start (loading included).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import CONFIG_8B, CONFIG_TINY, default_out, report_header, write_report  # noqa: E402  (bench/)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU sizes instead of the 8B ones on a GPU")
    ap.add_argument("--work", default="/tmp/dflash-bench", help="scratch: target, drafter export, prompts")
    ap.add_argument("--prompts", type=int, default=8, help="prompts decoded")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each prompt")
    ap.add_argument("--max-new", type=int, default=256, help="new tokens per prompt (past any eos)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds the eval process may take")
    ap.add_argument("--out", default=default_out("eval"))
    args = ap.parse_args()
    if args.tiny:
        args.prompt_tokens = min(args.prompt_tokens, 64)
        args.max_new = min(args.max_new, 64)
    return args


def make_export(config: Path, target: Path, work: Path, device: str) -> tuple[Path, dict[str, Any]]:
    """A drafter of the config's sizes on `target`, random weights, through the job's writers."""
    import torch
    from transformers import AutoConfig

    from dflash.checkpoint import save_checkpoint
    from dflash.config import load_config
    from dflash.data.inputs import open_target
    from dflash.export import export
    from dflash.plan.spec import resolve_spec
    from dflash.step.model import DFlashDrafter
    from dflash.target import load_frozen_head

    cfg = load_config(str(config), [f"target.path={target}", "data.tokenizer=target"])
    _, _, mask_id = open_target(cfg)
    spec = resolve_spec(cfg.drafter, AutoConfig.from_pretrained(str(target)), mask_id)
    embed, head, _ = load_frozen_head(str(target), dtype=torch.bfloat16, device=device)
    torch.manual_seed(0)
    with torch.device(device):
        drafter = DFlashDrafter(spec, embed, head, backend="sdpa", compile=False)
    weights = drafter.trainable_state_dict()
    params = sum(v.numel() for v in weights.values())
    root = work / "eval-drafter"
    step = save_checkpoint(
        root / "checkpoints", 0, weights=weights, hf_config=spec.to_hf_config(), trainer_state={}, keep_last=1
    )
    del drafter, weights, embed, head
    out = root / "export"
    export(step, out, dtype="bfloat16", force=True)
    return out, {"trainable_params": params, "layers": spec.num_layers, "block_size": spec.block_size}


def main() -> None:
    args = parse_args()
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU smoke run")
    from pipeline import make_target, target_spec, write_data  # bench/pipeline.py: one random target for all

    device = "cpu" if args.tiny else "cuda"
    t0 = time.perf_counter()
    target, _ = make_target(
        work / ("target-tiny" if args.tiny else "target-qwen3-8b"),
        target_spec(args, "float32" if args.tiny else "bfloat16"),
        device,
    )
    target_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    exported, drafter = make_export(CONFIG_TINY if args.tiny else CONFIG_8B, target, work, device)
    if not args.tiny:
        torch.cuda.empty_cache()
    export_s = time.perf_counter() - t0
    prompts = write_data(
        work / f"eval-prompts-{args.prompt_tokens}.jsonl", args.prompts, args.prompt_tokens, target
    )
    argv = [
        sys.executable, "-m", "dflash.eval", str(exported), "--target", str(target), "--prompts", str(prompts),
        "--limit", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens), "--max-new", str(args.max_new),
        "--ignore-eos", "--json", "--device", device,
    ]  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    process_s = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"dflash.eval exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {
        **report_header("eval", not args.tiny),
        "config": str((CONFIG_TINY if args.tiny else CONFIG_8B).relative_to(REPO)),
        "drafter": drafter,
        "eval_argv": argv[1:],
        "target_build_s": round(target_s, 1),
        "export_s": round(export_s, 1),
        "process_s": round(process_s, 1),
        "load_s": round(process_s - result["wall_s"], 1),
        "eval": result,
    }
    write_report(args.out, report)
    print(
        f"dflash.eval on a random {drafter['trainable_params'] / 1e9:.2f}B-parameter drafter "
        f"({drafter['layers']} layers, block {drafter['block_size']}) and its target, {result['prompts']} prompts "
        f"x {args.prompt_tokens} tokens, {args.max_new} new each:\n"
        f"  speculative decoding {result['tokens_per_s']} tok/s (tau {result['tau']:.3f}, {result['rounds']} "
        f"rounds), the target alone {result.get('target_alone_tokens_per_s')} tok/s, speedup {result.get('speedup')}\n"
        f"  the eval process {process_s:.1f} s: loading {report['load_s']} s, decoding {result['wall_s']} s "
        f"(both the drafter's rounds and the target-alone baseline)"
    )
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
