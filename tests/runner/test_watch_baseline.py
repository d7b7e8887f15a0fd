"""Throughput baselines keyed by fingerprint key + config hash, kept from healthy runs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

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
