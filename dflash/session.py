"""Assembling a job from its config: run directory, data, target, drafter, resume, metrics, events.

The pieces are separate functions because the single-process trainer (dflash.train) uses them all
in one process while the pipeline's target and drafter workers each use their half.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash.errors import DFlashError
from dflash.inputs import locate_data, open_target
from dflash.rundir import RUN_FORMAT, RunDir, format_status_line, unusable_reason

if TYPE_CHECKING:
    from dflash.config import JobConfig

REPO_ROOT = Path(__file__).resolve().parents[1]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def open_run_dir(cfg: JobConfig, run_dir: str | None, argv: list[str]) -> RunDir:
    """The run directory: created with its manifest when new, or when dflashctl made it with a
    stub run.json (no `config` yet); one whose run.json has a config is resumed. Also points inductor and triton at DFLASH_CACHE_DIR, before anything compiles."""
    from dflash.compile_cache import cache_dir_from_env

    cache_dir_from_env()
    given = run_dir is not None
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_dir = str(Path(cfg.run.runs_root) / f"{cfg.run.name}-{stamp}")
    try:
        run = RunDir(run_dir).create()
        run.hold()
        _write_manifest(cfg, run, argv)
    except OSError as e:
        fix = (
            "pass another --run-dir (a directory this user can write; it is created when missing)"
            if given
            else "set run.runs_root to a directory this user can write, or pass --run-dir"
        )
        raise DFlashError(
            f"run directory {run_dir} cannot be used: {unusable_reason(run_dir, e)}; {fix}"
        ) from None
    return run


def _write_manifest(cfg: JobConfig, run: RunDir, argv: list[str]) -> None:
    commands = [{"t": time.time(), "host": socket.gethostname(), "argv": argv}]
    manifest = _existing_manifest(run)
    if "config" in manifest:  # the job wrote it at its first start: a resume
        manifest.setdefault("format", RUN_FORMAT)
        manifest.setdefault("command_lines", []).extend(commands)
    else:  # new, or created by dflashctl (its `runner` fields and any others are kept as they are)
        manifest = {
            "format": RUN_FORMAT,
            "run_id": run.root.name,
            **manifest,
            "config": cfg.to_dict(),
            "started_at": time.time(),
            "project_commit": _git_commit(),
            "hosts": [socket.gethostname()],
            "command_lines": commands,
            "image_digest": os.environ.get("DFLASH_IMAGE_DIGEST"),
            "lock_sha256": os.environ.get("DFLASH_LOCK_SHA256"),
            "cache_artifact": os.environ.get("DFLASH_CACHE_ARTIFACT") or _restored_key(),
        }
    run.write_manifest(manifest)


def _existing_manifest(run: RunDir) -> dict[str, Any]:
    """run.json as found ({} when absent), refused when this job cannot honour its format."""
    if not run.manifest.exists():
        return {}
    try:
        manifest = run.read_manifest()
    except (OSError, ValueError) as e:
        raise DFlashError(
            f"{run.manifest} cannot be read ({e}); fix or remove it, or pass another --run-dir"
        ) from e
    if not isinstance(manifest, dict):
        raise DFlashError(f"{run.manifest} is not a JSON object; fix or remove it, or pass another --run-dir")
    found = manifest.get("format", RUN_FORMAT)
    if found != RUN_FORMAT:
        raise DFlashError(
            f"{run.manifest} has format {found!r} but this job writes format {RUN_FORMAT}: run the job "
            "from the same dflash version as the dflashctl that created the run directory"
        )
    return manifest


def _restored_key() -> str | None:
    from dflash.compile_cache import cache_dir_from_env, restored_artifact

    artifact = restored_artifact(cache_dir_from_env())
    return artifact.get("key") if artifact else None


@dataclass
class DataParts:
    tokenizer: Any
    mask_token_id: int
    dataset: Any
    target_path: str


def training_data_path(cfg: JobConfig, target_path: str, tok: Any, log: Callable[[str], None]) -> str:
    """The JSONL the job trains on: data.path's, or with data.responses its target's responses to
    data.path's prompts (generated here where not made yet: dflash.responses)."""
    data_path = locate_data(cfg)
    if cfg.data.responses:
        from dflash.responses import ensure

        device = "cuda" if cfg.run.device != "cpu" and torch.cuda.is_available() else "cpu"
        data_path = str(ensure(cfg, data_path, target_path, tok, device=device, log=log))
    return data_path


def prepare_data(cfg: JobConfig, run: RunDir) -> DataParts:
    """Tokenizer, mask token and dataset: every data error surfaces here, before any model loads."""
    import dataclasses

    from dflash.data import load_dataset

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
    """The job plan (dflash.plan) with the drafter's sizes, from the target's config alone (no
    weights): what a target worker and the launcher run."""
    from transformers import AutoConfig

    from dflash.plan import build_plan

    return build_plan(
        cfg,
        device=device,
        target_config=AutoConfig.from_pretrained(parts.target_path),
        mask_token_id=parts.mask_token_id,
        target_path=parts.target_path,
    )


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


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


def make_batcher(cfg: JobConfig, dataset: Any, *, plan: Any, rank: int = 0, world_size: int = 1) -> Any:
    """plan: the job's shape plan (dflash.plan.JobPlan.shapes): the rows each bucket fills to."""
    from dflash.data import TokenBudgetBatcher

    return TokenBudgetBatcher(
        dataset,
        plan=plan,
        seed=cfg.run.seed,
        shuffle=cfg.data.shuffle,
        rank=rank,
        world_size=world_size,
    )


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
        from dflash.compile_cache import compiled_event, counters_delta, expect_warm
        from dflash.kernels import compile_counters

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
        (dflash.plan) for `device` where the caller built it; None builds it here."""
        from dflash.kernels import KernelGuard
        from dflash.plan import build_plan
        from dflash.target import load_frozen_head
        from dflash.trainer import DrafterTrainer, StepAhead

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
        (dflash.trainer.StepAhead: one step stays queued ahead; checkpoint and last steps are read
        by the push that queued them)."""
        from dflash.kernels import compile_counters

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


class Job:
    """Single-process job: one target and one drafter in turn (dflash.train)."""

    def __init__(self, cfg: JobConfig, run: RunDir) -> None:
        from dflash.resolve import apply_worker_threads
        from dflash.target import TargetCapture

        self.cfg, self.run = cfg, run
        apply_worker_threads("train")  # the thread count dflash.warm compiled the single-process job under
        torch.manual_seed(cfg.run.seed)
        parts = prepare_data(cfg, run)
        plan = plan_job(cfg, parts)
        self.device = plan.torch_device
        from dflash.placement import preflight

        # One process holds the target and the drafter on one device: the same checks as a pipeline.
        preflight(cfg, [str(self.device)], [str(self.device)], parts.target_path)
        self.drafter = DrafterSide(cfg, run, parts.target_path, parts.mask_token_id, self.device, plan=plan)
        self.trainer = self.drafter.trainer
        self.target = TargetCapture(
            parts.target_path,
            self.drafter.spec.target_layer_ids,
            dtype=torch_dtype(cfg.target.dtype),
            device=self.device,
            compile=self.drafter.plan.target_compile,
        )
        self.batcher = make_batcher(cfg, parts.dataset, plan=self.drafter.plan)
        self.drafter.resume()
        if self.drafter.data_state is not None:
            self.batcher.load_state_dict(self.drafter.data_state)
        self.batches: Iterator[Any] = iter(self.batcher)
        run.event(
            "started",
            mode="single-process",
            device=str(self.device),
            backend=self.trainer.backend,
            resumed_from=self.drafter.resumed_from,
            step=self.trainer.step,
            total_steps=cfg.train.total_steps,
            spec=self.drafter.spec.to_hf_config(),
            data=parts.dataset.summary(),
        )

    def new_meter(self) -> Any:
        from dflash.trainer import Meter

        return Meter(total_steps=self.cfg.train.total_steps)

    def target_forward(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return self.target(ids.to(self.device), lens.to(self.device))

    def emit_metrics(self, meter: Any, *, step: int, q_pre: list[int], q_hs: list[int]) -> dict[str, Any]:
        """The status record; step: the last step read back (one more may be queued already)."""
        from dflash.kernels import compile_counters

        rec = meter.record(
            step=step,
            q_pre=q_pre,
            q_hs=q_hs,
            epoch=self.batcher.epoch_progress,
            compile=compile_counters(),
            gpu_mem_gb=gpu_mem_gb(self.device, "drafter-0"),
        )
        self.run.metric(rec)
        print(format_status_line(rec), flush=True)
        return rec

    def save_checkpoint(self) -> None:
        from dflash.checkpoint import rng_state

        self.drafter.checkpoint({"0": self.batcher.state_dict()}, {"0": rng_state()})


def prepare(cfg: JobConfig, run: RunDir) -> Job:
    return Job(cfg, run)
