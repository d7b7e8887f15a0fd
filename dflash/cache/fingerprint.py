"""The compile-cache fingerprint: everything that decides what inductor compiles for this job.

    python -m dflash.fingerprint [CONFIG] [--set key=value ...]

prints {"key", "fingerprint"} as one JSON line. Without CONFIG only the environment and source
parts are printed (key null): what `dflashctl cache restore` compares when no config is given.

key = sha256 of the canonical JSON (sorted keys, no whitespace, ASCII) of the fingerprint; runner/
runner/canonical.py spells the same form and the two must agree byte for byte.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from dflash.exiting import without_final_gc

FORMAT = 2  # 2: the job part is the plan's compile-relevant part (dflash.plan.builder)
PACKAGE = Path(__file__).resolve().parents[1]  # dflash/
COMPILED_SOURCES = [
    "step/model.py",
    "step/attention/*.py",
    "step/attention/*.json",
    "step/objective.py",
    "step/guard.py",
    "step/trainer.py",
    "cache/job_side.py",
    "target.py",
]
"""dflash files that define compiled code (the layers, attention, apply_compile, the target's
regional compile when target.compile is on)."""


def canonical_json(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def fingerprint_key(fingerprint: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(fingerprint)).hexdigest()


def source_hashes() -> dict[str, str]:
    out: dict[str, str] = {}
    for pattern in COMPILED_SOURCES:
        for path in sorted(PACKAGE.glob(pattern)):
            out[path.relative_to(PACKAGE).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def env_fingerprint(device_type: str) -> dict[str, Any]:
    """The compile-relevant part of envprobe.probe(): not the package list or driver (they do not
    change generated code); the CPU vector ISA on CPU (inductor's C++ kernels are built for it)."""
    from dflash.envprobe import probe

    p = probe()
    torch_info = p.get("torch") or {}
    env: dict[str, Any] = {
        "python": p["python"]["version"],
        "torch": torch_info.get("version"),
        "torch_git": torch_info.get("git_version"),
        "cuda": torch_info.get("cuda"),
        "triton": (p.get("triton") or {}).get("version"),
        "device_type": device_type,
        "gpus": [],
        "cpu_isa": None,
    }
    if device_type == "cuda":
        seen = {(g["name"], g["compute_capability"]) for g in p.get("gpus", [])}
        env["gpus"] = [{"name": n, "capability": c} for n, c in sorted(seen)]
    else:
        from torch._inductor import cpu_vec_isa

        env["cpu_isa"] = str(cpu_vec_isa.pick_vec_isa()) or "none"
    return env


def target_fingerprint(cfg: Any, plan: Any, target_path: str) -> dict[str, Any]:
    """What the target's compiled layers depend on: nothing when the plan does not compile it; else
    its architecture (config.json, which the kept layers are built from) and how many layers are kept."""
    if not plan.target_compile:
        return {"compile": False}
    from dflash.plan.shapes import read_target_config

    target_cfg = read_target_config(target_path)
    return {
        "compile": True,
        "config_sha256": hashlib.sha256(canonical_json(target_cfg)).hexdigest(),
        "layers_kept": max(plan.spec.target_layer_ids) + 1,
        "dtype": cfg.target.dtype,
    }


def job_fingerprint(cfg: Any, plan: Any, target_path: str) -> dict[str, Any]:
    """The compiled code's inputs: the job plan's compile-relevant part (dflash.plan.builder.compile_part:
    each field marked where it is declared), the target's architecture where it is compiled, and
    how the compile is invoked."""
    from dflash.plan.builder import compile_part

    return {
        "plan": compile_part(plan),
        "target": target_fingerprint(cfg, plan, target_path),
        "autocast": "bfloat16" if plan.torch_device.type == "cuda" else None,
        "compile": {"mode": "default", "dynamic": False, "scope": "per-layer + flex kernels"},
    }


def plan_for_cache(cfg: Any) -> tuple[Any, str]:
    """(the job plan, the target's directory): the drafter side's own plan (its tokenizer's mask
    token, its target's config.json), so the keys match training's."""
    from transformers import AutoConfig

    from dflash.data.inputs import open_target
    from dflash.plan.builder import build_plan

    target_path, _, mask_id = open_target(cfg)
    target_config = AutoConfig.from_pretrained(target_path, local_files_only=True)
    plan = build_plan(cfg, target_config=target_config, mask_token_id=mask_id, target_path=target_path)
    return plan, target_path


def cache_fingerprint(cfg: Any, *, planned: tuple[Any, str] | None = None) -> dict[str, Any]:
    """planned: plan_for_cache(cfg) when the caller has it already (it loads the tokenizer and configs)."""
    plan, target_path = planned or plan_for_cache(cfg)
    return {
        "format": FORMAT,
        "env": env_fingerprint(plan.torch_device.type),
        "job": job_fingerprint(cfg, plan, target_path),
        "sources": source_hashes(),
    }


def partial_fingerprint(device_type: str) -> dict[str, Any]:
    return {"format": FORMAT, "env": env_fingerprint(device_type), "sources": source_hashes()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m dflash.fingerprint", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="job config (TOML); omit for the environment part only")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        default=None,
        help="without a config: the device type the cache is for (default: cuda if visible)",
    )
    p.add_argument("--json", action="store_true", help="(the output is always JSON)")
    p.add_argument(
        "--read-only",
        action="store_true",
        help="write nothing (dflashctl run --dry-run): a tiny target not built yet under the runs root "
        "is built in a temporary directory, removed after (the key does not depend on where it is)",
    )
    args = p.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):
        if args.config:
            from dflash.config import load_config
            from dflash.errors import DFlashError

            try:
                from dflash.data.inputs import tiny_target_built

                cfg = load_config(args.config, args.sets)
                if args.read_only and cfg.target.path == "tiny" and not tiny_target_built(cfg):
                    with tempfile.TemporaryDirectory(prefix="dflash-fingerprint-") as scratch:
                        fp = cache_fingerprint(
                            load_config(args.config, [*args.sets, f"run.runs_root={scratch}"])
                        )
                else:
                    fp = cache_fingerprint(cfg)
            except DFlashError as e:  # bad input: one line, not a traceback
                print(f"error: {e}", file=sys.stderr)
                sys.exit(2)
            result = {"key": fingerprint_key(fp), "fingerprint": fp}
        else:
            import torch

            dev = args.device or "auto"
            if dev == "auto":
                dev = "cuda" if torch.cuda.is_available() else "cpu"
            result = {"key": None, "fingerprint": partial_fingerprint(dev), "partial": True}
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")


if __name__ == "__main__":
    with without_final_gc():
        main()
