"""The drafter half of the job: one optimizer step on (batch, target features).

Separable from the target forward on purpose: the single-process demo calls both in a loop, the
multi-process pipeline runs this in drafter workers fed by the hidden-state transport.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.profiler import record_function

from dflash.errors import DFlashError
from dflash.plan.builder import JobPlan, build_plan
from dflash.plan.resolve import torch_dtype
from dflash.plan.shapes import ShapePlan, apply_recompile_limit
from dflash.step.model import DFlashDrafter, DrafterSpec
from dflash.step.objective import (
    LossOutput,
    block_labels,
    dflash_loss,
    expected_streak,
    host_to_device,
    sample_anchors,
    trained_count,
)
from dflash.step.optim_kernel import KernelAdamW

if TYPE_CHECKING:
    from dflash.config import JobConfig
    from dflash.rundir import RunDir


def pad_rows(
    input_ids_BL: torch.Tensor, loss_mask_BL: torch.Tensor, seq_lens_B: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append empty rows (length 0, no loss) up to `rows`."""
    extra = rows - input_ids_BL.shape[0]
    if extra <= 0:
        return input_ids_BL, loss_mask_BL, seq_lens_B
    L = input_ids_BL.shape[1]
    return (
        torch.cat([input_ids_BL, input_ids_BL.new_zeros(extra, L)]),
        torch.cat([loss_mask_BL, loss_mask_BL.new_zeros(extra, L)]),
        torch.cat([seq_lens_B, seq_lens_B.new_zeros(extra)]),
    )


def pad_batch(plan: ShapePlan, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, loss_mask, seq_lens) of a data batch, padded to its length bucket's planned rows."""
    rows = plan.rows_for(batch.input_ids_BL.shape[1])
    return pad_rows(batch.input_ids_BL, batch.loss_mask_BL, batch.seq_lens_B, rows)


def apply_compile(model: DFlashDrafter, cfg: JobConfig) -> None:
    """Regional compile (torchtitan style): each decoder layer is compiled; identical layers share one
    graph per shape. The warm-cache entry point calls this same function, so warm and train hit the
    same graphs."""
    if not cfg.attention.compile:
        return
    for layer in model.layers:
        layer.compile(dynamic=False)
    if model.fc.weight.device.type == "cuda":
        # On the GPU the eager norms were ~20 small kernels a step; on the CPU (the demo and the tests)
        # compiling their dynamic-shape graphs doubled a cold warm's first shape (54.7 -> 110.7 s).
        model.compile_outer_norms()


def ddp_backend(device: torch.device) -> str:
    """The drafter group's process-group backend: NCCL for the gradients on GPU, gloo for the CPU
    control collectives (and everything on CPU)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """The drafter as a rank of a data-parallel group runs it. The wrapper is compile-relevant: dynamo's
    DDPOptimizer splits every compiled layer that runs inside it at gradient-bucket boundaries, so
    dflash.cache.warm wraps with this same function (in a group of one) to compile those graphs too."""
    if device.type != "cuda":
        return nn.parallel.DistributedDataParallel(model)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return nn.parallel.DistributedDataParallel(model, device_ids=[index])


def bf16_working_weights(model: nn.Module) -> dict[torch.Tensor, torch.Tensor]:
    """Turn the model's linear weights to bf16 in place (train.bf16_weights) and return each one's
    float32 master: its value before. The norms' weights stay float32: under autocast their products
    are float32, so bf16 weights there would change the results."""
    masters: dict[torch.Tensor, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad:
            w = module.weight
            masters[w] = w.detach().to(torch.float32, copy=True)
            w.data = w.data.to(torch.bfloat16)
    return masters


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The gradients' global 2-norm, accumulated in float32 whatever their dtype, in their order:
    bf16 gradients give the norm their values give as float32 (torch's get_total_norm would round
    each one's norm to bf16 and reorder them by dtype)."""
    if not grads:
        return torch.zeros(())
    norms: list[torch.Tensor | None] = [None] * len(grads)
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.device, g.dtype), []).append(i)
    for indices in by_kind.values():
        per_tensor = torch._foreach_norm([grads[i] for i in indices], 2.0, dtype=torch.float32)
        for i, n in zip(indices, per_tensor, strict=True):
            norms[i] = n
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms if n is not None]), 2.0)


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: list[nn.Parameter], max_norm: float
) -> torch.Tensor:
    """Clip the gradients' global norm to max_norm and take the optimizer step; returns the norm
    before clipping (a device tensor: nothing here waits for the device).

    A fused optimizer (AdamW(fused=True); the GPU's KernelAdamW is one) scales the gradients
    itself: it divides each by its `grad_scale` inside the update kernel (the hook GradScaler
    unscales through), so the clip factor goes there instead of a separate pass over every gradient
    (2.3 ms of the 8B step on the H200). Same update as clip_grad_norm_ then step, to the rounding of g / (1 / c) against g * c."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads)
    if getattr(optimizer, "defaults", {}).get("fused"):
        # clip_grad_norm_'s factor c = min(1, max_norm / (norm + 1e-6)); the kernel divides by 1 / c.
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)  # type: ignore[attr-defined]
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    optimizer.step()
    return norm


def lr_factor(step: int, cfg: JobConfig) -> float:
    """Linear warmup, then cosine from lr down to lr * min_lr_ratio at total_steps."""
    t = cfg.train
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.total_steps - t.warmup_steps))
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def noise_std(step: int, cfg: JobConfig) -> float:
    d = cfg.drafter
    if d.noise_std == 0:
        return 0.0
    progress = min(1.0, step / max(1, cfg.train.total_steps))
    if d.noise_schedule == "constant":
        return d.noise_std
    if d.noise_schedule == "linear":
        return d.noise_std * (1 - progress)
    return d.noise_std * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(slots=True)
class StepResult:
    step: int
    loss: float
    acc: float
    acc_per_pos: list[float]
    streak: float
    lr: float
    noise: float
    grad_norm: float
    tokens: int
    """Real sequence tokens of the batch (the throughput unit of the status line)."""
    block_tokens: int
    seconds: float


@dataclass(slots=True)
class QueuedStep:
    """A step whose work is queued on the device and whose values are not read back yet."""

    step: int
    out: LossOutput
    grad_norm: torch.Tensor
    seq_lens_B: torch.Tensor
    lr: float
    noise: float
    t0: float


def build_drafter(
    cfg: JobConfig, spec: DrafterSpec, embed_VH: torch.Tensor, head_VH: torch.Tensor, plan: JobPlan
) -> DFlashDrafter:
    """The drafter as it starts training, its parameters made on the host (the same initial values
    wherever it then trains) and its frozen embedding and head where they are given; the trainer
    moves it to the plan's device, for which the plan chose its kernels."""
    torch.manual_seed(cfg.run.seed)  # identical init on every rank
    a = plan.attention
    return DFlashDrafter(
        spec,
        embed_VH,
        head_VH,
        backend=a.backend,
        sdpa_chunk_blocks=a.sdpa_chunk_blocks,
        compile=a.compile,
        tuned_kernels=a.tuned_kernels,
        flex_kernels=a.flex_kernels,
        fused_qk_norm_rope=a.fused_qk_norm_rope,
    )


class DrafterTrainer:
    def __init__(
        self,
        cfg: JobConfig,
        spec: DrafterSpec,
        embed_VH: torch.Tensor,
        head_VH: torch.Tensor,
        device: torch.device,
        *,
        rank: int = 0,
        world_size: int = 1,
        on_step_compiled: Callable[[], None] | None = None,
        plan: JobPlan | None = None,
        model: DFlashDrafter | None = None,
    ) -> None:
        """plan: the job's plan (dflash.plan.builder), for `device`; None builds it here from the config.
        model: the drafter already built on the host by build_drafter (a spare drafter process,
        dflash.pipeline.spare, builds it before it is needed); None builds it here."""
        self.cfg, self.spec, self.device = cfg, spec, device
        self.rank, self.world_size = rank, world_size
        self.job_plan = job = plan if plan is not None else build_plan(cfg, device=device, spec=spec)
        self.backend = job.attention.backend
        self.flex_kernels = job.attention.flex_kernels
        self.fused_loss = job.fused_loss
        self.bf16_weights = job.bf16_weights
        self.plan = job.shapes
        if model is None:
            model = build_drafter(cfg, spec, embed_VH, head_VH, job)
        model = model.to(device)
        # Before DDP sees the parameters: its gradient buckets take their dtype.
        self.masters = bf16_working_weights(model) if self.bf16_weights else {}
        # Every compiled part of this process (the drafter's layers; the target's too in the
        # single-process job and in warm): the plan's graphs, nothing else (dflash.plan.shapes).
        apply_recompile_limit(self.plan)
        apply_compile(model, cfg)
        self.model = model
        self.module: nn.Module = wrap_ddp(model, device) if world_size > 1 else model
        self.params = params = [p for p in model.parameters() if p.requires_grad]
        t = cfg.train
        adamw = dict(lr=t.lr, betas=(t.betas[0], t.betas[1]), weight_decay=t.weight_decay)
        # On the GPU, torch's fused AdamW with the update as dflash.step.optim_kernel's kernel (the same
        # state and state_dict, 29.4 instead of 33.6 GB of memory traffic per 8B step).
        self.optimizer: torch.optim.Optimizer = (
            KernelAdamW(params, masters=self.masters, **adamw)
            if device.type == "cuda" or self.masters
            else torch.optim.AdamW(params, **adamw)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.step = 0
        self.anchor_gen = torch.Generator().manual_seed(cfg.run.seed * 1000 + rank)
        self.state_copy: Any = None
        """The pipeline's copier of the training state (dflash.pipeline.state_copy.StateCopier):
        told before each optimizer step (to wait for the last copy's reads) and after it."""

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(
        self,
        input_ids_BL: torch.Tensor,
        loss_mask_BL: torch.Tensor,
        seq_lens_B: torch.Tensor,
        target_hidden_BLF: torch.Tensor,
    ) -> StepResult:
        """One optimizer step on a padded batch; returns its metrics (read back from the device)."""
        return self.read_step(self.queue_step(input_ids_BL, loss_mask_BL, seq_lens_B, target_hidden_BLF))

    def queue_step(
        self,
        input_ids_BL: torch.Tensor,
        loss_mask_BL: torch.Tensor,
        seq_lens_B: torch.Tensor,
        target_hidden_BLF: torch.Tensor,
    ) -> QueuedStep:
        """Queue the whole step (forward, loss, backward, clipping, optimizer) without ever waiting for
        the device: a value read back mid-step leaves the GPU idle while the host launches what comes
        next (tests/dflash/test_trainer_step.py checks it under CUDA's sync debug mode)."""
        t0 = time.perf_counter()
        dev = self.device
        input_ids_BL, loss_mask_BL, seq_lens_B, target_hidden_BLF = (
            host_to_device(x, dev) for x in (input_ids_BL, loss_mask_BL, seq_lens_B, target_hidden_BLF)
        )
        shape = self.plan.check_batch(*input_ids_BL.shape)
        anchors_BA = sample_anchors(loss_mask_BL, seq_lens_B, shape.anchors, self.anchor_gen)
        labels_BAK, valid_BAK = block_labels(
            input_ids_BL, loss_mask_BL, seq_lens_B, anchors_BA, self.spec.block_size
        )
        trained = trained_count(valid_BAK)  # on its way to the host before the forward is queued
        noise = noise_std(self.step, self.cfg)
        self.module.train()
        # Named ranges for torch.profiler (bench/drafter_step.py --profile splits the step by them).
        with self.autocast():
            with record_function("dflash.forward"):
                hidden_BAKH = self.module(
                    input_ids_BL, target_hidden_BLF, anchors_BA, seq_lens_B, noise_std=noise
                )
            with record_function("dflash.loss"):
                out = dflash_loss(
                    hidden_BAKH,
                    self.model.lm_head_weight_VH,
                    labels_BAK,
                    valid_BAK,
                    self.cfg.train.gamma,
                    self.cfg.train.loss_chunk_tokens,
                    fused=self.fused_loss,
                    trained=trained,
                )
        self.optimizer.zero_grad(set_to_none=True)
        with record_function("dflash.backward"):
            out.loss.backward()
        with record_function("dflash.optimizer"):
            lr = self.scheduler.get_last_lr()[0]
            if self.state_copy is not None:
                self.state_copy.before_update()
            grad_norm = clip_and_step(self.optimizer, self.params, self.cfg.train.grad_clip)
            self.scheduler.step()
        self.step += 1
        if self.state_copy is not None:
            with record_function("dflash.state_copy"):
                self.state_copy.after_update(self.step)
        # The step's metrics start for the host now, behind this step's work and ahead of the next
        # step's: reading them (read_step) waits for this step only.
        out.start_read(out.loss.detach(), grad_norm, seq_lens_B.sum())
        return QueuedStep(self.step, out, grad_norm, seq_lens_B, lr, noise, t0)

    def read_step(self, q: QueuedStep) -> StepResult:
        """The queued step's metrics: the step's one wait for the device, for this step's end (not for
        a step queued after it)."""
        loss, grad_norm, tokens = q.out.read_started()
        return StepResult(
            step=q.step,
            loss=loss,
            acc=q.out.acc,
            acc_per_pos=q.out.acc_per_pos,
            streak=q.out.streak,
            lr=q.lr,
            noise=q.noise,
            grad_norm=grad_norm,
            tokens=int(tokens),
            block_tokens=q.out.tokens,
            seconds=time.perf_counter() - q.t0,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "anchor_gen": self.anchor_gen.get_state(),
        }

    def weights(self) -> dict[str, torch.Tensor]:
        """The drafter's trainable weights as a checkpoint holds them: the float32 masters of the
        weights the model holds in bf16 (train.bf16_weights), so that a resume is exact."""
        masters = {n: self.masters[p] for n, p in self.model.named_parameters() if p in self.masters}
        return {**self.model.trainable_state_dict(), **masters}

    def load_state_dict(self, state: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
        # Into a bf16 weight the copy rounds to nearest, as the optimizer writes it from its master.
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p in self.masters and name in weights:
                    self.masters[p].copy_(weights[name])
        trainable = set(self.model.trainable_state_dict())
        really_missing = [k for k in missing if k in trainable]
        if really_missing or unexpected:
            raise DFlashError(
                f"checkpoint does not match the drafter: missing {really_missing[:5]}, "
                f"unexpected {list(unexpected)[:5]}; was it written with another drafter config?"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.anchor_gen.set_state(state["anchor_gen"])
        self.step = int(state["step"])


class StepAhead:
    """Keeps one step queued ahead of the one whose metrics are read, as every training loop runs.

    `push` queues step N, then reads step N-1: the host launches N's forward while the device still
    runs N-1's backward and update, so the device never idles while the host prepares a step
    (sample anchors, masks, attention plans: about 10 ms of the 8B step on the H200 when each step
    was read before the next was queued). Results come back in step order, each once.

    Order rules the callers rely on:
    - a step for which `drain(step)` is true (a checkpoint, the last step) is read and returned by the
      push that queued it, and nothing is queued after it before that: a checkpoint holds exactly
      that step's weights;
    - `read_now=True` reads the step at once on the device (the first step of a new shape, so its
      compile time is its own) but still returns it with the next push, like any other: which pushes
      return what depends on the steps alone, so the ranks of a drafter group, which must run their
      collectives in the same order, stay in step whatever shapes each one sees."""

    def __init__(self, trainer: DrafterTrainer, *, drain: Callable[[int], bool] = lambda step: False) -> None:
        self.trainer, self.drain = trainer, drain
        self._pending: tuple[QueuedStep, Any, StepResult | None] | None = None
        self.read_now_result: StepResult | None = None
        """The step the last push read at once (read_now), whether or not it was returned yet."""

    @property
    def pending_result(self) -> StepResult | None:
        """The step queued last, if it was read already (read_now)."""
        return self._pending[2] if self._pending else None

    def push(
        self,
        input_ids_BL: torch.Tensor,
        loss_mask_BL: torch.Tensor,
        seq_lens_B: torch.Tensor,
        target_hidden_BLF: torch.Tensor,
        *,
        tag: Any = None,
        read_now: bool = False,
    ) -> list[tuple[StepResult, Any]]:
        """Queue a step; return the steps read by this call, oldest first, each with its tag."""
        q = self.trainer.queue_step(input_ids_BL, loss_mask_BL, seq_lens_B, target_hidden_BLF)
        now = self.read_now_result = self.trainer.read_step(q) if read_now else None
        done = self.flush()
        self._pending = (q, tag, now)
        if self.drain(q.step):
            done += self.flush()
        return done

    def flush(self) -> list[tuple[StepResult, Any]]:
        """Read the queued step, if any (when input runs dry, before stopping)."""
        if self._pending is None:
            return []
        q, tag, result = self._pending
        self._pending = None
        return [(result if result is not None else self.trainer.read_step(q), tag)]


@dataclass
class Meter:
    """Accumulates one status interval and renders the metrics.jsonl record (the status line too)."""

    total_steps: int
    started_at: float = field(default_factory=time.time)
    interval_start: float = field(default_factory=time.time)
    steps: int = 0
    tgt_batches: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    acc_sum: float = 0.0
    acc_pos_sum: list[float] = field(default_factory=list)
    acc_pos_n: list[int] = field(default_factory=list)
    last: StepResult | None = None

    def add_target(self, n: int = 1) -> None:
        self.tgt_batches += n

    def add_step(self, r: StepResult) -> None:
        self.steps += 1
        self.tokens += r.tokens
        self.loss_sum += r.loss
        if not math.isnan(r.acc):
            self.acc_sum += r.acc
        if not self.acc_pos_sum:
            self.acc_pos_sum = [0.0] * len(r.acc_per_pos)
            self.acc_pos_n = [0] * len(r.acc_per_pos)
        for i, a in enumerate(r.acc_per_pos):
            if not math.isnan(a):
                self.acc_pos_sum[i] += a
                self.acc_pos_n[i] += 1
        self.last = r

    def record(
        self,
        *,
        step: int,
        q_pre: list[int],
        q_hs: list[int],
        epoch: float,
        compile: dict[str, int],
        gpu_mem_gb: dict[str, float],
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        now = time.time()
        dt = max(1e-6, now - self.interval_start)
        acc_pos = [s / n if n else None for s, n in zip(self.acc_pos_sum, self.acc_pos_n, strict=True)]
        streak = expected_streak([a if a is not None else math.nan for a in acc_pos]) if acc_pos else None
        dft_bps = self.steps / dt
        rec: dict[str, Any] = {
            "t": now,
            "elapsed_s": now - self.started_at,
            "step": step,
            "loss": self.loss_sum / self.steps if self.steps else None,
            "acc": self.acc_sum / self.steps if self.steps else None,
            "acc_per_pos": acc_pos,
            "streak": streak,
            "lr": self.last.lr if self.last else None,
            "noise": self.last.noise if self.last else None,
            "grad_norm": self.last.grad_norm if self.last else None,
            "tgt_bps": self.tgt_batches / dt,
            "dft_bps": dft_bps,
            "tok_s": self.tokens / dt,
            "q_pre": q_pre,
            "q_hs": q_hs,
            "epoch": epoch,
            "eta_s": (self.total_steps - step) / dft_bps if dft_bps > 0 else None,
            "compile": compile,
            "gpu_mem_gb": gpu_mem_gb,
        }
        if extra:
            rec.update(extra)
        self.interval_start = now
        self.steps = self.tgt_batches = self.tokens = 0
        self.loss_sum = self.acc_sum = 0.0
        self.acc_pos_sum, self.acc_pos_n = [], []
        return rec


@dataclass
class CompileTracker:
    """Turns compile activity into events: `compiled` (seconds, hits, misses) for each step that
    compiled, and `cache_miss` when a warm cache was expected (DFLASH_EXPECT_WARM_CACHE=1) but
    inductor compiled cold."""

    run: RunDir
    worker: str
    seen_shapes: set[tuple[int, ...]] = field(default_factory=set)

    def is_new(self, shape: tuple[int, ...]) -> bool:
        return shape not in self.seen_shapes

    def around_step(self, shape: tuple[int, ...], seconds: float, before: dict[str, int]) -> None:
        from dflash.cache.job_side import compiled_event, counters_delta, expect_warm
        from dflash.step.guard import compile_counters

        if shape in self.seen_shapes:
            return
        self.seen_shapes.add(shape)
        delta = counters_delta(before, compile_counters())
        if not any(delta.values()):
            return
        self.run.event("compiled", **compiled_event(seconds, delta, worker=self.worker, shape=list(shape)))
        miss = expect_warm(delta, worker=self.worker, shape=list(shape))
        if miss is not None:
            self.run.event("cache_miss", **miss)


class DrafterSide:
    """A drafter worker's state: the trainer, kernel guard, compile tracking, checkpoints, metrics."""

    def __init__(
        self,
        cfg: JobConfig,
        run: RunDir,
        target_path: str,
        mask_token_id: int,
        device: torch.device,
        *,
        rank: int = 0,
        world_size: int = 1,
        worker: str = "drafter-0",
        mark: Callable[[str], None] = lambda phase: None,
        built: Any = None,
        plan: Any = None,
    ) -> None:
        """mark(phase) is called as each part of the start ends (the `generation_start` event's
        phases: frozen_head_load, model_build). built: what a spare drafter process made ahead
        (dflash.pipeline.spare.Built: the frozen embedding and head and the drafter, on the host or
        already on `device`), used instead of loading and building them again. plan: the job's plan
        (dflash.plan.builder) for `device` where the caller built it; None builds it here."""
        from dflash.plan.builder import build_plan
        from dflash.step.guard import KernelGuard
        from dflash.target import load_frozen_head

        self.cfg, self.run, self.device, self.rank, self.worker = cfg, run, device, rank, worker
        if built is None:
            embed, head, target_config = load_frozen_head(
                target_path, dtype=torch_dtype(cfg.target.dtype), device=device
            )
            mark("frozen_head_load")
            job = plan or build_plan(
                cfg,
                device=device,
                target_config=target_config,
                mask_token_id=mask_token_id,
                target_path=target_path,
            )
            model = None
        else:
            embed, head, model = built.embed, built.head, built.model
            job = plan or build_plan(cfg, device=device, spec=built.spec, target_path=target_path)
        self.job_plan = job
        self.spec = job.spec
        self.plan = job.shapes
        self.trainer = DrafterTrainer(
            cfg,
            self.spec,
            embed,
            head,
            device,
            rank=rank,
            world_size=world_size,
            plan=job,
            model=model,
        )
        mark("model_build")
        self.guard = KernelGuard(self._on_degraded, strict=job.attention.strict)
        self.guard.__enter__()
        self.compiles = CompileTracker(run, worker)
        self.ahead = StepAhead(self.trainer, drain=self.due_checkpoint)
        self.resumed_from: int | None = None
        self.data_state: dict[str, Any] | None = None

    def _on_degraded(self, kind: str, detail: str) -> None:
        self.run.event("degraded", worker=self.worker, kind=kind, detail=detail)

    def load(self, path: Path) -> dict[str, Any]:
        """Weights, optimizer, scheduler and step from a checkpoint; returns its saved state."""
        from dflash.checkpoint import load_checkpoint

        weights, hf_config, state = load_checkpoint(path, map_location=self.device)
        saved = {k: v for k, v in hf_config.items() if k != "torch_dtype"}
        current = self.spec.to_hf_config()
        differ = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
        if differ:
            # Same tensor shapes can still mean another drafter (other target layers, mask token,
            # layer types): resuming would silently train a different model.
            raise DFlashError(
                f"checkpoint {path} is of a different drafter than this config resolves to "
                f"(differs in: {', '.join(differ)}); resume with the config it was trained with, "
                "or start a new --run-dir"
            )
        self.trainer.load_state_dict(state["trainer"], weights)
        self.resumed_from = self.trainer.step
        return state

    def resume(self) -> None:
        """Load the newest complete checkpoint, if any (torn ones are reported and skipped)."""
        from dflash.checkpoint import find_latest, set_rng_state

        found = find_latest(self.run.checkpoints)
        for p in found.torn:
            if self.rank == 0:
                self.run.event(
                    "checkpoint_skipped", path=str(p), reason="incomplete (torn) checkpoint ignored"
                )
        if found.path is None:
            return
        state = self.load(found.path)
        rngs = state.get("rng", {})
        if str(self.rank) in rngs:
            set_rng_state(rngs[str(self.rank)])
        self.data_state = state.get("data", {}).get(str(self.rank))

    def push(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_lens: torch.Tensor,
        hidden: torch.Tensor,
        *,
        tag: Any = None,
    ) -> list[tuple[Any, Any]]:
        """Queue a training step; returns the steps read back by now, oldest first, with their tags
        (dflash.step.trainer.StepAhead: one step stays queued ahead; checkpoint and last steps are read
        by the push that queued them)."""
        from dflash.step.guard import compile_counters

        shape = tuple(input_ids.shape)
        new = self.compiles.is_new(shape)
        before = compile_counters() if new else {}
        done = self.ahead.push(input_ids, loss_mask, seq_lens, hidden, tag=tag, read_now=new)
        if new and self.ahead.read_now_result is not None:  # also when a drain returned it already
            self.compiles.around_step(shape, self.ahead.read_now_result.seconds, before)
        self.guard.check()
        return done

    def flush(self) -> list[tuple[Any, Any]]:
        """Read back the step still queued, if any (input ran dry, or the loop is about to stop)."""
        return self.ahead.flush()

    def due_checkpoint(self, step: int) -> bool:
        return step % self.cfg.train.checkpoint_every == 0 or step == self.cfg.train.total_steps

    def checkpoint(self, data_states: dict[str, Any], rng_states: dict[str, Any]) -> None:
        from dflash.checkpoint import save_checkpoint

        t0 = time.time()
        state = {"trainer": self.trainer.state_dict(), "data": data_states, "rng": rng_states}
        path = save_checkpoint(
            self.run.checkpoints,
            self.trainer.step,
            weights=self.trainer.weights(),
            hf_config=self.spec.to_hf_config(),
            trainer_state=state,
            keep_last=self.cfg.train.keep_last,
        )
        self.run.event(
            "checkpoint", step=self.trainer.step, path=str(path), seconds=round(time.time() - t0, 3)
        )

    def close(self) -> None:
        self.guard.__exit__(None, None, None)
