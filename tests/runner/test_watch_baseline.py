"""Throughput baselines keyed by fingerprint key + config hash, kept from healthy runs."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
from test_watch_fakes import append_jsonl

from runner.launch.registry import HostRecord, RunRecord
from runner.watch.baseline import (
    KEEP_RUNS,
    config_hash,
    for_manifest,
    key_of,
    list_baselines,
    load,
    steady_tok_s,
    update_from_healthy_run,
)
from runner.watch.session import WatchSession, baselines_dir

KEY = "f" * 64
CONFIG = {
    "run": {"name": "a", "seed": 0, "status_interval_s": 10.0},
    "train": {"token_budget": 49152, "max_batch_size": 64, "lr": 6e-4, "total_steps": 1000},
    "attention": {"backend": "flex", "compile": True},
    "pipeline": {"targets": 5, "drafters": 3, "max_restarts": 3},
}


def records(tok: float, n: int = 10, warm: int = 3) -> list[dict[str, float]]:
    slow_start = [{"elapsed_s": 30.0 * i, "tok_s": 100.0} for i in range(warm)]  # compiling: not counted
    return slow_start + [{"elapsed_s": 400.0 + 10 * i, "tok_s": tok} for i in range(n)]


def test_config_hash_ignores_what_cannot_change_speed() -> None:
    h = config_hash(CONFIG)
    other = copy.deepcopy(CONFIG)
    other["run"]["name"] = "b"
    other["train"]["lr"] = 1e-3
    other["train"]["total_steps"] = 50
    other["pipeline"]["max_restarts"] = 0
    assert config_hash(other) == h
    other["train"]["token_budget"] = 2048
    assert config_hash(other) != h
    other = copy.deepcopy(CONFIG)
    other["attention"]["backend"] = "sdpa"
    assert config_hash(other) != h


def test_update_load_list_and_one_run_counted_once(tmp_path: Path) -> None:
    chash = config_hash(CONFIG)
    assert load(tmp_path, KEY, chash) is None and list_baselines(tmp_path) == []
    b = update_from_healthy_run(tmp_path, KEY, chash, records(20500), run_id="r1")
    assert b is not None and b.tok_s == 20500 and b.runs[0]["records"] == 10
    update_from_healthy_run(tmp_path, KEY, chash, records(21000), run_id="r1")  # the same run again
    again = load(tmp_path, KEY, chash)
    assert again is not None and len(again.runs) == 1 and again.tok_s == 21000
    update_from_healthy_run(tmp_path, KEY, chash, records(20000), run_id="r2")
    update_from_healthy_run(tmp_path, KEY, chash, records(4600), run_id="r3")  # one odd run moves it little
    b = load(tmp_path, KEY, chash)
    assert b is not None and b.tok_s == 20000
    assert [x.config_hash for x in list_baselines(tmp_path)] == [chash]


def test_keeps_the_last_runs_only(tmp_path: Path) -> None:
    chash = config_hash(CONFIG)
    for i in range(KEEP_RUNS + 3):
        update_from_healthy_run(tmp_path, KEY, chash, records(1000.0 * (i + 1)), run_id=f"r{i}")
    b = load(tmp_path, KEY, chash)
    assert b is not None and [r["run_id"] for r in b.runs] == [f"r{i}" for i in range(3, KEEP_RUNS + 3)]


def test_too_short_a_run_is_not_a_baseline(tmp_path: Path) -> None:
    assert (
        update_from_healthy_run(tmp_path, KEY, config_hash(CONFIG), records(20000, n=3), run_id="r") is None
    )
    assert steady_tok_s(records(20000, n=0)) is None
    assert steady_tok_s(records(20000, n=4)) == (20000.0, 4)


def test_lookup_from_run_json_and_damaged_files(tmp_path: Path) -> None:
    manifest = {"cache_artifact": KEY, "config": CONFIG}
    assert key_of(manifest) == (KEY, config_hash(CONFIG))
    assert key_of({"cache_artifact": None, "config": CONFIG}) is None
    assert for_manifest(tmp_path, manifest) is None
    update_from_healthy_run(tmp_path, KEY, config_hash(CONFIG), records(20500), run_id="r")
    found = for_manifest(tmp_path, manifest)
    assert found is not None and found.tok_s == 20500
    (tmp_path / KEY / f"{config_hash(CONFIG)}.json").write_text("{not json")
    assert for_manifest(tmp_path, manifest) is None and list_baselines(tmp_path) == []
    with pytest.raises(ValueError):
        load(tmp_path, "../etc", "x")


def completed_run(run: Path, steady: list[float]) -> None:
    """A run directory whose job completed (no job.lock holder, a `stopped: completed` event), with
    a warm-up record and one steady record per value of `steady`."""
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "cache_artifact": KEY, "config": CONFIG}))
    t0 = time.time() - 1000
    append_jsonl(run / "metrics.jsonl", {"t": t0, "elapsed_s": 30.0, "step": 1, "tok_s": 100.0})
    append_jsonl(run / "metrics.jsonl", *({"t": t0 + 400 + i, "elapsed_s": 400.0 + i, "step": 10 + i,
                 "tok_s": v} for i, v in enumerate(steady)))  # fmt: skip
    append_jsonl(run / "events.jsonl", {"t": t0 + 500, "event": "stopped", "reason": "completed"})


def watch_session(run: Path, tmp: Path, refreshes: int) -> WatchSession:
    """A real WatchSession on `run` (its sampler a subprocess at 0.05 s, fake NVML with no GPU),
    refreshed until `refreshes` snapshots arrived: each snapshot carries every record seen so far."""
    spec = tmp / "nvml.json"
    spec.write_text(json.dumps({"gpus": []}))
    rec = RunRecord(run_id=run.name, name=run.name, backend="unknown", created_at=0.0, config="",
                    hosts=[HostRecord(node_rank=0, host=None, run_dir=str(run))])  # fmt: skip
    session = WatchSession(rec, interval_s=0.05, fake_nvml=str(spec))
    deadline = time.monotonic() + 20
    while len(session.hosts[0].watcher.history.snapshots) < refreshes and time.monotonic() < deadline:
        session.refresh(timeout=1.0)
    assert len(session.hosts[0].watcher.history.snapshots) >= refreshes and session.hosts[0].acting
    return session


def test_record_baseline_counts_each_record_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_CACHE_STORE", str(tmp_path / "store"))
    one = tmp_path / "runs" / "one-record"
    completed_run(one, [20000.0])
    session = watch_session(one, tmp_path, refreshes=8)
    try:
        assert session.finished()
        # One steady record seen in 8 snapshots is still one record: too few for a baseline.
        assert session.record_baseline() == []
        assert list_baselines(baselines_dir()) == []
    finally:
        session.close()

    five = tmp_path / "runs" / "five-records"
    completed_run(five, [20000.0, 20100.0, 20200.0, 20300.0, 20400.0])
    session = watch_session(five, tmp_path, refreshes=8)
    try:
        (b,) = session.record_baseline()
    finally:
        session.close()
    assert b.tok_s == 20200.0 and b.runs == [{**b.runs[0], "run_id": "five-records", "records": 5}]
    assert [x.tok_s for x in list_baselines(baselines_dir())] == [20200.0]
