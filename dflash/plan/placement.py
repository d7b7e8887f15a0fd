"""Where the workers go and whether they fit: checked before any worker starts.

Placement rules (the config's pipeline.target_devices / drafter_devices, or their defaults):
  - one drafter rank per GPU: NCCL refuses two ranks of one group on one device ("Duplicate GPU
    detected"), and torchrun would spend every restart on that same deterministic error;
  - every device index exists on this host;
  - a target and a drafter may share a GPU only when the memory record says both fit.

The memory record is what `dflash.cache.warm` measured: the peak device memory of every planned shape
(the drafter's train step; the target's forward when target.compile is on), kept in warm.json,
the artifact's manifest and, after `dflashctl cache restore`, the restored cache's artifact.json.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.errors import ConfigError, DFlashError

if TYPE_CHECKING:
    from dflash.config import JobConfig

GIB = 2**30


class MemoryPlanError(DFlashError):
    """A planned shape does not fit its device."""


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass
class PeakMeter:
    """Peak device memory over a block of work (CUDA only; None elsewhere)."""

    device: Any
    allocated: int | None = None
    reserved: int | None = None

    @contextlib.contextmanager
    def measure(self) -> Iterator[PeakMeter]:
        import torch

        if self.device.type != "cuda":
            yield self
            return
        torch.cuda.synchronize(self.device)
        # Blocks cached for earlier shapes would count as this shape's reserved memory: hand them back.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        yield self
        torch.cuda.synchronize(self.device)
        self.allocated = int(torch.cuda.max_memory_allocated(self.device))
        self.reserved = int(torch.cuda.max_memory_reserved(self.device))


def is_oom(e: BaseException) -> bool:
    """Whether an exception is (or wraps, as a compile failure can) a device out-of-memory error."""
    import torch

    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, torch.OutOfMemoryError) or "out of memory" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def shrink_advice(part: str) -> str:
    if part == "target":
        return (
            "lower train.token_budget or train.max_batch_size (fewer rows per batch), or turn "
            "target.compile off"
        )
    return (
        "lower train.block_token_budget (fewer rows per short bucket), train.num_anchors or "
        "train.token_budget, or raise data.bucket_multiple"
    )


def oom_error(part: str, shape: Any, device: Any, total: int | None) -> MemoryPlanError:
    where = f"{device} ({_gib(total)})" if total else str(device)
    return MemoryPlanError(
        f"the {part}'s planned shape {shape.name} ({shape.block_tokens} block tokens, {shape.seq_tokens} "
        f"sequence tokens) ran out of memory on {where} during warm-cache, before any training: "
        f"{shrink_advice(part)}"
    )


def device_total(device: Any) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def worst(record: dict[str, Any], part: str) -> tuple[str, int] | None:
    """(shape name, peak reserved bytes) of the heaviest measured shape of `part`, None if none was."""
    shapes = record.get(part) if isinstance(record, dict) else None
    if not isinstance(shapes, dict):
        return None
    measured = [
        (name, int(v["peak_reserved"]))
        for name, v in shapes.items()
        if isinstance(v, dict) and isinstance(v.get("peak_reserved"), int)
    ]
    return max(measured, key=lambda x: x[1]) if measured else None


def _allocated(record: dict[str, Any], part: str, name: str) -> int:
    value = record[part][name].get("peak_allocated")
    return value if isinstance(value, int) else 0


def fit_problems(
    record: dict[str, Any] | None, total: int | None, headroom_gb: float, *, where: str
) -> list[str]:
    """Why the recorded shapes do not fit a device of `total` bytes less the headroom (each part on its own)."""
    if not record or not total:
        return []
    limit = total - int(headroom_gb * GIB)
    problems = []
    for part in ("drafter", "target"):
        w = worst(record, part)
        if w is not None and w[1] > limit:
            problems.append(
                f"the {part}'s planned shape {w[0]} needs {_gib(w[1])} of device memory (peak "
                f"reserved measured by warm-cache; {_gib(_allocated(record, part, w[0]))} allocated), "
                f"more than {where}'s {_gib(total)} less run.memory_headroom_gb ({headroom_gb:g}): "
                f"{shrink_advice(part)}"
            )
    return problems


def cuda_index(name: str) -> int | None:
    """The GPU a device name asks for; None for cpu. ValueError for anything the job cannot use."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"{name!r} is not a device; use cpu or cuda:N") from e
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"{name!r}: only cpu and cuda:N devices are supported")
    return device.index or 0


def device_name_problems(targets: list[str], drafters: list[str]) -> list[ConfigError]:
    """Device names the job cannot use, under the key that lists them."""
    problems = []
    for key, devs in (("pipeline.target_devices", targets), ("pipeline.drafter_devices", drafters)):
        for d in devs:
            try:
                cuda_index(d)
            except ValueError as e:
                problems.append(ConfigError(key, str(e)))
    return problems


def target_weight_bytes(target_path: str | None) -> int:
    """Bytes of the target's weight files: a lower bound of what a target worker holds."""
    if not target_path:
        return 0
    root = Path(target_path)
    try:
        return sum(p.stat().st_size for p in root.iterdir() if p.suffix in (".safetensors", ".bin"))
    except OSError:
        return 0


def missing_devices(key: str, devices: list[str], device_count: int) -> ConfigError | None:
    """The devices of a list (config key `key`) that this host, with device_count GPUs, lacks."""
    missing = list(
        dict.fromkeys(d for d in devices if (i := cuda_index(d)) is not None and i >= device_count)
    )
    if not missing:
        return None
    n = device_count
    seen = f"cuda:0..cuda:{n - 1}" if n > 1 else "only cuda:0" if n else "no CUDA device"
    return ConfigError(key, f"{', '.join(missing)}: not on this host, which has {seen}")


def placement_problems(
    cfg: JobConfig,
    targets: list[str],
    drafters: list[str],
    *,
    device_count: int | None,
    totals: dict[int, int] | None = None,
    record: dict[str, Any] | None = None,
    target_path: str | None = None,
) -> list[ConfigError]:
    """Every placement rule the devices break (see the module doc). device_count None: not known here."""
    problems = device_name_problems(targets, drafters)
    if problems:
        return problems
    cuda_drafters = [d for d in drafters if cuda_index(d) is not None]
    dup = sorted({d for d, n in Counter(f"cuda:{cuda_index(d)}" for d in cuda_drafters).items() if n > 1})
    if dup:
        # Derived devices (the list left empty): then the worker count is what to change.
        key = "pipeline.drafter_devices" if cfg.pipeline.drafter_devices else "pipeline.drafters"
        problems.append(
            ConfigError(
                key,
                f"puts more than one drafter rank on {', '.join(dup)} ({drafters}): NCCL refuses two "
                "ranks of one group on one device. Give each drafter its own GPU, or lower pipeline.drafters",
            )
        )
    if device_count is not None:
        for key, devs in (("pipeline.target_devices", targets), ("pipeline.drafter_devices", drafters)):
            problem = missing_devices(key, devs, device_count)
            if problem is not None:
                problems.append(problem)
    shared = sorted({cuda_index(d) for d in targets} & {cuda_index(d) for d in cuda_drafters} - {None})
    if shared and record and totals:
        drafter = worst(record, "drafter")
        target = worst(record, "target")
        target_bytes = target[1] if target else target_weight_bytes(target_path)
        source = "measured" if target else "its weight files, at least"
        limit_gb = cfg.run.memory_headroom_gb
        for i in shared:
            total = totals.get(i)
            if drafter is None or total is None:
                continue
            need = drafter[1] + target_bytes * sum(1 for d in targets if cuda_index(d) == i)
            if need > total - int(limit_gb * GIB):
                problems.append(
                    ConfigError(
                        "pipeline.drafter_devices",
                        f"shares cuda:{i} with a target, and the two do not fit: the drafter's shape "
                        f"{drafter[0]} needs {_gib(drafter[1])} (measured by warm-cache), the target "
                        f"{_gib(target_bytes)} ({source}), of {_gib(total)} less run.memory_headroom_gb "
                        f"({limit_gb:g}). Put the drafter on a GPU of its own (pipeline.drafter_devices / "
                        "pipeline.target_devices), or shrink the drafter's batches (train.block_token_budget)",
                    )
                )
    return problems


def host_devices() -> tuple[int | None, dict[int, int]]:
    """(GPU count, {index: total bytes}) of this host; (None, {}) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None, {}
    n = torch.cuda.device_count()
    return n, {i: int(torch.cuda.get_device_properties(i).total_memory) for i in range(n)}


def restored_memory(cache_dir: Path | None) -> dict[str, Any] | None:
    """The memory record of the artifact a restored cache dir came from, if it has one."""
    from dflash.cache.job_side import restored_artifact

    art = restored_artifact(cache_dir)
    memory = art.get("memory") if art else None
    return memory if isinstance(memory, dict) else None


def preflight(cfg: JobConfig, targets: list[str], drafters: list[str], target_path: str | None) -> None:
    """The job's own check at start, before any worker or model: placement against this host's
    GPUs, and the restored artifact's memory record (if any) against their memory. Raises the first
    problem (a ConfigError or MemoryPlanError naming the key or shape and what to change)."""
    import os

    from dflash.cache.job_side import CACHE_DIR_ENV

    names = device_name_problems(targets, drafters)
    if names:
        raise names[0]
    uses_cuda = any(cuda_index(d) is not None for d in [*targets, *drafters])
    count, totals = host_devices() if uses_cuda else (None, {})
    cache_dir = os.environ.get(CACHE_DIR_ENV)
    record = restored_memory(Path(cache_dir)) if cache_dir else None
    problems: list[DFlashError] = list(
        placement_problems(
            cfg, targets, drafters, device_count=count, totals=totals, record=record, target_path=target_path
        )
    )
    if record and not problems:
        for i in sorted({i for d in drafters if (i := cuda_index(d)) is not None}):
            for text in fit_problems(record, totals.get(i), cfg.run.memory_headroom_gb, where=f"cuda:{i}"):
                problems.append(MemoryPlanError(text))
    if problems:
        raise problems[0]


def slot_bytes(cfg: JobConfig, features: int, elem_bytes: int) -> int:
    """The largest batch the targets can publish: each length bucket pads to a fixed row count."""
    if cfg.pipeline.slot_mb:
        return cfg.pipeline.slot_mb << 20
    return _largest_batch_bytes(cfg, features, elem_bytes)


def _largest_batch_bytes(cfg: JobConfig, features: int, elem_bytes: int) -> int:
    """Bytes of the largest planned batch in the transport, with its headers and alignment."""
    from dflash.plan.shapes import shape_plan

    largest = max(
        (s.rows * s.length * (features * elem_bytes + 8 + 1) + s.rows * 8 for s in shape_plan(cfg).shapes),
        default=0,
    )
    return largest + (1 << 16)


def slot_problem(cfg: JobConfig, features: int, elem_bytes: int) -> str | None:
    """Why a set pipeline.slot_mb cannot hold the largest batch (the targets would fail at their first
    such batch, long after the start); None when it is 0 (derived) or large enough."""
    if not cfg.pipeline.slot_mb:
        return None
    need = _largest_batch_bytes(cfg, features, elem_bytes)
    if cfg.pipeline.slot_mb << 20 >= need:
        return None
    return (
        f"pipeline.slot_mb ({cfg.pipeline.slot_mb} MiB) is smaller than the largest hidden-state batch "
        f"this config makes ({need / 2**20:.1f} MiB); raise it, or set 0 to derive it"
    )


def gpu_mem_gb(device: torch.device, worker: str) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    return {worker: round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}


def alloc_retries(device: torch.device) -> dict[str, int]:
    """The caching allocator's retries on a CUDA device (a cudaMalloc that failed, the cache freed,
    and tried again): a count that grows is memory pressure. Empty off CUDA. A heartbeat field."""
    if device.type != "cuda":
        return {}
    return {"alloc_retries": int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))}
