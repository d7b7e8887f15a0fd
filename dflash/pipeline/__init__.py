"""The multi-process pipeline: target worker processes feed a restartable drafter group (torchrun)
through the hidden-state transport in `dflash.pipeline.transport` (one shared-memory queue per host)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.errors import DFlashError

if TYPE_CHECKING:
    from dflash.config import JobConfig

DATA_SUMMARY_ENV = "DFLASH_DATA_SUMMARY"
"""Set by the launcher for the drafter group: the data counts (TokenizedDataset.summary, JSON) of the
data the targets read, for the drafter group's `started` event (the drafters read no data)."""

STOP_FILE_ENV = "DFLASH_STOP_FILE"
"""Set by the launcher for torchrun: a file that exists while the job is being stopped; torchrun
restarts no failed drafter group then (dflash.pipeline.torchrun)."""


def worker_devices(cfg: JobConfig) -> tuple[list[str], list[str]]:
    """(target devices, local drafter devices) of one host: the config's lists, or by default targets
    on the first GPUs and drafters on the ones after them. The launcher places targets and each
    drafter rank takes entry [local_rank] from the same answer."""
    import torch

    p = cfg.pipeline
    cuda = cfg.run.device in ("cuda", "auto") and torch.cuda.is_available()
    n = torch.cuda.device_count() if cuda else 0
    targets = p.target_devices or [f"cuda:{i % n}" if cuda else "cpu" for i in range(p.targets)]
    drafters = p.drafter_devices or [
        f"cuda:{(p.targets + i) % n}" if cuda else "cpu" for i in range(p.drafters)
    ]
    if len(targets) != p.targets:
        raise DFlashError(
            f"pipeline.target_devices lists {len(targets)} devices for {p.targets} targets; list one device "
            "per target worker, or change pipeline.targets"
        )
    if len(drafters) != p.drafters:
        raise DFlashError(
            f"pipeline.drafter_devices lists {len(drafters)} devices for {p.drafters} drafters; list one "
            "device per drafter worker, or change pipeline.drafters"
        )
    return targets, drafters
