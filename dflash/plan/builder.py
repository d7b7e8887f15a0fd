"""The job plan: what a job will do on this machine, decided once, as data.

    plan = build_plan(cfg, target_config=..., mask_token_id=..., target_path=...)

One function (build_plan) asks every resolver (dflash.plan.resolve, dflash.plan.spec, dflash.plan.shapes,
dflash.plan.resolve.worker_devices) and returns a frozen JobPlan: the device, the attention plan (the
backend and its kernel choices as one object), kernel strictness, the loss and precision choices,
the target's compile, the drafter's resolved sizes, the shape plan and its recompile limit, where
each worker runs, and whether the job measures tau. `python -m dflash.check --json` prints it
(`plan`); two plans compare whole (tests/dflash/test_plan.py).

Light, as dflash.plan.resolve is: no transformers import, no model, no data. The drafter's sizes need
the target's config (an object with its sizes, as transformers' or dflash.data.demo's tiny one) and the
mask token (the tokenizer's, or drafter.mask_token_id); without them the plan has no `spec`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from dflash.config import JobConfig
    from dflash.plan.shapes import ShapePlan
    from dflash.plan.spec import DrafterSpec


def compiled(how: bool | Callable[[Any], Any] = True) -> Any:
    """A plan field's mark: whether (True), or in which form (a function of the value), it decides
    what inductor compiles, so the compile cache's key holds it (compile_part, dflash.cache.fingerprint).
    Every field carries one: a field that decides compiled code cannot be left out by forgetting."""
    return field(metadata={"compiled": how})


def not_compiled() -> Any:
    """A plan field's mark: it changes no compiled code (where workers run, what the job measures)."""
    return field(metadata={"compiled": False})


def compile_part(plan: Any) -> dict[str, Any]:
    """The compile-relevant part of a plan (or of a plan inside it), as plain data: every field
    marked compiled, in the form its mark gives."""
    out: dict[str, Any] = {}
    for f in fields(plan):
        how = f.metadata["compiled"]
        if how is False:
            continue
        value = getattr(plan, f.name)
        if how is not True:
            value = how(value)
        elif isinstance(value, AttentionPlan):  # a plan inside the plan: its own marks
            value = compile_part(value)
        elif hasattr(value, "to_dict"):
            value = value.to_dict()
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _device_type(device: str) -> str:
    return torch.device(device).type  # cuda:0 and cuda:1 compile alike


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The drafter's attention as the job runs it."""

    backend: str = compiled()
    """flex or sdpa (attention.backend resolved on the device)."""
    compile: bool = compiled()
    tuned_kernels: bool = compiled()
    """flex's kernel options (tiles, stages, warps) are in its generated kernels."""
    flex_kernels: str = compiled()
    """flex or dflash: whose kernels the flex backend runs (the layers' graphs hold one or the other)."""
    fused_qk_norm_rope: bool = compiled()
    sdpa_chunk_blocks: int = compiled()
    strict: bool = not_compiled()
    """A degraded kernel stops the worker (attention.strict_kernels resolved)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # plain values only: every field as it is


@dataclass(frozen=True, slots=True)
class JobPlan:
    device: str = compiled(_device_type)
    """The job's device ("cuda", "cpu", "cuda:1"): the single-process job's, warm-cache's, and the
    device type every worker's choices below were resolved for."""
    attention: AttentionPlan = compiled()
    fused_loss: bool = compiled()
    """The loss chunk compiled (its graph or the loss kernel) or eager."""
    bf16_weights: bool = compiled()
    """The drafter's linear layers hold bf16 weights (train.bf16_weights resolved): the layers'
    graphs take them."""
    target_compile: bool = compiled()
    drafter_world: int = compiled(lambda world: world > 1)
    """Ranks of the drafter group over all hosts (above 1: DDP, whose optimizer splits the graphs)."""
    shapes: ShapePlan = compiled()
    spec: DrafterSpec | None = compiled()
    """The drafter's resolved sizes; None where the plan was built without the target's config."""
    target_dtype: str = compiled()
    """The target's weights and hidden states (the drafter's input)."""
    loss_chunk_tokens: int = compiled()
    num_anchors: int = compiled()
    target_devices: tuple[str, ...] = not_compiled()
    drafter_devices: tuple[str, ...] = not_compiled()
    """Devices of this host's target workers and local drafter ranks (the pipeline's placement)."""
    tau_eval: bool = not_compiled()
    """The pipeline measures tau after each checkpoint (train.tau_eval resolved)."""

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def recompile_limit(self) -> int:
        """dynamo's recompile limit: exactly the graphs the shape plan compiles (dflash.plan.shapes)."""
        return self.shapes.recompile_limit

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "attention": self.attention.to_dict(),
            "fused_loss": self.fused_loss,
            "bf16_weights": self.bf16_weights,
            "target_compile": self.target_compile,
            "drafter_world": self.drafter_world,
            "shape_plan": self.shapes.to_dict(),
            "recompile_limit": self.recompile_limit,
            "spec": None if self.spec is None else self.spec.to_dict(),
            "target_dtype": self.target_dtype,
            "loss_chunk_tokens": self.loss_chunk_tokens,
            "num_anchors": self.num_anchors,
            "placement": {"targets": list(self.target_devices), "drafters": list(self.drafter_devices)},
            "tau_eval": self.tau_eval,
        }


def build_plan(
    cfg: JobConfig,
    *,
    device: torch.device | None = None,
    target_config: Any = None,
    mask_token_id: int | None = None,
    target_path: str | None = None,
    spec: DrafterSpec | None = None,
) -> JobPlan:
    """The plan of `cfg` on this machine. device: the job's (None: run.device resolved, which refuses
    cuda where none is visible); target_config and mask_token_id: the drafter's sizes (without
    them no spec, and the fused q/k kernel is judged without the drafter's head dim); target_path:
    the target's directory, whose config.json counts the compiled target's layer types; spec: the
    drafter's sizes where the caller resolved them already (a spare drafter, a trainer). A choice
    the machine cannot run raises ConfigError naming its key."""
    from dflash.plan.resolve import (
        drafter_world,
        resolve_backend,
        resolve_bf16_weights,
        resolve_device,
        resolve_flex_kernels,
        resolve_fused_loss,
        resolve_fused_qk_norm_rope,
        resolve_strict,
        resolve_target_compile,
        resolve_tau_eval,
        worker_devices,
    )
    from dflash.plan.shapes import shape_plan
    from dflash.plan.spec import resolve_spec

    device = device if device is not None else resolve_device(cfg)
    if spec is None and target_config is not None and mask_token_id is not None:
        spec = resolve_spec(cfg.drafter, target_config, mask_token_id)
    a = cfg.attention
    backend, kernels = resolve_backend(cfg, device), resolve_flex_kernels(cfg, device)
    head_dim = None if spec is None else spec.head_dim
    attention = AttentionPlan(
        backend=backend,
        compile=a.compile,
        tuned_kernels=a.tuned_kernels,
        flex_kernels=kernels,
        fused_qk_norm_rope=resolve_fused_qk_norm_rope(
            cfg, device, head_dim, backend=backend, kernels=kernels
        ),
        sdpa_chunk_blocks=a.sdpa_chunk_blocks,
        strict=resolve_strict(cfg, device),
    )
    targets, drafters = worker_devices(cfg)
    target_compile = resolve_target_compile(cfg, device)
    return JobPlan(
        device=str(device),
        attention=attention,
        fused_loss=resolve_fused_loss(cfg, device),
        bf16_weights=resolve_bf16_weights(cfg, device),
        target_compile=target_compile,
        drafter_world=drafter_world(cfg),
        shapes=shape_plan(cfg, target_path=target_path, target_compile=target_compile),
        spec=spec,
        target_dtype=cfg.target.dtype,
        loss_chunk_tokens=cfg.train.loss_chunk_tokens,
        num_anchors=cfg.train.num_anchors,
        target_devices=tuple(targets),
        drafter_devices=tuple(drafters),
        tau_eval=resolve_tau_eval(cfg),
    )


def plan_problems(cfg: JobConfig, *, head_dim: int | None = None) -> tuple[torch.device | None, list[Any]]:
    """(the job's device or None, every ConfigError of the choices build_plan makes on this machine),
    each resolver asked on its own so that one refusal does not hide the next (dflash.check)."""
    from dflash.errors import ConfigError
    from dflash.plan.resolve import (
        resolve_backend,
        resolve_bf16_weights,
        resolve_device,
        resolve_flex_kernels,
        resolve_fused_qk_norm_rope,
    )

    problems: list[ConfigError] = []
    try:
        device = resolve_device(cfg)
    except ConfigError as e:
        return None, [e]
    backend: str | None = None
    try:
        backend = resolve_backend(cfg, device)
    except ConfigError as e:
        problems.append(e)
    try:
        resolve_bf16_weights(cfg, device)
    except ConfigError as e:
        problems.append(e)
    kernels = resolve_flex_kernels(cfg, device)
    try:
        resolve_fused_qk_norm_rope(cfg, device, head_dim, backend=backend, kernels=kernels)
    except ConfigError as e:
        problems.append(e)
    return device, problems
