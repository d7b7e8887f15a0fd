"""The spare drafters' mode and cost (dflash.plan.spares.spare_plan), decided before any worker starts,
and the takeover handshake between torchrun's worker and a spare (dflash.pipeline.drafter_entry,
dflash.pipeline.spare) over a real Unix socket."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from dflash.config import load_config
from dflash.errors import ConfigError
from dflash.pipeline.drafter_entry import hand_to_spare, send, spare_socket
from dflash.pipeline.spare import Built, refusal, serve
from dflash.plan.placement import GIB
from dflash.plan.spares import SPARE_CONTEXT_BYTES, spare_plan

REPO = Path(__file__).resolve().parents[2]
EIGHT_B = str(REPO / "configs" / "qwen3-8b.toml")
DEMO = str(REPO / "configs" / "demo-cpu.toml")
H200 = int(139.8 * GIB)


def _cfg(path: str, *sets: str):
    return load_config(path, ["target.path=tiny", "data.path=demo", *sets])


def _record(drafter_gib: float, target_gib: float | None = 16.0) -> dict:
    rec = {"drafter": {"12x4096": {"peak_reserved": int(drafter_gib * GIB)}}, "target": {}}
    if target_gib is not None:
        rec["target"]["12x4096"] = {"peak_reserved": int(target_gib * GIB)}
    return rec


def _plan(cfg, targets, drafters, record=None, mem=64 * GIB, host=4 * GIB):
    return spare_plan(
        cfg, targets, drafters, host_bytes=host, mem_available=mem, totals={0: H200, 1: H200}, record=record
    )


def test_off_is_off_and_the_cpu_demo_loads_its_graphs_ahead() -> None:
    assert _plan(_cfg(DEMO, "pipeline.spare_drafters=off"), ["cpu"], ["cpu"]).mode == "off"
    plan = _plan(_cfg(DEMO), ["cpu"], ["cpu"])
    assert (plan.mode, plan.gpu_bytes, plan.host_bytes) == ("graphs", 0, 4 * GIB)


def test_a_group_of_several_ranks_gets_host_spares_and_refuses_graphs() -> None:
    cfg = _cfg(DEMO, "pipeline.drafters=2")
    plan = _plan(cfg, ["cpu"], ["cpu", "cpu"])
    assert plan.mode == "host" and "DDP" in plan.why
    with pytest.raises(ConfigError) as e:
        _plan(_cfg(DEMO, "pipeline.drafters=2", "pipeline.spare_drafters=graphs"), ["cpu"], ["cpu", "cpu"])
    assert e.value.key == "pipeline.spare_drafters" and "DDP" in e.value.problem and "auto" in e.value.problem


def test_the_shipped_8b_on_one_h200_holds_a_host_spare_not_a_second_step() -> None:
    # The 8B drafter's 12x4096 step peaks at 116.8 GiB beside a 16 GiB target (docs/BENCHMARKS.md).
    cfg = _cfg(EIGHT_B)
    plan = _plan(cfg, ["cuda:0"], ["cuda:0"], record=_record(116.8))
    assert plan.mode == "host" and plan.gpu_bytes == SPARE_CONTEXT_BYTES
    assert "a second 116.8 GiB" in plan.why and "cuda:0" in plan.why
    with pytest.raises(ConfigError) as e:
        _plan(_cfg(EIGHT_B, "pipeline.spare_drafters=graphs"), ["cuda:0"], ["cuda:0"], record=_record(116.8))
    assert e.value.key == "pipeline.spare_drafters"
    # A drafter on a GPU of its own with a smaller step: two steps fit, so its graphs load ahead.
    own = _plan(cfg, ["cuda:0"], ["cuda:1"], record=_record(50.0))
    assert own.mode == "graphs" and own.gpu_bytes == int(50.0 * GIB)
    # No memory record: nothing to size a warm-up step by.
    assert "no memory record" in _plan(cfg, ["cuda:0"], ["cuda:1"]).why


def test_no_room_for_even_a_cuda_context_or_the_host_copy() -> None:
    cfg = _cfg(EIGHT_B)
    full = _record(123.0)  # 123 + 16 GiB of 139.8 less 2 GiB headroom: no room for a context
    assert _plan(cfg, ["cuda:0"], ["cuda:0"], record=full).mode == "off"
    with pytest.raises(ConfigError) as e:
        _plan(_cfg(EIGHT_B, "pipeline.spare_drafters=host"), ["cuda:0"], ["cuda:0"], record=full)
    assert "CUDA context" in e.value.problem
    short = _plan(cfg, ["cuda:0"], ["cuda:0"], record=_record(116.8), mem=2 * GIB)
    assert short.mode == "off" and "host memory" in short.why
    with pytest.raises(ConfigError) as e:
        _plan(_cfg(EIGHT_B, "pipeline.spare_drafters=host"), ["cuda:0"], ["cuda:0"], mem=2 * GIB)
    assert "4.0 GiB of host memory" in e.value.problem


def test_a_bad_mode_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(DEMO, "pipeline.spare_drafters=warm")
    assert e.value.key == "pipeline.spare_drafters" and "auto, graphs, host, off" in e.value.problem


def _built(device: str = "cpu", side=None) -> Built:
    return Built("host", torch.device(device), "tiny", 0, None, None, None, None, side)


MINE = [DEMO, "--set", "a=1", "--run-dir", "/tmp/r", "--queue", "q", "--local-rank", "0", "--mode", "host"]


def test_a_spare_refuses_another_jobs_rank_or_another_device() -> None:
    cfg = _cfg(DEMO)
    ok = {"argv": [DEMO, "--set", "a=1", "--run-dir", "/tmp/r", "--queue", "q"], "env": {"LOCAL_RANK": "0"}}
    assert refusal(cfg, MINE, ok, _built()) is None
    other = {**ok, "argv": [DEMO, "--run-dir", "/tmp/other", "--queue", "q"]}
    assert refusal(cfg, MINE, other, _built()) == "another job's command line"
    assert "this spare is on cuda:0" in str(refusal(cfg, MINE, ok, _built("cuda:0")))
    group = {**ok, "env": {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}}
    assert refusal(cfg, MINE, group, _built()) is None
    assert "one-rank group" in str(refusal(cfg, MINE, group, _built(side=object())))


def _serve_then(path: Path, then) -> threading.Thread:
    def run() -> None:
        served = serve(path, _cfg(DEMO), MINE, _built())
        assert served is not None
        then(*served)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _wait_for_socket(path: Path) -> None:
    import time

    deadline = time.time() + 10
    while not path.exists():
        assert time.time() < deadline
        time.sleep(0.01)


def test_the_torchrun_worker_exits_with_the_spares_code_or_1_when_it_dies(tmp_path, monkeypatch) -> None:
    path = spare_socket(tmp_path, 0)
    argv = [DEMO, "--set", "a=1", "--run-dir", "/tmp/r", "--queue", "q"]
    assert hand_to_spare(path, argv) is None  # no spare: the rank starts on its own
    monkeypatch.setenv("LOCAL_RANK", "0")
    seen: dict = {}

    def finish(conn, request) -> None:
        seen.update(request)
        send(conn, {"exit": 3})
        conn.close()

    t = _serve_then(path, finish)
    _wait_for_socket(path)
    assert hand_to_spare(path, argv) == 3
    t.join(10)
    assert seen["pid"] == os.getpid() and seen["env"]["LOCAL_RANK"] == "0" and seen["argv"] == argv
    assert not path.exists()  # a spare serves one rank: its socket is gone once taken
    t = _serve_then(path, lambda conn, _request: conn.close())  # the spare died mid-training
    _wait_for_socket(path)
    assert hand_to_spare(path, argv) == 1
    t.join(10)
    t = _serve_then(path, lambda conn, _request: send(conn, {"exit": 0}))
    _wait_for_socket(path)
    assert hand_to_spare(path, [DEMO, "--run-dir", "/tmp/other", "--queue", "q"]) is None
    assert path.exists()  # refused another job's rank: still waiting for its own
    assert hand_to_spare(path, argv) == 0
    t.join(10)
