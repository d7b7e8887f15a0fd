"""Spare drafters: whether this job runs one per local drafter rank and where (on its GPU, or on the
host with its training state copied in at takeover), from the memory they need and the room there."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.errors import ConfigError
from dflash.plan.placement import GIB, _gib, cuda_index, target_weight_bytes, worst

if TYPE_CHECKING:
    from dflash.config import JobConfig

SPARE_CONTEXT_BYTES = 1 << 30
"""What a host-mode spare drafter holds on its GPU: a CUDA context and the loaded kernel modules
(an allowance, not a measurement of this job)."""


@dataclass(frozen=True, slots=True)
class SparePlan:
    """pipeline.spare_drafters resolved for this host (dflash.pipeline.spare): one spare per local
    drafter rank, in `mode` (off, host or graphs), each holding host_bytes of host memory and
    gpu_bytes on its rank's GPU while it waits."""

    mode: str
    why: str
    host_bytes: int
    gpu_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "why": self.why,
            "host_bytes": self.host_bytes,
            "gpu_bytes": self.gpu_bytes,
        }


def _spare_refused(cfg: JobConfig, mode: str, why: str) -> ConfigError:
    return ConfigError(
        "pipeline.spare_drafters",
        f"= {mode}: {why}. Set pipeline.spare_drafters = auto (the mode that fits) or off (a new drafter "
        "generation then starts from nothing: imports, CUDA, frozen head, model build, graphs)",
    )


def spare_plan(
    cfg: JobConfig,
    targets: list[str],
    drafters: list[str],
    *,
    host_bytes: int,
    mem_available: int | None,
    totals: dict[int, int],
    record: dict[str, Any] | None,
    target_path: str | None = None,
) -> SparePlan:
    """The spares' mode and cost, or the refusal (a ConfigError naming pipeline.spare_drafters) of a
    mode asked for that does not fit. host_bytes: one spare's drafter (float32) and frozen embedding
    and head on the host; mem_available: the host's MemAvailable (None: not known)."""
    from dflash.plan.resolve import drafter_world

    want = cfg.pipeline.spare_drafters
    if want == "off":
        return SparePlan("off", "pipeline.spare_drafters = off", 0, 0)
    n = len(drafters)
    if mem_available is not None and n * host_bytes > mem_available:
        why = (
            f"{n} spare(s) need {_gib(n * host_bytes)} of host memory (the drafter in float32 and the "
            f"frozen embedding and head, each), and the host has {_gib(mem_available)} available"
        )
        if want == "auto":
            return SparePlan("off", why, 0, 0)
        raise _spare_refused(cfg, want, why)
    world = drafter_world(cfg)
    cuda = [i for d in drafters if (i := cuda_index(d)) is not None]
    drafter = worst(record, "drafter") if record else None
    target = worst(record, "target") if record else None
    target_bytes = target[1] if target else target_weight_bytes(target_path)
    headroom = int(cfg.run.memory_headroom_gb * GIB)

    def beside(i: int) -> int:
        """What the drafter and the targets of cuda:i take (0 without a memory record)."""
        on_i = sum(1 for d in targets if cuda_index(d) == i)
        return (drafter[1] if drafter else 0) + target_bytes * on_i

    graphs_why = ""
    if world > 1:
        graphs_why = f"a group of {world} ranks compiles under DDP, whose graphs a spare of one process cannot load ahead"
    elif cuda and drafter is None:
        graphs_why = (
            "no memory record (warm-cache's) to size its warm-up step by: warm or restore the compile cache"
        )
    elif cuda and drafter is not None:
        for i in cuda:
            total = totals.get(i)
            if total is None or beside(i) + drafter[1] > total - headroom:
                graphs_why = (
                    f"its warm-up step needs a second {_gib(drafter[1])} (the drafter's shape {drafter[0]}, "
                    f"measured by warm-cache) on cuda:{i}, beside {_gib(beside(i))} of the drafter and "
                    f"targets, of {_gib(total or 0)} less run.memory_headroom_gb"
                )
                break
    if want == "graphs" and graphs_why:
        raise _spare_refused(cfg, want, graphs_why)
    if want == "graphs" or (want == "auto" and not graphs_why):
        why = "its graphs loaded ahead: " + ("host memory" if not cuda else "a second step's memory fits")
        gpu = drafter[1] if (cuda and drafter) else 0
        return SparePlan("graphs", why, 0 if cuda else host_bytes, gpu)
    gpu = SPARE_CONTEXT_BYTES if cuda else 0
    for i in cuda:
        total = totals.get(i)
        if total is not None and drafter is not None and beside(i) + gpu > total - headroom:
            why = (
                f"its CUDA context ({_gib(gpu)}) does not fit cuda:{i} beside {_gib(beside(i))} of the "
                f"drafter and targets, of {_gib(total)} less run.memory_headroom_gb"
            )
            if want == "auto":
                return SparePlan("off", why, 0, 0)
            raise _spare_refused(cfg, want, why)
    why = "pipeline.spare_drafters = host" if want == "host" else f"host only: {graphs_why}"
    return SparePlan("host", why, host_bytes, gpu)


def spare_host_bytes(spec: Any, frozen_elem_bytes: int) -> int:
    """One spare's host memory: the drafter's trainable weights in float32 and the frozen embedding
    and head (two matrices, an upper bound for a tied target)."""
    from dflash.pipeline.state_copy import copy_nbytes

    return copy_nbytes(spec) // 3 + 2 * spec.vocab_size * spec.hidden_size * frozen_elem_bytes


def plan_spares(
    cfg: JobConfig, devices: tuple[list[str], list[str]], spec: Any, elem: int, target_path: str
) -> Any:
    """pipeline.spare_drafters against this host's memory and GPUs (dflash.plan.spares.spare_plan)."""
    from dflash.cache.job_side import CACHE_DIR_ENV
    from dflash.pipeline.state_copy import host_room
    from dflash.plan.placement import cuda_index, host_devices, restored_memory
    from dflash.plan.spares import spare_host_bytes, spare_plan

    uses_cuda = any(cuda_index(d) is not None for d in devices[1])
    cache_dir = os.environ.get(CACHE_DIR_ENV)
    return spare_plan(
        cfg,
        *devices,
        host_bytes=spare_host_bytes(spec, elem),
        mem_available=host_room()[1],
        totals=host_devices()[1] if uses_cuda else {},
        record=restored_memory(Path(cache_dir)) if cache_dir else None,
        target_path=target_path,
    )
