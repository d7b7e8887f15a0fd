"""Group-wide step metrics: two real gloo ranks (spawned processes) reduce their step results."""

from __future__ import annotations

import math
import multiprocessing
import os
import socket

from dflash.step.trainer import StepResult


def _result(
    tokens: int, loss: float, acc: float, acc_per_pos: list[float], block_tokens: int = 64
) -> StepResult:
    return StepResult(
        step=1,
        loss=loss,
        acc=acc,
        acc_per_pos=acc_per_pos,
        streak=0.0,
        lr=1e-4,
        noise=0.0,
        grad_norm=1.0,
        tokens=tokens,
        block_tokens=block_tokens,
        seconds=0.1,
    )


RESULTS = {
    0: _result(1000, 2.0, 0.5, [0.6, math.nan]),
    1: _result(3000, 4.0, 0.7, [0.8, 0.4]),
}
# A step where rank 0's batch had no trained positions (loss 0 by construction, accuracy nan).
EMPTY_ON_0 = {
    0: _result(500, 0.0, math.nan, [math.nan, math.nan], block_tokens=0),
    1: _result(700, 3.0, 0.25, [0.5, 0.0]),
}


def _rank(rank: int, port: int, out: multiprocessing.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from dflash.pipeline.drafter_worker import Group, group_result

    g = Group()
    g.init_process_group("gloo")
    r = group_result(g, RESULTS[rank])
    e = group_result(g, EMPTY_ON_0[rank])
    out.put((rank, r.tokens, r.loss, r.acc, r.acc_per_pos, e.tokens, e.loss, e.acc))
    # Leave the group together, as the worker does: a rank that exits with gloo's threads still
    # connected (or rank 0 taking the store down under the other) aborts at interpreter exit.
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_group_result_sums_tokens_and_averages_metrics_over_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = dict((v[0], v[1:]) for v in (out.get(timeout=120) for _ in procs))
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:  # a rank that failed leaves the other blocked in a collective: never wait on it
        for p in procs:
            if p.is_alive():
                p.kill()
    assert got[0] == got[1], "every rank sees the same group numbers"
    tokens, loss, acc, acc_per_pos, e_tokens, e_loss, e_acc = got[0]
    assert tokens == 4000 and loss == 3.0 and math.isclose(acc, 0.6)
    assert e_tokens == 1200 and e_loss == 3.0 and e_acc == 0.25, (
        "a rank with nothing trained is not averaged in"
    )
    # Position 2 had trained tokens on rank 1 only: its mean is rank 1's, not diluted by rank 0's nan.
    assert math.isclose(acc_per_pos[0], 0.7) and math.isclose(acc_per_pos[1], 0.4)
