"""Export a checkpoint as a servable DFlash drafter: `model.safetensors` + `config.json`, nothing else.

    python -m dflash.export RUN_DIR_OR_STEP_DIR OUT_DIR [--dtype bfloat16|float16|float32]

RUN_DIR takes its newest complete checkpoint; a `checkpoints/step-<N>` dir is taken as is. The
weights are cast to --dtype (default bfloat16, as released drafters ship: half the size of the fp32
master weights training keeps) and config.json's `torch_dtype` says so. `trainer.pt` (optimizer and
data state) is left behind. OUT_DIR is assembled in a temp dir beside it and renamed into place; an
existing OUT_DIR is refused unless --force, which replaces it only once the new one is complete.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from dflash.errors import DFlashError
from dflash.exiting import without_final_gc
from dflash.rundir import install_dir

DTYPES = ("bfloat16", "float16", "float32")


def find_step(path: Path) -> Path:
    from dflash.checkpoint import find_latest

    if (path / "model.safetensors").is_file() and (path / "config.json").is_file():
        return path
    found = find_latest(path / "checkpoints")
    if found.path is None:
        raise DFlashError(
            f"{path} is neither a checkpoint (model.safetensors + config.json) nor a run directory "
            "with a complete checkpoint under checkpoints/; pass one of those"
        )
    return found.path


def export(src: Path, out: Path, *, dtype: str = "bfloat16", force: bool = False) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    from dflash.plan.spec import DrafterSpec

    if dtype not in DTYPES:
        raise DFlashError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out.exists() and not force:
        raise DFlashError(f"{out} exists; pass --force to replace it, or choose another directory")
    step = find_step(src)
    config = json.loads((step / "config.json").read_text())
    DrafterSpec.from_hf_config(config)  # refuses anything that is not a DFlash drafter config
    weights = load_file(str(step / "model.safetensors"))
    cast = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in weights.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(cast, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(
            json.dumps({**config, "torch_dtype": dtype}, indent=2, sort_keys=True) + "\n"
        )
        install_dir(tmp, out)  # --force: the old one goes only now that the new one is whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.export", description=__doc__.splitlines()[0])
    p.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoints/step-<N> dir")
    p.add_argument("out", help="directory to create: model.safetensors + config.json")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="weights dtype (default bfloat16)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    args = p.parse_args(argv)
    try:
        step = export(Path(args.source), Path(args.out), dtype=args.dtype, force=args.force)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {step} -> {args.out} ({args.dtype})")
    return 0


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
