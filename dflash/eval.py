"""Measure a trained drafter under real speculative decoding with its target: tau (the mean
acceptance length, tokens per target verification, the target's token counted), its histogram,
acceptance per block position, and tokens per second against the target alone (dflash.specdec).

    python -m dflash.eval RUN_DIR|CHECKPOINT|EXPORT_DIR [--prompts FILE] [--target DIR] [--json]

RUN_DIR: its newest complete checkpoint, and its target and tokenizer from run.json's config.
CHECKPOINT: a run's checkpoints/step-<N> (its run directory gives the target). EXPORT_DIR: what
`python -m dflash.export` wrote (model.safetensors + config.json); it does not name its target, so
--target DIR is needed (it overrides a run's target too). Prompts: --prompts FILE, JSONL records
as training reads them (`text`: its first --prompt-tokens tokens are the prompt; `messages`: every
turn before the assistant's reply, up to the reply's start), or `demo` (the default for a run on the
demo corpus): demo records of another seed, so none of them was trained on. Each prompt is decoded
greedily (or sampled, --temperature) for --max-new tokens, then by the target alone for the
speed-up (not with --no-baseline, as the job's in-job tau runs it). On a GPU, --headroom-gb G
first checks that the target and drafter fit in the device's free memory less G GiB (the eval then
shares a GPU with a running job): exit 3 with one `error:` line when they do not. Exit 2 with one
`error:` line on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.data.tokenizer import record_prompt
from dflash.errors import ConfigError, DFlashError, DoesNotFit
from dflash.exiting import without_final_gc

EVAL_SCRATCH_BYTES = 1 << 30
"""Device memory the decode needs beyond the weights: KV caches and activations at batch 1, the CUDA
context's own allocations (1 GiB covers the 8B target's cache for a prompt and 512 new tokens)."""

DEMO_HELDOUT_SEED = 104_729
"""The demo corpus is demo_records(2000, seed 0); the held-out prompts come from this other seed."""


@dataclass
class Source:
    drafter_dir: Path
    """model.safetensors + config.json of the drafter."""
    kind: str
    """run, checkpoint or export."""
    target_path: str
    tokenizer_kind: str
    cfg: Any = None
    """The run's job config (None for an export)."""


def open_source(path: Path, target: str | None) -> Source:
    from dflash.checkpoint import find_latest

    if not path.exists():
        raise DFlashError(
            f"{path} does not exist; pass a run directory, a checkpoints/step-<N> dir or an export"
        )
    run_dir: Path | None = None
    if (path / "run.json").is_file():
        found = find_latest(path / "checkpoints")
        if found.path is None:
            raise DFlashError(
                f"run {path} has no complete checkpoint yet; evaluate it after its first checkpoint"
            )
        drafter_dir, kind, run_dir = found.path, "run", path
    elif (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        drafter_dir = path
        parent = path.parent.parent
        if path.parent.name == "checkpoints" and (parent / "run.json").is_file():
            kind, run_dir = "checkpoint", parent
        else:
            kind = "export"
    else:
        raise DFlashError(
            f"{path} is neither a run directory (run.json), a checkpoint nor an export (model.safetensors + "
            "config.json); pass one of those"
        )
    cfg = None
    if run_dir is not None:
        from dflash.config import JobConfig, config_from_dict

        manifest = json.loads((run_dir / "run.json").read_text())
        if "config" not in manifest:
            raise DFlashError(f"{run_dir}/run.json has no config: the job never started there")
        cfg = config_from_dict(manifest["config"])
        assert isinstance(cfg, JobConfig)
    if target is None and cfg is None:
        raise DFlashError(
            f"{path} is an exported drafter, which does not name its target; pass --target DIR (the target "
            "model's directory)"
        )
    if target is not None:
        return Source(drafter_dir, kind, target, "target", cfg)
    from dflash.data.inputs import locate_target

    return Source(drafter_dir, kind, locate_target(cfg), cfg.data.tokenizer, cfg)


def load_pair(src: Source, device: Any) -> tuple[Any, Any, Any]:
    """(Target, DFlashDrafter, spec): the target through transformers, the drafter from its weights
    with the target's frozen embedding and head. Another target than the drafter's is refused."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash.plan.spec import DrafterSpec
    from dflash.specdec import Target
    from dflash.step.model import DFlashDrafter
    from dflash.target import check_model_dir, load_frozen_head

    check_model_dir(src.target_path)
    spec = DrafterSpec.from_hf_config(json.loads((src.drafter_dir / "config.json").read_text()))
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    embed, head, config = load_frozen_head(src.target_path, dtype=dtype, device=device)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = len(spec.target_layer_ids) * spec.target_hidden_size
    problems = []
    if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
        problems.append(
            f"its vocabulary x hidden is {tuple(embed.shape)}, the drafter's {(spec.vocab_size, spec.hidden_size)}"
        )
    if max(spec.target_layer_ids) >= text.num_hidden_layers:
        problems.append(
            f"it has {text.num_hidden_layers} layers, the drafter reads layers {spec.target_layer_ids}"
        )
    if spec.target_hidden_size != text.hidden_size:
        problems.append(
            f"its hidden size is {text.hidden_size}, the drafter's fc reads {hidden} = k x {spec.target_hidden_size}"
        )
    if problems:
        raise DFlashError(
            f"the drafter in {src.drafter_dir} was not trained on the target {src.target_path}: "
            f"{'; '.join(problems)}; pass --target the drafter's own target"
        )
    drafter = DFlashDrafter(spec, embed, head, backend="sdpa", compile=False)
    weights = load_file(str(src.drafter_dir / "model.safetensors"))
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    trainable = set(drafter.trainable_state_dict())
    if [k for k in missing if k in trainable] or unexpected:
        raise DFlashError(
            f"{src.drafter_dir}/model.safetensors does not match its config.json: missing "
            f"{[k for k in missing if k in trainable][:3]}, unexpected {list(unexpected)[:3]}"
        )
    drafter = drafter.to(device=device, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_pretrained(src.target_path, dtype=dtype, local_files_only=True).to(
        device
    )
    return Target(model, spec.target_layer_ids), drafter, spec


def pair_bytes(src: Source) -> int:
    """Device bytes the eval needs at bf16, at least: the target's weight files, the drafter's
    weights (their file: float32 in a checkpoint, so an upper bound), the drafter's own bf16 copy of
    the frozen embedding and head, and EVAL_SCRATCH_BYTES."""
    from dflash.plan.placement import target_weight_bytes
    from dflash.plan.spec import DrafterSpec

    spec = DrafterSpec.from_hf_config(json.loads((src.drafter_dir / "config.json").read_text()))
    frozen = 2 * spec.vocab_size * spec.hidden_size * 2
    drafter = (src.drafter_dir / "model.safetensors").stat().st_size
    return target_weight_bytes(src.target_path) + drafter + frozen + EVAL_SCRATCH_BYTES


def check_fits(src: Source, device: Any, headroom_gb: float) -> None:
    """Refuse (DoesNotFit) before loading anything when the pair does not fit in the GPU's free
    memory less headroom_gb: the eval shares the GPU with a running job, which must keep its room."""
    import torch

    from dflash.plan.placement import GIB

    free, total = torch.cuda.mem_get_info(device)
    need = pair_bytes(src)
    if free - headroom_gb * GIB < need:
        raise DoesNotFit(
            f"the target and drafter need {need / GIB:.1f} GiB on {device} and it has {free / GIB:.1f} GiB "
            f"free of {total / GIB:.1f} (--headroom-gb {headroom_gb:g} kept for the job): evaluate on "
            "another GPU (--device), or after the job"
        )


def read_prompts(path: str, tok: Any, *, prompt_tokens: int, limit: int, seed: int) -> list[list[int]]:
    """Token ids of each prompt (see the module doc); records without a prompt are skipped."""
    if path == "demo":
        from dflash.data.demo import demo_records

        records: list[Any] = demo_records(max(limit, 1) * 5, seed=DEMO_HELDOUT_SEED + seed)
    else:
        p = Path(path)
        if not p.is_file():
            raise DFlashError(
                f"--prompts {path}: no such file; pass a JSONL file of text or messages records"
            )
        records = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError as e:
                raise DFlashError(f"--prompts {path}:{n}: not JSON ({e}); one record per line") from None
    out = []
    for rec in records:
        ids = record_prompt(rec, tok, prompt_tokens)
        if ids:
            out.append(ids)
        if len(out) >= limit:
            break
    if not out:
        raise DFlashError(
            f"--prompts {path}: no record gave a prompt (text, or messages with an assistant turn)"
        )
    return out


def run_defaults(args: argparse.Namespace, src: Source) -> None:
    """The settings not given: for a run's drafter, those its job measures tau with (train.tau_*),
    so `python -m dflash.eval CHECKPOINT` repeats the job's `tau` event; else 32 prompts x 64."""
    t = src.cfg.train if src.cfg is not None else None
    if args.limit is None:
        args.limit = t.tau_prompt_count if t else 32
    if args.max_new is None:
        args.max_new = t.tau_max_new if t else 64
    if args.prompt_tokens is None:
        args.prompt_tokens = src.cfg.data.response_prompt_tokens if src.cfg is not None else 32
    if args.prompts is None:
        args.prompts = default_prompts(src)


def default_prompts(src: Source) -> str:
    if src.cfg is not None and src.cfg.train.tau_prompts:
        return str(src.cfg.train.tau_prompts)
    if src.cfg is not None and src.cfg.data.path == "demo":
        return "demo"
    raise DFlashError(
        "no held-out prompts known for this drafter: pass --prompts FILE (JSONL text or messages records "
        "that it was not trained on)"
    )


def _progress(i: int, n: int, tau: float | None) -> None:
    shown = "-" if tau is None else f"{tau:.2f}"
    sys.stderr.write(f"\r[eval] {i}/{n} prompts, tau {shown}")
    if i == n:
        sys.stderr.write("\n")
    sys.stderr.flush()


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from dflash.data.tokenizer import load_tokenizer
    from dflash.specdec import decode, decode_plain, greedy, summarize

    src = open_source(Path(args.source), args.target)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok = load_tokenizer(src.tokenizer_kind, src.target_path)
    run_defaults(args, src)
    prompts = read_prompts(
        args.prompts,
        tok,
        prompt_tokens=args.prompt_tokens,
        limit=args.limit,
        seed=args.seed,
    )
    if args.headroom_gb is not None and device.type == "cuda":
        check_fits(src, device, args.headroom_gb)
    target, drafter, spec = load_pair(src, device)
    run = decode_plain if args.plain else decode
    eos = None if args.ignore_eos else tok.eos_token_id
    decodes, baseline = [], 0.0
    started = time.time()
    for i, prompt in enumerate(prompts, 1):
        d = run(
            target,
            drafter,
            prompt,
            max_new=args.max_new,
            eos=eos,
            temperature=args.temperature,
            seed=args.seed + i,
        )
        decodes.append(d)
        if not args.no_baseline:
            baseline += greedy(target, prompt, max_new=len(d.tokens), eos=None).seconds
        if not args.json:
            _progress(i, len(prompts), summarize(decodes, spec.block_size)["tau"])
    result = summarize(decodes, spec.block_size, baseline_s=baseline)
    return {
        "source": str(Path(args.source).resolve()),
        "kind": src.kind,
        "drafter": str(src.drafter_dir),
        "target": src.target_path,
        "prompts_from": args.prompts,
        "limit": args.limit,
        "implementation": "plain" if args.plain else "cached",
        "temperature": args.temperature,
        "max_new": args.max_new,
        "block_size": spec.block_size,
        "device": str(device),
        "wall_s": round(time.time() - started, 3),
        **result,
    }


def print_human(r: dict[str, Any]) -> None:
    tau = "-" if r["tau"] is None else f"{r['tau']:.3f}"
    print(f"drafter {r['drafter']} ({r['kind']}), target {r['target']}")
    print(
        f"tau {tau} tokens per target verification (max {r['block_size']}; 1.0 = no draft token accepted), "
        f"{r['rounds']} verifications over {r['prompts']} prompts ({r['prompts_from']}), "
        + ("greedy" if r["temperature"] <= 0 else f"temperature {r['temperature']}")
    )
    hist = " ".join(f"{k}:{v}" for k, v in r["histogram"].items() if v)
    print(f"acceptance length histogram: {hist}")
    print("accepted per block position: " + " ".join(f"{a:.2f}" for a in r["acceptance_per_position"]))
    speed = (
        f", target alone {r['target_alone_tokens_per_s']} tok/s (speed-up {r['speedup']}x)"
        if r.get("speedup")
        else ""
    )
    print(f"{r['tokens']} tokens in {r['seconds']} s: {r['tokens_per_s']} tok/s{speed}, on {r['device']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.eval", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a run directory, a checkpoints/step-<N> dir, or an exported drafter dir")
    p.add_argument(
        "--prompts",
        help="JSONL prompts file, or `demo` (default: a run's train.tau_prompts; for demo runs held-out demo records)",
    )
    p.add_argument("--target", help="the target model directory (needed for an export; overrides a run's)")
    p.add_argument(
        "--max-new", type=int, help="new tokens per prompt (default: a run's train.tau_max_new, else 64)"
    )
    p.add_argument(
        "--limit", type=int, help="prompts at most (default: a run's train.tau_prompt_count, else 32)"
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="tokens of a text record used as its prompt (default: a run's data.response_prompt_tokens, else 32)",
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy verification (default); > 0 samples"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="cuda, cpu, cuda:1 ... (default cuda when there is one)")
    p.add_argument("--plain", action="store_true", help="the cache-free reference loop (slow; same tau)")
    p.add_argument("--ignore-eos", action="store_true", help="decode --max-new tokens past any eos")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip the target-alone decode of each prompt (no speed-up figure; tau is the same)",
    )
    p.add_argument(
        "--headroom-gb",
        type=float,
        help="on a GPU: first check that the pair fits in its free memory less this (exit 3 if not)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    for name in ("max_new", "limit", "prompt_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        result = evaluate(args)
    except DoesNotFit as e:
        print(f"error: {e}", file=sys.stderr)
        return DoesNotFit.EXIT_CODE
    except (DFlashError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_human(result)
    return 0


if __name__ == "__main__":
    with without_final_gc():
        code = main()
    # Nothing is left to finish: leave without the interpreter's shutdown, whose clean-up of
    # triton's bindings prints reference-leak noise after the result.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
