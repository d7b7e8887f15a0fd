"""Train a DFlash drafter in one process (target forward and drafter step in turn).

    python -m dflash.train configs/demo-cpu.toml [--set key=value ...] [--run-dir DIR]

The demo config finishes in about two minutes on 2 CPU cores. Started again with the same --run-dir,
a run resumes from its newest complete checkpoint. The multi-process pipeline (target workers and a
restartable drafter group) is `python -m dflash.launch`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dflash.config import JobConfig, add_config_args, load_config
from dflash.errors import DFlashError
from dflash.exiting import without_final_gc
from dflash.rundir import Heartbeat, RunDir, format_status_line

if TYPE_CHECKING:
    import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dflash.train", description=__doc__.split("\n\n")[0])
    add_config_args(p)
    return p.parse_args(argv)


class StopFlag:
    """First SIGTERM/SIGINT: finish the step, checkpoint, exit. Second: exit at once."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from dflash.manifest import open_run_dir

        run = open_run_dir(cfg, args.run_dir, argv=sys.argv)
        return train(cfg, run)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def train(cfg: JobConfig, run: RunDir) -> int:
    from dflash.step.trainer import pad_batch

    stop = StopFlag()
    stop.install()
    job = prepare(cfg, run)  # tokenizer, data, target, drafter: errors before any heavy work
    tgt_hb = Heartbeat(run, "target", 0, rank=None, device=str(job.device)).start()
    dft_hb = Heartbeat(run, "drafter", 0, rank=0, device=str(job.device)).start()
    trainer, batches = job.trainer, job.batches
    meter = job.new_meter()
    last_status = time.time()
    failure: BaseException | None = None

    def finish(done: list[Any]) -> None:
        """Book the steps read back (dflash.step.trainer.StepAhead keeps one queued ahead)."""
        nonlocal last_status
        for i, (result, _) in enumerate(done):
            meter.add_step(result)
            dft_hb.set("computing", progress=True, step=result.step)
            # Status on the last step read back by now: two steps read together (a checkpoint or the
            # last step) would give the second an interval of microseconds and a rate without meaning.
            interval_over = i == len(done) - 1 and time.time() - last_status >= cfg.run.status_interval_s
            if interval_over or result.step == cfg.train.total_steps:
                job.emit_metrics(meter, q_pre=[0], q_hs=[0], step=result.step)
                last_status = time.time()
            if job.drafter.due_checkpoint(result.step):  # read by the push that queued it
                dft_hb.set("checkpointing")
                job.save_checkpoint()

    try:
        while trainer.step < cfg.train.total_steps and not stop.requested:
            tgt_hb.set("computing")
            ids, mask, lens = pad_batch(trainer.plan, next(batches))
            hidden = job.target_forward(ids, lens)
            meter.add_target()
            tgt_hb.set("waiting_output", progress=True)
            dft_hb.set("compiling" if job.drafter.compiles.is_new(tuple(ids.shape)) else "computing")
            finish(job.drafter.push(ids, mask, lens, hidden))
        finish(job.drafter.flush())  # stopped by a signal: the step still queued counts
    except BaseException as e:
        failure = e
        raise
    finally:
        if failure is not None and not isinstance(failure, SystemExit):
            reason = f"failed: {type(failure).__name__}: {failure}"
        else:
            reason = f"signal {stop.signal_name}" if stop.requested else "completed"
        if stop.requested and failure is None and trainer.step > 0:
            dft_hb.set("checkpointing")
            job.save_checkpoint()
        tgt_hb.stop()
        dft_hb.stop()
        run.event("stopped", reason=reason, step=trainer.step)
    print(f"run directory: {run.root}", flush=True)
    return 0


class Job:
    """Single-process job: one target and one drafter in turn (dflash.train)."""

    def __init__(self, cfg: JobConfig, run: RunDir) -> None:
        from dflash.plan.resolve import apply_worker_threads
        from dflash.target import TargetCapture

        self.cfg, self.run = cfg, run
        apply_worker_threads(
            "train"
        )  # the thread count dflash.cache.warm compiled the single-process job under
        # torch, the data and the models load here, not at import: --help and a bad config answer at once.
        import torch

        from dflash.data.prepare import make_batcher, plan_job, prepare_data
        from dflash.plan.resolve import torch_dtype
        from dflash.step.trainer import DrafterSide

        torch.manual_seed(cfg.run.seed)
        parts = prepare_data(cfg, run, measures_tau=False)  # no in-job tau here: all of data.path trains
        plan = plan_job(cfg, parts)
        self.device = plan.torch_device
        from dflash.plan.placement import preflight

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
        from dflash.step.trainer import Meter

        return Meter(total_steps=self.cfg.train.total_steps)

    def target_forward(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        return self.target(ids.to(self.device), lens.to(self.device))

    def emit_metrics(self, meter: Any, *, step: int, q_pre: list[int], q_hs: list[int]) -> dict[str, Any]:
        """The status record; step: the last step read back (one more may be queued already)."""
        from dflash.plan.placement import gpu_mem_gb
        from dflash.step.guard import compile_counters

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


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
