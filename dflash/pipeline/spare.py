"""A spare drafter process: started ahead by the launcher, one per local drafter rank, it does before
any death what a new drafter generation would do after one, then waits to take a rank over.

    python -m dflash.pipeline.spare CONFIG --run-dir DIR --queue NAME --local-rank N --mode host|graphs

Ahead (the `spare_ready` event says how long it took): the imports (torch is most of them), the
compile cache and thread settings, the CUDA context on its rank's device, the target's config and
mask token, the frozen embedding and head read from the safetensors files, and the drafter built
with its initial weights. Mode host keeps those on the host (a CUDA context is all it holds on the
GPU); mode graphs moves them to the device, builds the trainer, and runs one training step per
planned shape on synthetic batches so that its compiled graphs are loaded (then restores the
initial weights, optimizer, scheduler and RNG states, and empties the allocator cache). Graphs
need a second step's peak memory on the device and a one-rank group (a larger group compiles
under DDP); dflash.plan.spares.spare_plan decides.

Then it listens on a Unix socket (dflash.pipeline.drafter_entry.spare_socket). A torchrun worker of
a new generation connects with its command line and environment; the spare checks that they are
its own job's (config, overrides, run directory, queue) and its device's, answers with its pid,
writes `spare_takeover`, and trains the rank (dflash.pipeline.drafter_worker.run_drafter) from the
torchrun worker's start: the generation's timeline continues with `handover`. When the training
ends it sends its exit code; when the torchrun worker dies first, it exits at once (never a second
trainer of one rank). Before a takeover it exits when the supervisor is gone.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.config import JobConfig, add_config_args, load_config
from dflash.errors import DFlashError
from dflash.exiting import without_final_gc
from dflash.pipeline.drafter_entry import receive, send, spare_socket
from dflash.pipeline.timeline import Timeline
from dflash.plan.resolve import worker_devices
from dflash.rundir import SUPERVISOR_ENV, RunDir, supervisor_alive


@dataclass
class Built:
    """What a spare made ahead (dflash.step.trainer.DrafterSide takes it as `built`)."""

    mode: str
    device: torch.device
    target_path: str
    mask_id: int
    spec: Any
    embed: torch.Tensor
    head: torch.Tensor
    model: Any
    side: Any = None
    """Mode graphs: the whole drafter side, on the device, its graphs loaded (a one-rank group)."""


@dataclass
class Takeover:
    """A spare training a rank: what it built, and the generation's timeline from the torchrun
    worker's start."""

    built: Built
    timeline: Timeline


def build(cfg: JobConfig, run: RunDir, device: torch.device, mode: str) -> Built:
    from dflash.data.inputs import open_target
    from dflash.plan.builder import build_plan
    from dflash.plan.resolve import torch_dtype
    from dflash.step.trainer import DrafterSide, build_drafter
    from dflash.target import load_frozen_head

    target_path, _, mask_id = open_target(cfg)
    embed, head, target_config = load_frozen_head(
        target_path, dtype=torch_dtype(cfg.target.dtype), device="cpu"
    )
    if device.type == "cuda":  # page-locked: the move at the takeover runs at the link's speed
        embed = embed.pin_memory()
        head = embed if head.data_ptr() == embed.data_ptr() else head.pin_memory()
    plan = build_plan(
        cfg, device=device, target_config=target_config, mask_token_id=mask_id, target_path=target_path
    )
    model = build_drafter(cfg, plan.spec, embed, head, plan)
    built = Built(mode, device, target_path, mask_id, plan.spec, embed, head, model)
    if mode == "graphs":
        built.side = DrafterSide(cfg, run, target_path, mask_id, device, built=built, plan=plan)
        load_graphs(cfg, built.side)
        built.embed = built.head = built.model = None  # on the device, inside the side
    return built


def load_graphs(cfg: JobConfig, side: Any) -> None:
    """One training step per planned shape on synthetic batches, so the compiled graphs of each are
    loaded (from the compile cache, or compiled), then the trainer put back to its initial state:
    weights, optimizer (no moments), scheduler, step, anchor generator, torch's RNGs."""
    from dflash.cache.warm import synthetic_step_inputs

    trainer = side.trainer
    weights = {k: v.detach().clone() for k, v in trainer.weights().items()}
    state = copy.deepcopy(trainer.state_dict())
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(side.device) if side.device.type == "cuda" else None
    for shape in side.plan.shapes:
        inputs = synthetic_step_inputs(cfg, side.spec, shape.rows, shape.length, side.device)
        trainer.train_step(*inputs)
        side.compiles.is_new(tuple(inputs[0].shape))  # its graphs are loaded: not compiled again
        del inputs
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.load_state_dict(state, weights)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, side.device)
        torch.cuda.synchronize(side.device)
        torch.cuda.empty_cache()


def _worker_args(argv: list[str]) -> tuple[str, list[str], str, str]:
    """(config, overrides, run dir, queue) of a drafter worker's command line."""
    p = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_config_args(p, run_dir="", run_dir_required=True)
    p.add_argument("--queue", required=True)
    try:
        a, _ = p.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as e:
        raise DFlashError(f"not a drafter worker's command line: {argv}") from e
    return str(Path(a.config).resolve()), list(a.overrides), str(Path(a.run_dir).resolve()), a.queue


def refusal(cfg: JobConfig, mine: list[str], request: dict[str, Any], built: Built) -> str | None:
    """Why this spare cannot train the requested rank (None: it can)."""
    try:
        if _worker_args(list(request.get("argv") or [])) != _worker_args(mine):
            return "another job's command line"
    except DFlashError as e:
        return str(e)
    env = request.get("env") or {}
    _, drafters = worker_devices(cfg)
    local = int(env.get("LOCAL_RANK", 0))
    if torch.device(drafters[local % len(drafters)]) != built.device:
        return (
            f"local rank {local} trains on {drafters[local % len(drafters)]}, this spare is on {built.device}"
        )
    if built.side is not None and int(env.get("WORLD_SIZE", 1)) > 1:
        return "its graphs are a one-rank group's; this group has several ranks"
    return None


def serve(
    path: Path, cfg: JobConfig, mine: list[str], built: Built
) -> tuple[socket.socket, dict[str, Any]] | None:
    """Wait for a takeover request this spare can serve; None when the supervisor is gone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    srv.settimeout(1.0)
    token = os.environ.get(SUPERVISOR_ENV)
    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                if token and not supervisor_alive(token):
                    return None
                continue
            conn.settimeout(5.0)
            try:
                request = receive(conn.makefile("rb"))
            except (OSError, ValueError):
                conn.close()
                continue
            if request is None:
                conn.close()
                continue
            problem = refusal(cfg, mine, request, built)
            if problem is not None:
                send(conn, {"ok": False, "reason": problem})
                conn.close()
                continue
            send(conn, {"ok": True, "pid": os.getpid()})
            conn.settimeout(None)
            return conn, request
    finally:
        srv.close()
        path.unlink(missing_ok=True)


def _exit_with_worker(conn: socket.socket) -> None:
    """The torchrun worker this spare serves closed its end (it died, or torchrun stopped it): so
    does this process, at once, whatever it is doing."""
    try:
        while conn.recv(4096):
            pass
    except OSError:
        pass
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    from dflash.cache.job_side import cache_dir_from_env
    from dflash.pipeline.drafter_worker import run_drafter
    from dflash.plan.resolve import apply_worker_threads

    p = argparse.ArgumentParser(prog="python -m dflash.pipeline.spare")
    add_config_args(p, run_dir="the job's run directory", run_dir_required=True)
    p.add_argument("--queue", required=True)
    p.add_argument("--local-rank", type=int, required=True)
    p.add_argument("--mode", choices=("host", "graphs"), required=True)
    p.add_argument("--socket-dir", required=True)
    args = p.parse_args(argv)
    raw = sys.argv[1:] if argv is None else argv
    cfg = load_config(args.config, args.overrides)
    run = RunDir(args.run_dir)
    t0 = time.time()
    cache_dir_from_env()
    apply_worker_threads("drafter")  # as the drafter worker: the graphs are keyed on it on the CPU
    _, drafters = worker_devices(cfg)
    device = torch.device(drafters[args.local_rank % len(drafters)])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)
    built = build(cfg, run, device, args.mode)
    gpu = torch.cuda.memory_reserved(device) if device.type == "cuda" else None
    worker = f"spare-{args.local_rank}"
    run.event(
        "spare_ready",
        worker=worker,
        local_rank=args.local_rank,
        pid=os.getpid(),
        mode=args.mode,
        device=str(device),
        seconds=round(time.time() - t0, 3),
        gpu_reserved_bytes=gpu,
    )
    print(f"{worker}: ready ({args.mode}) in {time.time() - t0:.1f} s", flush=True)
    served = serve(spare_socket(Path(args.socket_dir), args.local_rank), cfg, raw, built)
    if served is None:
        print(f"{worker}: the supervisor is gone; exiting", flush=True)
        return 0
    conn, request = served
    tl = Timeline(started=request.get("started"))
    tl.mark("handover")
    os.environ.update({k: str(v) for k, v in (request.get("env") or {}).items()})
    run.event(
        "spare_takeover",
        worker=worker,
        local_rank=args.local_rank,
        pid=os.getpid(),
        mode=args.mode,
        rank=int(os.environ.get("RANK", 0)),
        generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        torchrun_worker_pid=request.get("pid"),
    )
    threading.Thread(target=_exit_with_worker, args=(conn,), name="spare-worker-watch", daemon=True).start()
    try:
        code = run_drafter(cfg, run, args.queue, Takeover(built, tl))
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        send(conn, {"exit": code})
    except OSError:
        pass
    return code


if __name__ == "__main__":
    with without_final_gc():
        raise SystemExit(main())
