"""A job's data made ready: the tokenizer and mask token, the training file (the target's responses
where data.responses asks), the tokenized dataset, the job plan from them, and the batcher."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.data.inputs import locate_data, open_target

if TYPE_CHECKING:
    from dflash.config import JobConfig
    from dflash.rundir import RunDir


@dataclass
class DataParts:
    tokenizer: Any
    mask_token_id: int
    dataset: Any
    target_path: str


def training_data_path(cfg: JobConfig, target_path: str, tok: Any, log: Callable[[str], None]) -> str:
    """The JSONL the job trains on: data.path's, or with data.responses its target's responses to
    data.path's prompts (generated here where not made yet: dflash.data.responses)."""
    data_path = locate_data(cfg)
    if cfg.data.responses:
        from dflash.data.responses import ensure

        device = "cuda" if cfg.run.device != "cpu" and torch.cuda.is_available() else "cpu"
        data_path = str(ensure(cfg, data_path, target_path, tok, device=device, log=log))
    return data_path


def prepare_data(cfg: JobConfig, run: RunDir) -> DataParts:
    """Tokenizer, mask token and dataset: every data error surfaces here, before any model loads."""
    import dataclasses

    from dflash.data.dataset import load_dataset

    target_path, tok, mask_id = open_target(cfg)
    cache_root = Path(cfg.data.cache_dir or Path(cfg.run.runs_root) / ".tokcache")
    log_path = run.logs / "data.log"

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    data_cfg = dataclasses.replace(cfg.data, path=training_data_path(cfg, target_path, tok, log))

    ds = load_dataset(data_cfg, tok, cache_root, log)
    return DataParts(tokenizer=tok, mask_token_id=mask_id, dataset=ds, target_path=target_path)


def plan_job(cfg: JobConfig, parts: DataParts, device: torch.device | None = None) -> Any:
    """The job plan (dflash.plan.builder) with the drafter's sizes, from the target's config alone (no
    weights): what a target worker and the launcher run."""
    from transformers import AutoConfig

    from dflash.plan.builder import build_plan

    return build_plan(
        cfg,
        device=device,
        target_config=AutoConfig.from_pretrained(parts.target_path),
        mask_token_id=parts.mask_token_id,
        target_path=parts.target_path,
    )


def make_batcher(cfg: JobConfig, dataset: Any, *, plan: Any, rank: int = 0, world_size: int = 1) -> Any:
    """plan: the job's shape plan (dflash.plan.builder.JobPlan.shapes): the rows each bucket fills to."""
    from dflash.data.dataset import TokenBudgetBatcher

    return TokenBudgetBatcher(
        dataset,
        plan=plan,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        rank=rank,
        world_size=world_size,
    )
