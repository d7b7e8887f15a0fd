"""dflash.cache.warm compiles what every job process compiles (real torch.compile on CPU).

The pipeline's drafter used to compile cold from a warm cache: inductor keys every graph that runs
C++ on the CPU on the process's intra-op thread count, and the launcher runs drafters with
OMP_NUM_THREADS=1 while warm (like dflash.train) ran with torch's default. The job processes and warm
now take that state from one place (dflash.plan.resolve.compile_contexts / worker_threads), and warm
compiles once per distinct context.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs import start_job
from shared_inputs import seed_runs_root

from dflash.config import load_config
from dflash.plan import resolve
from dflash.plan.resolve import CompileContext, compile_contexts, worker_threads
from dflash.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "demo-cpu.toml"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _cfg(**pipeline: int):
    cfg = load_config(str(CONFIG), [])
    return dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **pipeline))


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> int:
    """torch's default for a process with OMP_NUM_THREADS unset, pinned to 4 for the unit tests."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(resolve, "_DEFAULT_THREADS", 4)
    return 4


def test_worker_threads_follow_omp_num_threads(cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert [worker_threads(r) for r in ("train", "target", "drafter")] == [cores, cores, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert {worker_threads(r) for r in ("train", "target", "drafter")} == {3}
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # torch ignores it too: the defaults apply
    assert [worker_threads(r) for r in ("train", "drafter")] == [cores, 1]
    with pytest.raises(ValueError, match="role"):
        worker_threads("supervisor")


def test_compile_contexts_one_per_distinct_process_state(cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    train = CompileContext("train", cores, ddp=False)
    # CPU: the single-process job and a pipeline drafter run different thread counts: both compiled.
    assert compile_contexts(_cfg(), "drafter", CPU) == [train, CompileContext("drafter", 1, ddp=False)]
    assert compile_contexts(_cfg(), "target", CPU) == [train]  # a target worker runs torch's default too
    # CUDA graphs are not keyed on CPU threads: one context, unless the drafter group runs DDP.
    assert compile_contexts(_cfg(), "drafter", CUDA) == [train]
    ddp = CompileContext("drafter", 1, ddp=True)
    assert compile_contexts(_cfg(drafters=2), "drafter", CUDA) == [train, ddp]
    assert compile_contexts(_cfg(drafters=1, nnodes=2), "drafter", CPU) == [train, ddp]
    assert compile_contexts(_cfg(drafters=2), "target", CPU) == [train]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # every process the same: one context
    assert compile_contexts(_cfg(), "drafter", CPU) == [CompileContext("train", 2, ddp=False)]


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _assert_compiled_warm(run_dir: Path, workers: set[str]) -> list[dict]:
    run = RunDir(run_dir)
    assert run.read_events("cache_miss") == [], run.read_events("cache_miss")
    compiled = run.read_events("compiled")
    assert {e["worker"] for e in compiled} == workers, compiled
    for e in compiled:
        c = e["counters"]
        assert e["misses"] == 0 and c["fxgraph_misses"] == 0 and c["autograd_misses"] == 0, e
        assert c["fxgraph_hits"] > 0 and c["autograd_hits"] > 0, e
    return compiled


def test_warm_cache_serves_the_pipeline_and_the_single_process_job(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: pytest.RecordProperty
) -> None:
    # Unset, as on a plain host: the single-process job then runs torch's default threads and a
    # pipeline drafter 1 (the launcher's), the two states that used to compile different graphs.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("DFLASH_CACHE_DIR", raising=False)
    runs, cache = seed_runs_root(tmp_path / "runs"), tmp_path / "cache"
    t0 = time.monotonic()
    warm = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash.warm",
            str(CONFIG),
            "--out",
            str(cache),
            "--set",
            f"run.runs_root={runs}",
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=900,
    )
    warm_s = time.monotonic() - t0
    assert warm.returncode == 0, warm.stderr[-4000:]
    events = [json.loads(line) for line in warm.stdout.splitlines() if line.startswith("{")]
    plan = next(e for e in events if e["event"] == "plan")
    contexts = plan["contexts"]["drafter"]
    assert {"role": "drafter", "threads": 1, "ddp": False} in contexts, contexts
    done = next(e for e in events if e["event"] == "done")
    assert done["counters"]["fxgraph_misses"] > 0, "warm compiled cold into an empty dir"

    job_env = {"DFLASH_CACHE_DIR": str(cache), "DFLASH_EXPECT_WARM_CACHE": "1"}
    steps = ["--set", "train.total_steps=3"]
    t0 = time.monotonic()
    pipeline = start_job("dflash.launch", repo, runs, tmp_path / "pipeline", *steps, env=job_env)
    _finish(pipeline, 600)
    pipeline_s = time.monotonic() - t0
    _assert_compiled_warm(tmp_path / "pipeline", {"drafter-0"})

    t0 = time.monotonic()
    single = start_job("dflash.train", repo, runs, tmp_path / "single", *steps, env=job_env)
    _finish(single, 600)
    single_s = time.monotonic() - t0
    _assert_compiled_warm(tmp_path / "single", {"drafter-0"})

    for name, value in (("warm_s", warm_s), ("pipeline_s", pipeline_s), ("single_s", single_s)):
        record_property(name, round(value, 1))
    print(
        f"\nwarm {warm_s:.1f} s ({len(contexts)} drafter contexts), pipeline {pipeline_s:.1f} s, "
        f"single-process {single_s:.1f} s: no misses"
    )
