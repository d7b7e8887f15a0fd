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
    tau_prompts: str | None = None
    """The in-job tau's held-out prompts (dflash.data.holdout.JobSource), None when there are none."""


def training_data(
    cfg: JobConfig, target_path: str, tok: Any, log: Callable[[str], None], *, measures_tau: bool = True
) -> tuple[str, str | None]:
    """(the JSONL the job trains on, the in-job tau's prompts): data.path's lines not held out for
    tau (dflash.data.holdout), or with data.responses its target's responses to their prompts
    (generated here where not made yet: dflash.data.responses)."""
    from dflash.data.holdout import job_source

    source = job_source(cfg, locate_data(cfg), measures_tau=measures_tau)
    data_path = source.data_path
    if cfg.data.responses:
        from dflash.data.responses import ensure

        device = "cuda" if cfg.run.device != "cpu" and torch.cuda.is_available() else "cpu"
        data_path = str(ensure(cfg, data_path, target_path, tok, device=device, log=log))
    return data_path, source.tau_prompts


def prepare_data(cfg: JobConfig, run: RunDir, *, measures_tau: bool = True) -> DataParts:
    """Tokenizer, mask token and dataset: every data error surfaces here, before any model loads.
    measures_tau: the job measures tau in itself (the pipeline; dflash.train does not), so its
    prompts are held out of the data (dflash.data.holdout)."""
    import dataclasses

    from dflash.data.dataset import load_dataset

    target_path, tok, mask_id = open_target(cfg)
    cache_root = Path(cfg.data.cache_dir or Path(cfg.run.runs_root) / ".tokcache")
    log_path = run.logs / "data.log"

    def log(msg: str) -> None:
        with open(log_path, "a") as f:
            f.write(msg + "\n")

    data_path, tau_prompts = training_data(cfg, target_path, tok, log, measures_tau=measures_tau)
    data_cfg = dataclasses.replace(cfg.data, path=data_path)

    ds = load_dataset(data_cfg, tok, cache_root, log)
    return DataParts(
        tokenizer=tok, mask_token_id=mask_id, dataset=ds, target_path=target_path, tau_prompts=tau_prompts
    )


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
