"""What a job config resolves to on this machine, decided without building a model: device,
attention backend, kernel strictness, the fused loss, the weights' dtype, the captured target
layers, and the process state compiled code depends on (intra-op threads, DDP) for each kind of
job process.

The trainer, the launcher, the workers, warm-cache, the fingerprint and the config check
(dflash.check) all ask here, so they cannot disagree. Deliberately light (no transformers import):
dflash.check runs it before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflash.errors import ConfigError, DFlashError
from dflash.step.triton_jit import kernel_device

if TYPE_CHECKING:
    from dflash.config import JobConfig


def named_device_type(cfg: JobConfig) -> str:
    """The device type run.device names (auto: cuda where one is visible), without refusing a cuda
    config on a machine with no GPU (resolve_device does), so a plan can be read anywhere."""
    if cfg.run.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.run.device


def resolve_device(cfg: JobConfig) -> torch.device:
    if cfg.run.device == "auto":
        return torch.device(named_device_type(cfg))
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device", "is cuda but no CUDA device is visible; use cpu or auto")
    return torch.device(cfg.run.device)


def resolve_backend(cfg: JobConfig, device: torch.device) -> str:
    """flex on GPU, sdpa on CPU (FlexAttention has no backward on CPU)."""
    backend = cfg.attention.backend
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "attention.backend", "flex cannot train on CPU (no backward there); use sdpa or auto"
        )
    return backend


def resolve_flex_kernels(cfg: JobConfig, device: torch.device) -> str:
    """attention.flex_kernels: auto is dflash's kernels on a GPU, flex's elsewhere; dflash or flex as set."""
    choice = cfg.attention.flex_kernels
    if choice == "auto":
        return "dflash" if device.type == "cuda" else "flex"
    return choice


def resolve_fused_qk_norm_rope(
    cfg: JobConfig, device: torch.device, head_dim: int | None, *, backend: str | None, kernels: str
) -> bool:
    """attention.fused_qk_norm_rope: auto is on wherever dflash's attention kernels run (a GPU, the
    flex backend, flex_kernels resolving to dflash: backend and kernels as the plan resolved them,
    backend None where it was refused) and the drafter's head dim suits the kernel (head_dim: the
    drafter's, where the caller knows it); true is refused where they do not run or with a head
    dim the kernel cannot take."""
    choice = str(cfg.attention.fused_qk_norm_rope).lower()
    if choice == "false":
        return False
    from dflash.step.attention.qk_norm_rope import fused_qk_head_dim_problem

    runs = device.type == "cuda" and backend == "flex" and kernels == "dflash"
    problem = fused_qk_head_dim_problem(head_dim) if head_dim is not None else None
    if choice == "auto":
        return runs and problem is None
    key = "attention.fused_qk_norm_rope"
    if problem:
        raise ConfigError(key, problem)
    if device.type != "cuda":
        raise ConfigError(
            key,
            f"is part of dflash's attention kernels, which run on a GPU only (this job runs on {device.type}): "
            "set it false or auto",
        )
    if not runs:
        raise ConfigError(
            key,
            f"is part of dflash's attention kernels, which this job does not run (attention.backend="
            f"{cfg.attention.backend}, flex_kernels={kernels}): set attention.flex_kernels=dflash (or auto) "
            "with the flex backend, or set it false or auto",
        )
    return True


def resolve_target_compile(cfg: JobConfig, device: torch.device | None = None) -> bool:
    """target.compile: auto compiles the target's decoder layers on a GPU where attention.compile is
    on (the capture's measured 1.32x, TargetConfig's docstring), not on the CPU. device: the job's
    (None: the one run.device names, named_device_type)."""
    s = str(cfg.target.compile).lower()
    if s != "auto":
        return s == "true"
    kind = named_device_type(cfg) if device is None else device.type
    return kind == "cuda" and bool(cfg.attention.compile)


def resolve_strict(cfg: JobConfig, device: torch.device) -> bool:
    s = str(cfg.attention.strict_kernels).lower()
    return device.type == "cuda" if s == "auto" else s == "true"


def resolve_fused_loss(cfg: JobConfig, device: torch.device) -> bool:
    """train.fused_loss: auto compiles the loss chunk where the drafter is compiled on a GPU (on the
    CPU the eager chunk is fast enough, and a compile costs every short CPU run seconds)."""
    s = str(cfg.train.fused_loss).lower()
    return device.type == "cuda" and cfg.attention.compile if s == "auto" else s == "true"


def resolve_bf16_weights(cfg: JobConfig, device: torch.device) -> bool:
    """train.bf16_weights: auto is true on a GPU for a single drafter (the same maths as float32
    weights, to bf16 tolerance); a drafter group would average bf16 gradients (the config's docstring).
    The float32 masters live in dflash.step.optim_kernel's KernelAdamW, which runs on CUDA (and on the CPU
    only under Triton's interpreter, for the tests)."""
    s = str(cfg.train.bf16_weights).lower()
    if s == "auto":
        return device.type == "cuda" and drafter_world(cfg) == 1
    if s == "true" and not kernel_device(device):
        raise ConfigError(
            "train.bf16_weights",
            f"is true but the drafter runs on {device.type}: the float32 masters are kept by the GPU "
            "optimizer's kernel; use auto or false off the GPU",
        )
    return s == "true"


def resolve_tau_eval(cfg: JobConfig) -> bool:
    """train.tau_eval: auto is on, on every device: the eval runs on the CPU or on the first target's
    GPU, where it checks its own room at each measurement (dflash.pipeline.supervisor.TauEval)."""
    return str(cfg.train.tau_eval).lower() != "false"


# ---- the process state compiled code depends on --------------------------------------------------
#
# inductor keys (and specialises) a graph that runs C++ on the CPU on the process's intra-op thread
# count (torch.get_num_threads(): FxGraphHashDetails.cpp_runtime_thread_count), and dynamo's
# DDPOptimizer compiles a layer that runs inside DistributedDataParallel as other graphs (split at
# gradient-bucket boundaries). Both are process state, not config, so dflash.cache.warm can only compile
# what a job process compiles if each job process takes that state from here, and warm compiles
# once per distinct state (compile_contexts).

ROLES = ("train", "target", "drafter")
"""Kinds of job process: dflash.train (target and drafter in one process), a pipeline target worker,
a pipeline drafter worker (dflash.pipeline.supervisor runs them under torchrun)."""

PIPELINE_DRAFTER_THREADS = 1
"""Intra-op threads of a pipeline drafter when OMP_NUM_THREADS is not set: the launcher runs targets
and drafters side by side on one host's cores (and torchrun would otherwise default to 1 with a warning)."""

_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own default for this process (OMP_NUM_THREADS, else the physical cores), read when this
module is first imported: before any dflash code changes it."""


def omp_threads(env: Mapping[str, str] | None = None) -> int | None:
    """OMP_NUM_THREADS as a positive int, None when unset or not one (torch then ignores it too)."""
    value = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def worker_threads(role: str, env: Mapping[str, str] | None = None) -> int:
    """Intra-op CPU threads a job process of `role` (one of ROLES) runs, and so compiles, under."""
    if role not in ROLES:
        raise ValueError(f"unknown job process role {role!r}; one of {ROLES}")
    explicit = omp_threads(env)
    if explicit is not None:
        return explicit
    return PIPELINE_DRAFTER_THREADS if role == "drafter" else _DEFAULT_THREADS


def apply_worker_threads(role: str) -> int:
    """Set this process's intra-op threads for `role` (before anything compiles); returns the count.
    A no-op where the process already runs with it (the usual case: the launcher sets OMP_NUM_THREADS)."""
    n = worker_threads(role)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def drafter_world(cfg: JobConfig) -> int:
    """Ranks of the pipeline's drafter group (all hosts): above 1 the drafter runs under DDP."""
    return cfg.pipeline.drafters * cfg.pipeline.nnodes


@dataclass(frozen=True, slots=True)
class CompileContext:
    """How one kind of job process runs a compiled part, as far as the compiled code depends on it."""

    role: str
    """The first job process of ROLES that compiles this way."""
    threads: int
    """Intra-op CPU threads (worker_threads)."""
    ddp: bool
    """The drafter is wrapped in DistributedDataParallel (a pipeline drafter group of more than 1 rank)."""

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "threads": self.threads, "ddp": self.ddp}


def compile_contexts(cfg: JobConfig, part: str, device: torch.device) -> list[CompileContext]:
    """Every distinct way the job's processes compile `part` ("drafter" or "target") on `device`: the
    single-process job and the pipeline's worker of that part. dflash.cache.warm compiles each of them.

    Thread counts only tell contexts apart on the CPU (graphs of CUDA tensors are not keyed on them)."""
    if part not in ("drafter", "target"):
        raise ValueError(f"unknown compiled part {part!r}; drafter or target")
    candidates = [
        CompileContext("train", worker_threads("train"), ddp=False),
        CompileContext(part, worker_threads(part), ddp=part == "drafter" and drafter_world(cfg) > 1),
    ]
    distinct: dict[tuple[int | None, bool], CompileContext] = {}
    for c in candidates:
        distinct.setdefault((c.threads if device.type == "cpu" else None, c.ddp), c)
    return list(distinct.values())


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


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
