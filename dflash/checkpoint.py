"""Drafter checkpoints: `checkpoints/step-<N>/` with

    model.safetensors   drafter weights only (the target's embedding and LM head are not stored)
    config.json         the drafter config in the layout inference engines read for DFlash drafters
    trainer.pt          optimizer, scheduler, RNG states, data position(s), step
    meta.json           step, time, file sizes; written last

A checkpoint is assembled in a hidden temp dir and renamed into place, so `step-<N>` either exists
complete or not at all. Resume takes the newest complete one; a torn leftover (a temp dir, or a
step dir missing files after a crash of the filesystem) is ignored and reported.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from dflash.rundir import install_dir

_STEP_RE = re.compile(r"^step-(\d+)$")
REQUIRED = ("model.safetensors", "config.json", "trainer.pt", "meta.json")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    step: int,
    *,
    weights: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step-{step}-"))
    try:
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in weights.items()},
            str(tmp / "model.safetensors"),
            metadata={"format": "pt"},
        )
        # The config states the dtype the file really holds (fp32 master weights: resume is exact;
        # engines cast to their serving dtype on load).
        dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in weights.values()})
        if len(dtypes) == 1:
            hf_config = {**hf_config, "torch_dtype": dtypes[0]}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        torch.save(trainer_state, tmp / "trainer.pt")
        sizes = {name: (tmp / name).stat().st_size for name in REQUIRED if name != "meta.json"}
        (tmp / "meta.json").write_text(
            json.dumps({"step": step, "saved_at": time.time(), "sizes": sizes}) + "\n"
        )
        for name in REQUIRED:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        install_dir(tmp, final)  # a re-save of the same step (after a restart) replaces the old copy
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune_checkpoints(root, keep_last)
    return final


def _is_complete(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
        return all((path / name).stat().st_size == size for name, size in meta["sizes"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


@dataclass(slots=True)
class Found:
    path: Path | None
    torn: list[Path]


def find_latest(root: Path) -> Found:
    """Newest complete checkpoint, and the torn ones skipped on the way."""
    torn = [p for p in root.glob(".tmp-step-*")] if root.exists() else []
    steps = []
    for p in root.iterdir() if root.exists() else []:
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            steps.append((int(m.group(1)), p))
    for _, p in sorted(steps, reverse=True):
        if _is_complete(p):
            return Found(p, torn)
        torn.append(p)
    return Found(None, torn)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    complete = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and _is_complete(p)
    )
    for _, p in complete[:-keep_last]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-step-*"):  # leftovers of a crash mid-save: never resumable
        shutil.rmtree(p, ignore_errors=True)


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu"
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, hf_config, trainer_state)."""
    weights = {k: v.to(map_location) for k, v in load_file(str(path / "model.safetensors")).items()}
    hf_config = json.loads((path / "config.json").read_text())
    # Always CPU: RNG states must stay CPU ByteTensors; the optimizer moves its state to the params.
    trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    return weights, hf_config, trainer_state
