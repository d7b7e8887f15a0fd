"""Group-wide step metrics: two real gloo ranks (spawned processes) reduce their step results."""

from __future__ import annotations

import math
import multiprocessing
import os
import socket

from dflash.trainer import StepResult


def _result(tokens: int, loss: float, acc: float, acc_per_pos: list[float]) -> StepResult:
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
        block_tokens=0,
        seconds=0.1,
    )


RESULTS = {
    0: _result(1000, 2.0, 0.5, [0.6, math.nan]),
    1: _result(3000, 4.0, 0.7, [0.8, 0.4]),
}


def _rank(rank: int, port: int, out: multiprocessing.Queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from dflash.pipeline.drafter_worker import Group, group_result

    g = Group()
    g.init_process_group("gloo")
    r = group_result(g, RESULTS[rank])
    out.put((rank, r.tokens, r.loss, r.acc, r.acc_per_pos))


def test_group_result_sums_tokens_and_averages_metrics_over_ranks() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((v[0], v[1:]) for v in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert got[0] == got[1], "every rank sees the same group numbers"
    tokens, loss, acc, acc_per_pos = got[0]
    assert tokens == 4000 and loss == 3.0 and math.isclose(acc, 0.6)
    # Position 2 had trained tokens on rank 1 only: its mean is rank 1's, not diluted by rank 0's nan.
    assert math.isclose(acc_per_pos[0], 0.7) and math.isclose(acc_per_pos[1], 0.4)
