"""Target worker: one process per target (GPU or CPU).

    python -m dflash.pipeline.target_worker --run-dir DIR --index I --queue NAME CONFIG [--set k=v ...]

A prefetch thread turns the worker's data shard into padded CPU batches (q_pre = its depth; no
compiled work ever runs in that thread); the main thread runs the frozen forward, captures the k
layers and publishes them to the hidden-state queue, blocking (state waiting_output) while it is full.
The worker's data position is persisted after every published batch, so a relaunched job continues
its shard where it stopped. The process keeps its weights across drafter-group restarts.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from dflash.config import JobConfig, add_config_args, load_config
from dflash.exiting import without_final_gc
from dflash.pipeline.timeline import GENERATION_ENV, TIMELINE, last_heartbeat, number
from dflash.rundir import Heartbeat, RunDir, atomic_write_json
from dflash.step.trainer import pad_batch


def data_state_path(run: RunDir, index: int) -> Path:
    return run.workers / f"target-{index}.data.json"


class Prefetcher:
    """Fills a bounded queue of padded CPU batches from this target's data shard."""

    def __init__(self, cfg: JobConfig, batcher: Any, depth: int, stop: threading.Event) -> None:
        self.cfg, self.batcher, self.stop = cfg, batcher, stop
        self.q: queue.Queue[tuple[dict[str, torch.Tensor], dict[str, Any]]] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    def _run(self) -> None:
        try:
            for batch in self.batcher:
                ids, mask, lens = pad_batch(self.batcher.shapes, batch)
                item = (
                    {"input_ids": ids, "loss_mask": mask, "seq_lens": lens},
                    {
                        "data_state": self.batcher.state_dict(),
                        "tokens": int(batch.num_tokens),
                        "epoch": float(self.batcher.epoch_progress),
                    },
                )
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # surfaced by the main thread
            self.error = e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash.pipeline.target_worker")
    add_config_args(p, run_dir="the job's run directory", run_dir_required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--device", default=None)
    p.add_argument(
        "--data-world", type=int, default=0, help="target workers on all hosts (default: pipeline.targets)"
    )
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    run = RunDir(args.run_dir)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return run_target(
        cfg, run, args.index, args.queue, args.device or "cpu", stop, args.data_world or cfg.pipeline.targets
    )


def run_target(
    cfg: JobConfig,
    run: RunDir,
    index: int,
    queue_name: str,
    device_name: str,
    stop: threading.Event,
    data_world: int,
) -> int:
    """data_world: target workers over all hosts; worker `index` reads shard `index` of data_world."""
    import json

    from dflash.data.prepare import make_batcher, plan_job, prepare_data
    from dflash.pipeline.transport import HiddenStateQueue
    from dflash.plan.placement import alloc_retries
    from dflash.plan.resolve import apply_worker_threads, torch_dtype
    from dflash.target import TargetCapture

    tl = TIMELINE
    tl.mark("imports")
    apply_worker_threads("target")  # the thread count dflash.cache.warm compiled the target under
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # the context now, not inside a later phase
    tl.mark("cuda_init")
    generation = int(os.environ.get(GENERATION_ENV) or 0)
    # A restart's origin is the death: the dead process's last heartbeat, read before it is rewritten.
    tl.before_process(
        number(last_heartbeat(run.heartbeat_path("target", index)).get("updated_at")) if generation else None
    )
    hb = Heartbeat(run, "target", index, device=str(device)).start()
    first = True
    try:
        parts = prepare_data(cfg, run)
        job = plan_job(cfg, parts, device)
        batcher = make_batcher(cfg, parts.dataset, plan=job.shapes, rank=index, world_size=data_world)
        state_path = data_state_path(run, index)
        if state_path.exists():
            batcher.load_state_dict(json.loads(state_path.read_text()))
        tl.mark("data")
        hb.set("computing", note="loading target")
        from dflash.plan.shapes import apply_recompile_limit

        if job.target_compile:
            apply_recompile_limit(job.shapes)
        target = TargetCapture(
            parts.target_path,
            job.spec.target_layer_ids,
            dtype=torch_dtype(cfg.target.dtype),
            device=device,
            compile=job.target_compile,
        )
        tl.mark("model_load")
        hs = HiddenStateQueue.attach(queue_name)
        pre = Prefetcher(cfg, batcher, cfg.pipeline.prefetch_depth, stop)
        pre.thread.start()
        tl.mark("queue_attach")
        run.event(
            "worker_ready",
            worker=f"target-{index}",
            device=str(device),
            layers=job.spec.target_layer_ids,
            data=parts.dataset.summary(),
        )
        produced = 0
        while not stop.is_set():
            depth = pre.q.qsize()
            hb.set("waiting_input" if depth == 0 else None, q_pre=depth)  # the prefetcher is behind
            try:
                tensors, meta = pre.q.get(timeout=0.5)
            except queue.Empty:
                if pre.error is not None:
                    raise pre.error from None
                hb.set("waiting_input")
                continue
            if first:
                tl.mark("first_batch")
            hb.set("computing")
            hidden = target(tensors["input_ids"].to(device), tensors["seq_lens"].to(device))
            if first:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                tl.mark("first_forward")
            meta = {**meta, "target": index, "batch": produced}
            hb.set(q_pre=pre.q.qsize())
            # waiting_output only while the queue is full: the copy into the slot waits for the
            # forward on the device, which is computing (the heartbeat's state_s splits the two).
            ok = hs.put(
                {**tensors, "hidden": hidden},
                meta,
                stop=stop,
                on_wait=lambda: hb.set("waiting_output", q_pre=pre.q.qsize()),
                on_reserved=lambda: hb.set("computing"),
            )
            if not ok:
                break
            if first:
                first = False
                tl.mark("first_publish")
                run.event(
                    "generation_start",
                    role="target",
                    worker=f"target-{index}",
                    generation=generation,
                    restart=generation > 0,
                    **tl.fields(),
                )
            produced += 1
            atomic_write_json(state_path, meta["data_state"])
            hb.set("computing", progress=True, step=produced, **alloc_retries(device))
        hs.close()
        return 0
    except Exception as e:
        run.event("worker_error", worker=f"target-{index}", error=f"{type(e).__name__}: {e}")
        print(f"target-{index}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        hb.stop()


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
