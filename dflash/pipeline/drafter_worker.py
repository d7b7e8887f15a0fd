"""Drafter worker: one process per drafter GPU, launched by torchrun (torch.distributed.elastic).

    torchrun --nproc-per-node D --max-restarts R ... -m dflash.pipeline.drafter_worker CONFIG \
        --run-dir DIR --queue NAME [--set k=v ...]

The D workers of all hosts form one data-parallel group (NCCL on GPU, gloo on CPU). Each leases
hidden-state batches from its host's queue and acks them after the optimizer step. When any worker
dies, torchrun restarts the whole group; the new generation registers with the queue (the dead
generation's leases are delivered again) and resumes from the newest checkpoint. The target
processes are not in this group and keep running.

Every host's local rank 0 writes checkpoints to its own run directory (replicas are identical), so a
restarted group resumes on any host without a shared filesystem: the group agrees on the newest
step that every rank can read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dflash.config import JobConfig, add_config_args, load_config
from dflash.errors import DFlashError
from dflash.exiting import without_final_gc
from dflash.pipeline import DATA_SUMMARY_ENV
from dflash.pipeline.timeline import TIMELINE, last_heartbeat, number
from dflash.plan.resolve import worker_devices
from dflash.rundir import Heartbeat, RunDir, format_status_line

if TYPE_CHECKING:
    from dflash.pipeline.spare import Takeover


class Group:
    """The distributed facts this worker needs, from torchrun's environment."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

    def init_process_group(self, backend: str) -> None:
        """Join the group through a store namespace of this generation. torchrun's agent store outlives
        a restart; without the namespace a restarted rank can read a dead rank's address from the
        previous generation and fail with "Connection refused" (seen with gloo on every restart)."""
        from datetime import timedelta

        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size=self.world,
            is_master=not agent_store and self.rank == 0,
            timeout=timedelta(minutes=10),
        )
        prefixed = dist.PrefixStore(f"dflash/generation-{self.generation}", store)
        dist.init_process_group(
            backend, store=prefixed, rank=self.rank, world_size=self.world, timeout=timedelta(minutes=30)
        )
        # Connect every pair now, while the ranks start in step, not at the first collective.
        dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(
            t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        )
        return t.tolist()


def _target_q_pre(run: RunDir) -> list[int]:
    """q_pre of this host's targets, in index order (host N's are numbered N*T .. N*T+T-1)."""
    out = []
    beats = [p for p in run.workers.glob("target-*.json") if not p.name.endswith(".data.json")]
    for path in sorted(beats, key=lambda p: int(p.stem.split("-")[1])):
        try:
            out.append(int(json.loads(path.read_text()).get("q_pre", 0)))
        except (OSError, ValueError):
            out.append(0)
    return out


def group_result(g: Group, r: Any) -> Any:
    """The step as the whole group took it: tokens summed over ranks, loss and accuracies averaged
    (over the ranks that had trained positions). Rank 0's metrics then speak for the group, and
    tok_s is the job's throughput, not one rank's share."""
    if g.world == 1:
        return r
    trained = r.block_tokens > 0  # a rank with no trained positions has no loss to average in
    accs = [r.acc, *r.acc_per_pos]
    vals = [float(r.tokens), r.loss if trained else 0.0, float(trained)]
    vals += [0.0 if math.isnan(a) else a for a in accs] + [0.0 if math.isnan(a) else 1.0 for a in accs]
    tot = g.all_reduce(vals, "sum")
    n = len(accs)
    means = [s / c if c else math.nan for s, c in zip(tot[3 : 3 + n], tot[3 + n :], strict=True)]
    loss = tot[1] / tot[2] if tot[2] else math.nan
    return dataclasses.replace(r, tokens=int(tot[0]), loss=loss, acc=means[0], acc_per_pos=means[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.pipeline.drafter_worker")
    add_config_args(p, run_dir="the job's run directory", run_dir_required=True)
    p.add_argument("--queue", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    return run_drafter(cfg, RunDir(args.run_dir), args.queue)


def _device(cfg: JobConfig, g: Group) -> torch.device:
    _, drafters = worker_devices(cfg)
    return torch.device(drafters[g.local_rank % len(drafters)])


def _resume_step(side: Any, g: Group) -> int:
    """The newest checkpoint step every rank can read (-1: start fresh)."""
    from dflash.checkpoint import find_latest

    found = find_latest(side.run.checkpoints)
    local = int(found.path.name.split("-")[1]) if found.path else -1
    return int(g.all_reduce([float(local)], "min")[0])


def _common_copy_step(g: Group, mine: set[int]) -> int:
    """The newest state-copy step that every rank of the group can restore (-1: none): rank 0's two
    newest, kept where every rank has it."""
    top = [*sorted(mine, reverse=True)[:2], -1, -1][:2]
    cands = g.all_reduce([float(x) if g.rank == 0 else -1.0 for x in top], "max")
    has = g.all_reduce([1.0 if int(c) in mine else 0.0 for c in cands], "min")
    return max((int(c) for c, h in zip(cands, has, strict=True) if h > 0 and c >= 0), default=-1)


def _resume(
    side: Any, g: Group, run: RunDir, copies: Path, every: int, worker: str
) -> tuple[int, str | None]:
    """Load the newest state every rank can resume from: a complete state copy newer than the newest
    checkpoint, else that checkpoint, else nothing. Returns (step, "copy" | "checkpoint" | None).
    Copies of another trajectory (older than the checkpoint resumed from, or unreadable) are
    discarded: they must never be resumed from later."""
    from dflash.pipeline.state_copy import complete_steps, discard_copies, load_copy, torn_slots

    checkpoint = _resume_step(side, g)
    if every:
        for begin, end in torn_slots(copies) if g.local_rank == 0 else []:
            run.event(
                "state_copy_skipped",
                worker=worker,
                step=begin,
                reason=f"torn copy (its writer died mid-copy: begin {begin}, end {end}) ignored",
            )
        copy_step = _common_copy_step(g, complete_steps(copies, g.rank))
        if copy_step > checkpoint:
            ok = float(load_copy(side.trainer, copies, g.rank, copy_step))
            if g.all_reduce([ok], "min")[0] > 0:
                side.resumed_from = copy_step
                return copy_step, "copy"
            if g.rank == 0:
                run.event(
                    "state_copy_skipped",
                    worker=worker,
                    step=copy_step,
                    reason="a rank could not read the copy; resuming from the checkpoint",
                )
            if checkpoint < 0 and g.all_reduce([ok], "max")[0] > 0:
                # some ranks hold the copy's state, the others a fresh one: no common start
                discard_copies(copies, g.rank, tensors=g.local_rank == 0)
                raise DFlashError(
                    "the drafter state copy was readable on some ranks only and there is no "
                    "checkpoint; the copies are discarded and the group starts again"
                )
        if g.world > 1:
            dist.barrier()
        discard_copies(copies, g.rank, tensors=g.local_rank == 0)
    if checkpoint >= 0:
        side.load(run.checkpoints / f"step-{checkpoint}")
        return checkpoint, "checkpoint"
    return -1, None


def _previous_generation(run: RunDir, g: Group) -> tuple[float | None, int | None]:
    """(when the dead generation died, its last booked step): the earliest last heartbeat of its
    ranks (the one that died stopped writing first; torchrun stopped the others after it), read
    before this generation rewrites them."""
    beat = last_heartbeat(run.heartbeat_path("drafter", g.rank)) if g.generation > 0 else {}
    at, step = number(beat.get("updated_at")), number(beat.get("step"))
    died, died_step = g.all_reduce(
        [at if at is not None else math.inf, step if step is not None else -1], "min"
    )
    return (died if math.isfinite(died) else None), (int(died_step) if died_step >= 0 else None)


def _redirect_output(path: Any) -> None:
    """The contract's per-worker log: this process's stdout and stderr append to logs/<role>-<index>.log."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_drafter(cfg: JobConfig, run: RunDir, queue_name: str, spare: Takeover | None = None) -> int:
    """Train this rank until the last step or a stop. spare: a spare drafter process that took the
    rank over (dflash.pipeline.spare): its imports, CUDA context and built drafter are used, its
    timeline starts at the torchrun worker it serves."""
    from dflash.cache.job_side import cache_dir_from_env
    from dflash.data.inputs import open_target
    from dflash.pipeline.state_copy import StateCopier, copy_dir
    from dflash.pipeline.transport import HiddenStateQueue
    from dflash.plan.placement import alloc_retries, gpu_mem_gb
    from dflash.plan.resolve import apply_worker_threads
    from dflash.step.guard import compile_counters
    from dflash.step.trainer import DrafterSide, Meter, ddp_backend

    tl = TIMELINE if spare is None else spare.timeline
    g = Group()
    if spare is None:
        tl.mark("imports")
        cache_dir_from_env()  # before anything compiles
        apply_worker_threads(
            "drafter"
        )  # the thread count dflash.cache.warm compiled the pipeline drafter under
    device = _device(cfg, g)
    if spare is None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.zeros(1, device=device)  # the context now, not inside a later phase
        tl.mark("cuda_init")
    elif device != spare.built.device:
        raise DFlashError(
            f"the spare drafter was built on {spare.built.device}, this rank trains on {device}"
        )
    if g.world > 1:
        # The control collectives (stop agreement, resume step) use CPU tensors: gloo carries them.
        g.init_process_group(ddp_backend(device))
    tl.mark("rendezvous")
    worker = f"drafter-{g.rank}"
    _redirect_output(run.log_path("drafter", g.rank))
    died_at, died_at_step = _previous_generation(run, g)
    tl.before_process(died_at)
    hb = Heartbeat(run, "drafter", g.rank, rank=g.rank, device=str(device)).start()
    stop = threading.Event()
    stepped = False
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    copier: StateCopier | None = None
    every = cfg.pipeline.state_copy_every
    copies = copy_dir(queue_name)
    try:
        # The drafters need the target's head and the mask token, not the data: the targets read that.
        if spare is None:
            target_path, _, mask_id = open_target(cfg)
            tl.mark("target_config")
        else:
            target_path, mask_id = spare.built.target_path, spare.built.mask_id
        if spare is not None and spare.built.side is not None:
            side = spare.built.side  # built and its graphs loaded on this device (a one-rank group)
            side.run = run
        else:
            side = DrafterSide(
                cfg,
                run,
                target_path,
                mask_id,
                device,
                rank=g.rank,
                world_size=g.world,
                worker=worker,
                mark=tl.mark,
                built=None if spare is None else spare.built,
            )
        trainer = side.trainer
        step, kind = _resume(side, g, run, copies, every, worker)
        if every:
            copier = StateCopier(
                trainer,
                copies,
                rank=g.rank,
                writes_tensors=g.local_rank == 0,
                every=every,
                on_event=run.event,
            )
            trainer.state_copy = copier
        tl.mark("state_restore")
        hs = HiddenStateQueue.attach(queue_name)
        reclaimed = hs.register_consumer(g.generation)
        tl.mark("lease_reclaim")
        if g.rank == 0:
            run.event(
                "restart" if g.generation > 0 else "started",
                role="drafter-group",
                generation=g.generation,
                world_size=g.world,
                resumed_from=step if step >= 0 else None,
                resumed_from_kind=kind,
                reclaimed_batches=reclaimed,
                backend=trainer.backend,
                data=json.loads(os.environ.get(DATA_SUMMARY_ENV) or "null"),
            )
        meter = Meter(total_steps=cfg.train.total_steps)
        last_status, last_produced = time.time(), hs.stats()["produced"]
        writes_checkpoints = g.local_rank == 0
        total = cfg.train.total_steps
        log_batches = os.environ.get("DFLASH_LOG_BATCHES") == "1"
        lease, stopped = None, False
        first_shape: dict[str, float] = {}
        held: list[tuple[int, Any]] = []
        """Leases of steps read back that no state copy or checkpoint holds yet: acked once one does
        (a death before then delivers them again, to the step the new generation resumes after)."""
        covered = max(step, 0)

        def ack_covered(upto: int | None = None) -> None:
            nonlocal covered, held
            if upto is not None:
                covered = max(covered, upto)
            if copier is not None:
                covered = max(covered, copier.committed())
            keep = []
            for s, held_lease in held:
                if copier is None or s <= covered:
                    hs.ack(held_lease)
                else:
                    keep.append((s, held_lease))
            held = keep

        def on_wait() -> None:
            hb.set("waiting_input")
            ack_covered()

        def emit_timeline(first_step: int) -> None:
            resumed = step if step >= 0 else None
            run.event(
                "generation_start",
                role="drafter-group",
                worker=worker,
                generation=g.generation,
                restart=g.generation > 0,
                **tl.fields(),
                graphs=first_shape,
                first_step=first_step,
                resumed_from=resumed,
                resumed_from_kind=kind,
                died_at_step=died_at_step,
                rolled_back_steps=None if died_at_step is None else max(0, died_at_step - max(step, 0)),
                spare=None if spare is None else spare.built.mode,
                spare_pid=None if spare is None else os.getpid(),
            )

        def finish(done: list[tuple[Any, Any]]) -> None:
            """Book the steps read back, oldest first (dflash.step.trainer.StepAhead keeps one queued
            ahead; the push that queues a checkpoint step reads it). Their batches are acked only
            once a state copy or checkpoint holds their step (at once without copies): a batch
            whose step is lost to a death is redelivered."""
            nonlocal last_status, last_produced
            for i, (result, done_lease) in enumerate(done):
                held.append((result.step, done_lease))
                if log_batches:
                    run.event(
                        "batch",
                        worker=worker,
                        step=result.step,
                        generation=g.generation,
                        target=done_lease.meta.get("target"),
                        batch=done_lease.meta.get("batch"),
                        seq=done_lease.seq,
                        deliveries=done_lease.deliveries,
                    )
                meter.add_step(group_result(g, result))
                hb.set("computing", progress=True, step=result.step)
                # Status on the last step read back by now (two read together would give the second
                # an interval of microseconds and a rate without meaning), and on the last step.
                interval_over = i == len(done) - 1 and time.time() - last_status >= cfg.run.status_interval_s
                due = interval_over or result.step == total
                if due and g.local_rank == 0:
                    stats = hs.stats()
                    meter.add_target(stats["produced"] - last_produced)
                    last_produced = stats["produced"]
                    rec = meter.record(
                        step=result.step,
                        q_pre=_target_q_pre(run),
                        q_hs=[hs.depth()],
                        epoch=float(done_lease.meta.get("epoch", 0.0)),
                        compile=compile_counters(),
                        gpu_mem_gb=gpu_mem_gb(device, worker),
                        extra={
                            "world_size": g.world,
                            "generation": g.generation,
                            "queue": {k: stats[k] for k in ("produced", "delivered", "acked", "redelivered")},
                        },
                    )
                    run.metric(rec)
                    hb.set(**alloc_retries(device))
                    print(format_status_line(rec), flush=True)
                    last_status = time.time()
                if side.due_checkpoint(result.step):
                    hb.set("checkpointing")
                    if writes_checkpoints:
                        side.checkpoint({}, {})
                    if g.world > 1:
                        dist.barrier()
                    ack_covered(result.step)
            ack_covered()

        while trainer.step < total:
            # Ranks step together or not at all: each first holds a batch (or times out waiting), then
            # all agree whether to stop and whether everyone has a batch. A rank that broke out alone
            # would leave the others hanging in DDP's gradient all-reduce.
            if lease is None:
                hb.set("waiting_input")
                lease = hs.get(device=device, timeout=0.5, on_wait=on_wait)
            stop_any, missing_any = g.all_reduce([float(stop.is_set()), float(lease is None)], "max")
            if stop_any > 0:
                stopped = True  # a held lease is handed back by the queue once this process is gone
                break
            if missing_any > 0 or lease is None:
                finish(side.flush())  # input ran dry: the queued step is read now, not left waiting
                continue
            t = lease.tensors
            shape = tuple(t["input_ids"].shape)
            new_shape = side.compiles.is_new(shape)
            if not stepped:
                tl.mark("first_batch")
            hb.set("compiling" if new_shape else "computing")
            finish(side.push(t["input_ids"], t["loss_mask"], t["seq_lens"], t["hidden"], tag=lease))
            first = side.ahead.read_now_result
            if not stepped and first is not None:
                # The first step of a new shape is read at once, so it has trained by now: its
                # seconds are the graphs' load (or compile) and one step.
                first_shape["x".join(map(str, shape))] = round(first.seconds, 3)
                tl.mark("first_step")
                if g.rank == 0:
                    emit_timeline(first.step)
            stepped = True
            lease = None
        finish(side.flush())  # stopping: the queued step completes and is booked before the checkpoint
        if stopped and writes_checkpoints and trainer.step > 0:
            hb.set("checkpointing")
            side.checkpoint({}, {})
            ack_covered(trainer.step)
        if copier is not None:
            copier.close()
            ack_covered()
        if g.rank == 0:
            stats = hs.stats()
            run.event(
                "drafters_done",
                step=trainer.step,
                stopped_by_signal=stopped,
                queue={k: stats[k] for k in ("produced", "delivered", "acked", "redelivered")},
            )
        hs.close()
        side.close()
        return 0
    except Exception as e:
        # before_first_step: the supervisor stops a group that fails the same way twice in a row
        # before any step (a deterministic error) instead of spending every restart on it.
        run.event(
            "worker_error",
            worker=worker,
            generation=g.generation,
            before_first_step=not stepped,
            error=f"{type(e).__name__}: {e}",
        )
        print(f"{worker}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        hb.stop()
        if g.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
