"""Every config in configs/ warms and trains, at a scaled-down size that keeps its structure.

Scaled down: every length (max_seq_len, bucket_multiple, token and block budgets, anchors, the
sliding window, the loss chunk) divided by one factor, so the bucket count, the rows per bucket and
which budget binds stay what they are at full size; layer types, block size, batch-size cap and the
placement (worker counts, one device per worker) unchanged; the tiny random target instead of the
real one, the CPU instead of GPUs (sdpa: flex has no backward there). Real dflash.cache.warm, then the
real job (the pipeline for a config with [pipeline], as its header says to run it) on a data set
whose sequences fall in every bucket: zero recompile-limit hits, every planned shape trained, every
shape's first step a cache hit, nothing degraded.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from jobs import start_job
from shared_inputs import seed_runs_root

from dflash.config import load_config, read_config_file
from dflash.plan.shapes import shape_plan
from dflash.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.toml"))
SCALED_MAX_LEN = 128
"""max_seq_len at the scaled-down size; every other length follows by the same factor."""


def _full(config: Path) -> Any:
    """The shipped config as it resolves (paths replaced: they name the user's model and data)."""
    return load_config(str(config), ["target.path=tiny", "data.path=demo"])


def scaled_overrides(config: Path, data: Path, runs: Path) -> list[str]:
    cfg = _full(config)
    f = max(1, cfg.data.max_seq_len // SCALED_MAX_LEN)

    def down(n: int) -> int:
        return max(1, n // f)

    d, t, p = cfg.data, cfg.train, cfg.pipeline
    sets = {
        "run.device": "cpu",
        "run.runs_root": str(runs),
        "run.status_interval_s": 1,
        "target.path": "tiny",
        "target.dtype": "float32",
        "target.tiny_layers": 8,
        "target.tiny_hidden": 64,
        "drafter.mask_token_id": -1,
        "drafter.sliding_window": down(cfg.drafter.sliding_window),
        "drafter.num_target_layers": min(cfg.drafter.num_target_layers, 3),
        "attention.backend": "sdpa",
        "data.path": str(data),
        "data.tokenizer": "target",
        "data.max_seq_len": down(d.max_seq_len),
        "data.min_seq_len": down(d.min_seq_len),
        "data.bucket_multiple": down(d.bucket_multiple),
        "train.token_budget": down(t.token_budget),
        "train.num_anchors": down(t.num_anchors),
        "train.loss_chunk_tokens": down(t.loss_chunk_tokens),
        "train.total_steps": 24,  # an epoch of 192 sequences: every bucket
        "train.warmup_steps": 2,
        "train.checkpoint_every": 1000,
        "pipeline.target_devices": ["cpu"] * p.targets,
        "pipeline.drafter_devices": ["cpu"] * p.drafters,
        "pipeline.prefetch_depth": min(p.prefetch_depth, 8),
    }
    if t.block_token_budget:
        sets["train.block_token_budget"] = down(t.block_token_budget)
    return [f"{k}={json.dumps(v)}" for k, v in sets.items()]


def _records(path: Path, n: int, max_words: int) -> Path:
    """Texts from one word to past max_seq_len (the tiny target's tokenizer makes about 5-6 tokens
    of a word), evenly: every bucket gets sequences."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "drafter", "target", "block", "anchor", "token", "mask"]
    with open(path, "w") as out:
        for i in range(n):
            k = 1 + (i * max_words) // n
            out.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(k))}) + "\n")
    return path


def _sets_args(sets: list[str]) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache dir for the configs of this module: scaled down alike, the shipped configs share their
    drafter graphs, so the second config's warm finds the first one's (its own new graphs, such as a
    DDP group's, still compile). Each warm still runs every planned shape through dynamo."""
    return tmp_path_factory.mktemp("compile-cache")


# demo-cpu is warmed and trained (both job processes, both thread contexts) in test_warm_pipeline.py.
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.stem != "demo-cpu"], ids=lambda c: c.stem)
def test_shipped_config_warms_and_trains_scaled_down(
    repo: Path, tmp_path: Path, config: Path, compile_cache: Path
) -> None:
    full = shape_plan(_full(config))
    runs = seed_runs_root(tmp_path / "runs")  # the tiny target (the demo's) built once a session
    data = _records(tmp_path / "data.jsonl", 192, 26)
    sets = scaled_overrides(config, data, runs)
    small_cfg = load_config(str(config), sets)
    small = shape_plan(small_cfg)
    # The structure kept: the bucket count, the rows of every bucket, the layer types.
    assert len(small.shapes) == len(full.shapes) > 1
    assert [s.rows for s in small.shapes] == [s.rows for s in full.shapes]
    assert small.layer_types == full.layer_types and small.drafter_graphs == full.drafter_graphs

    cache = compile_cache
    warm = subprocess.run(
        [sys.executable, "-m", "dflash.warm", str(config), "--out", str(cache), *_sets_args(sets)],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=1200,
    )
    assert warm.returncode == 0, warm.stderr[-4000:]
    events = [json.loads(line) for line in warm.stdout.splitlines() if line.startswith("{")]
    done = next(e for e in events if e["event"] == "done")
    assert done["counters"]["recompile_limit_hits"] == 0, done
    warmed = [e for e in events if e["event"] == "shape" and e["part"] == "drafter"]
    assert [(e["shape"]["rows"], e["shape"]["length"]) for e in warmed] == [tuple(b) for b in small.buckets()]
    stats = json.loads((cache / "warm.json").read_text())
    assert stats["degraded"] == [] and stats["shape_plan"]["recompile_limit"] == small.recompile_limit

    env = {"DFLASH_CACHE_DIR": str(cache), "DFLASH_EXPECT_WARM_CACHE": "1"}
    module = "dflash.launch" if "pipeline" in read_config_file(config) else "dflash.train"
    job = start_job(module, repo, runs, tmp_path / "run", *_sets_args(sets), env=env, config=config)
    out, _ = job.communicate(timeout=1200)
    assert job.returncode == 0, out[-4000:]
    run = RunDir(tmp_path / "run")
    assert run.read_events("cache_miss") == [] and run.read_events("degraded") == []
    # Each drafter rank trains its share of the batches: together they meet every bucket.
    compiled = [e for e in run.read_events("compiled") if e["worker"].startswith("drafter-")]
    assert {tuple(e["shape"]) for e in compiled} == {tuple(b) for b in small.buckets()}, (
        "every bucket trained"
    )
    for e in compiled:
        assert e["misses"] == 0 and e["counters"]["recompile_limit_hits"] == 0, e
    assert run.read_metrics()[-1]["compile"]["recompile_limit_hits"] == 0
