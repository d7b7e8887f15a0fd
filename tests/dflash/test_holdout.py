"""dflash.data.holdout: the in-job tau's prompts held out of the job's own data file, spread evenly,
made once per content, the rest the training file; none held out of a file too small for it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dflash.config import load_config
from dflash.data.holdout import BY_STAT, held_lines, job_source, split
from dflash.errors import DFlashError

REPO = Path(__file__).resolve().parents[2]


def _corpus(path: Path, n: int) -> list[bytes]:
    lines = [f'{{"text": "record {i}"}}\n'.encode() for i in range(n)]
    path.write_bytes(b"".join(lines[:5]) + b"\n   \n" + b"".join(lines[5:-1]) + lines[-1].rstrip(b"\n"))
    return lines


def test_held_lines_are_spread_over_the_file() -> None:
    assert held_lines(100, 4) == {12, 37, 62, 87}
    assert len(held_lines(17, 16)) == 16 and held_lines(17, 16) < set(range(17))  # distinct, in the file
    assert len(held_lines(10_000, 16)) == 16 and max(held_lines(10_000, 16)) < 10_000


def test_split_holds_out_count_lines_and_trains_on_the_rest(tmp_path: Path) -> None:
    lines = _corpus(tmp_path / "data.jsonl", 100)
    train, prompts = split(tmp_path / "data.jsonl", 4, tmp_path / "cache")
    assert prompts is not None and prompts.parent == train.parent
    held = prompts.read_bytes().splitlines(keepends=True)
    assert held == [lines[i] for i in (12, 37, 62, 87)]  # blank lines skipped, the last line's newline added
    assert train.read_bytes().splitlines(keepends=True) == [
        ln for i, ln in enumerate(lines) if i not in (12, 37, 62, 87)
    ]
    made = train.stat().st_mtime_ns
    assert split(tmp_path / "data.jsonl", 4, tmp_path / "cache") == (train, prompts)  # made once, reused
    assert train.stat().st_mtime_ns == made
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [train.parent.name, BY_STAT]
    )  # no temp
    assert [p.name.startswith(".") for p in (tmp_path / "cache" / BY_STAT).iterdir()] == [False]
    other, _ = split(tmp_path / "data.jsonl", 5, tmp_path / "cache")
    assert other.parent != train.parent  # another count, another split


def test_a_later_start_finds_the_split_by_stat_and_a_changed_file_gets_a_new_one(tmp_path: Path) -> None:
    data, cache = tmp_path / "data.jsonl", tmp_path / "cache"
    _corpus(data, 100)
    train, prompts = split(data, 4, cache)
    st = data.stat()
    # Same size and mtime, other bytes: found by the pointer, so the file was not read again.
    data.write_bytes(data.read_bytes().replace(b"record 1", b"RECORD 1"))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert split(data, 4, cache) == (train, prompts)
    # A change the stat shows (mtime): the content is read and split anew.
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    train2, prompts2 = split(data, 4, cache)
    assert train2.parent != train.parent and b"RECORD 1" in train2.read_bytes()
    # A pointer to a split that was deleted is not trusted: the split is made again.
    shutil.rmtree(train2.parent)
    assert split(data, 4, cache) == (train2, prompts2) and train2.is_file()


def test_too_few_records_hold_none_out(tmp_path: Path) -> None:
    _corpus(tmp_path / "small.jsonl", 16)
    assert split(tmp_path / "small.jsonl", 16, tmp_path / "cache") == (tmp_path / "small.jsonl", None)
    assert not (tmp_path / "cache").exists()


def test_job_source_follows_the_settings(tmp_path: Path) -> None:
    _corpus(tmp_path / "data.jsonl", 50)
    data = str(tmp_path / "data.jsonl")

    def source(*sets: str):
        cfg = load_config(
            REPO / "configs" / "demo-cpu.toml",
            [f"data.path={data}", f"data.cache_dir={tmp_path / 'c'}", *sets],
        )
        return job_source(cfg, data)

    held = source()
    assert held.data_path.endswith("train.jsonl") and held.tau_prompts is not None
    assert held.tau_prompts.startswith(str(tmp_path / "c" / ".holdout"))
    assert (
        source("train.tau_eval=false").data_path == data
        and source("train.tau_eval=false").tau_prompts is None
    )
    mine = tmp_path / "mine.jsonl"
    assert source(f"train.tau_prompts={mine}") == type(held)(data, str(mine))
    single = load_config(REPO / "configs" / "demo-cpu.toml", [f"data.path={data}"])
    assert job_source(single, data, measures_tau=False) == type(held)(data, None)  # dflash.train
    demo = load_config(REPO / "configs" / "demo-cpu.toml", [])
    assert job_source(demo, "/x/corpus.jsonl").tau_prompts == "demo"


def test_an_unwritable_cache_is_one_line(tmp_path: Path) -> None:
    _corpus(tmp_path / "data.jsonl", 50)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(DFlashError, match="cannot write the held-out tau prompts under .*data.cache_dir"):
        split(tmp_path / "data.jsonl", 4, blocker / "cache")
