"""Data records that used to crash the whole run are skipped and counted with file:line: a lone
surrogate the tokenizer rejects, an integer past Python's digit limit, nesting past the recursion
limit, wrong types. A file of mostly bad records stops early with the file and the counts. Real
small files throughout, through the byte tokenizer, the tiny target's own tokenizer and the job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jobs import start_job

import dflash.data.dataset as data_mod
from dflash.config import DataConfig
from dflash.data.dataset import load_dataset
from dflash.data.demo import demo_records
from dflash.data.tokenizer import ByteTokenizer
from dflash.errors import DFlashError
from dflash.rundir import RunDir

GOOD = [json.dumps({"text": f"record {i}: a perfectly ordinary line of training text"}) for i in range(12)]
CHAT_OK = {
    "messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello back"}]
}

BAD: dict[str, str] = {
    # line text -> the reason it is counted under
    '{"text": "ab\\ud800cd and more text to be long enough"}': "`text` is not valid Unicode",
    json.dumps(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\ud800 answer"}]}
    ): "messages[1].content is not valid Unicode",
    '{"text": "fine text, but", "n": ' + "7" * 5000 + "}": "bad JSON",
    '{"text": "fine text, but", "deep": ' + "[" * 100_000 + "]" * 100_000 + "}": "bad JSON",
    '{"text": null}': "`text` is not a string",
    '{"messages": {"role": "assistant"}}': "`messages` is not a list",
    '{"messages": [7, {"role": "assistant", "content": "x"}]}': "messages[0] is not an object",
    '{"messages": [{"role": ["user"], "content": "x"}]}': "messages[0] needs string `role` and `content`",
    '{"messages": [{"role": "assistant", "content": 5}]}': "messages[0] needs string `role` and `content`",
    "7": "not a JSON object",
}


def _cfg(path: Path, **kw: object) -> DataConfig:
    base: dict[str, object] = {"path": str(path), "tokenizer": "byte", "max_seq_len": 128, "min_seq_len": 8}
    base.update(kw)
    return DataConfig(**base)  # type: ignore[arg-type]


def _mixed_file(path: Path) -> tuple[Path, dict[int, str]]:
    """GOOD and BAD lines interleaved (a good line first); {line number: reason} of the bad ones."""
    lines: list[str] = []
    bad_at: dict[int, str] = {}
    good = iter([*GOOD, json.dumps(CHAT_OK)])
    for text, reason in BAD.items():
        lines.append(next(good))
        lines.append(text)
        bad_at[len(lines)] = reason
    lines.extend(good)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return path, bad_at


def test_every_kind_of_bad_record_is_skipped_counted_and_logged(tmp_path):
    path, bad_at = _mixed_file(tmp_path / "mixed.jsonl")
    logs: list[str] = []
    ds = load_dataset(_cfg(path), ByteTokenizer(), tmp_path / "cache", logs.append)
    assert (ds.records, ds.bad, len(ds)) == (len(GOOD) + 1 + len(BAD), len(BAD), len(GOOD) + 1)
    want: dict[str, int] = {}
    for reason in bad_at.values():
        want[reason.split(" (")[0]] = want.get(reason.split(" (")[0], 0) + 1
    assert ds.skipped == want
    for line, reason in bad_at.items():
        [logged] = [m for m in logs if f"{path}:{line}:" in m]
        assert reason in logged, logged
        assert len(logged) < 300, "a 5000-digit record is not echoed into the log"
    assert "digit" in "".join(logs) and "recursion" in "".join(logs)
    assert f"{ds.bad} bad" in logs[-1] and f"{ds.records} records" in logs[-1]
    assert ds.summary()["bad"] == len(BAD) and ds.summary()["skipped"] == dict(sorted(want.items()))


class _PickyTokenizer(ByteTokenizer):
    """Rejects one word the way the Rust tokenizer rejects input: the whole batch call fails."""

    def encode(self, text: str) -> list[int]:
        if "forbidden" in text:
            raise TypeError(
                "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
            )
        return super().encode(text)


def test_a_record_the_tokenizer_rejects_loses_only_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "_CHUNK_LINES", 5)
    lines = [*GOOD[:4], json.dumps({"text": "this one has a forbidden word"}), *GOOD[4:8]]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    logs: list[str] = []
    ds = load_dataset(_cfg(path), _PickyTokenizer(), tmp_path / "cache", logs.append)
    assert len(ds) == 8 and ds.skipped == {"cannot be encoded": 1} and ds.bad == 1
    assert any(f"{path}:5: cannot be encoded (TypeError: TextEncodeInput" in m for m in logs)
    for i in range(8):
        want = ByteTokenizer().encode(json.loads(GOOD[i])["text"])
        assert ds[i][0].tolist() == want, "records around the culprit are encoded as before"


def test_the_target_tokenizer_skips_lone_surrogates(tmp_path):
    from dflash.data.demo import make_tiny_target
    from dflash.data.tokenizer import load_tokenizer

    tok = load_tokenizer("target", str(make_tiny_target(tmp_path / "tiny", layers=1)))
    path, bad_at = _mixed_file(tmp_path / "mixed.jsonl")
    logs: list[str] = []
    ds = load_dataset(_cfg(path, tokenizer="target"), tok, tmp_path / "cache", logs.append)
    assert len(ds) == len(GOOD) + 1 and ds.bad == len(BAD)
    assert ds[0][0].tolist() == tok.encode(json.loads(GOOD[0])["text"])
    for line, reason in bad_at.items():
        if "Unicode" in reason:
            assert any(f"{path}:{line}: {reason} (a lone surrogate U+D800" in m for m in logs), logs


def test_a_mostly_bad_file_stops_naming_the_file_and_the_counts(tmp_path):
    path = tmp_path / "wrong.jsonl"
    path.write_text("\n".join([*GOOD[:3], *(["not json at all"] * 5), '{"text": 3}', "[]"]) + "\n")
    logs: list[str] = []
    with pytest.raises(DFlashError) as e:
        load_dataset(_cfg(path), ByteTokenizer(), tmp_path / "cache", logs.append)
    message = str(e.value)
    assert str(path) in message and "7 of its 10 records are bad" in message
    assert "bad JSON: 5" in message and "data.max_bad_fraction=0.5" in message
    assert logs[-1].startswith("data: stopped:")
    assert not list((tmp_path / "cache").glob("*.npz")), "a refused file is not cached"
    # The threshold is the config's: at 1 bad records are only skipped.
    ds = load_dataset(_cfg(path, max_bad_fraction=1.0), ByteTokenizer(), tmp_path / "cache", logs.append)
    assert len(ds) == 3 and ds.bad == 7
    # A cache hit is judged again: the threshold may be lower than when the cache was written.
    with pytest.raises(DFlashError, match="7 of its 10 records are bad"):
        load_dataset(_cfg(path, max_bad_fraction=0.2), ByteTokenizer(), tmp_path / "cache", logs.append)


def test_a_large_wrong_file_stops_early(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("w") as f:
        for i in range(20_000):
            f.write(GOOD[0] + "\n" if i % 10 == 0 else "col_a,col_b,col_c\n")  # a CSV, mostly
    # 103 of the first 1024 lines (one chunk) are good: judged there, the other 18 976 never read.
    with pytest.raises(DFlashError) as e:
        load_dataset(_cfg(path), ByteTokenizer(), tmp_path / "cache", lambda _: None)
    assert f"data.path {path}: 921 of the first 1024 records are bad" in str(e.value)


def _job_data(path: Path) -> dict[int, str]:
    """Demo records the tiny target trains on, with every kind of bad record among them."""
    lines = [json.dumps(r) for r in demo_records(60, seed=1)]
    bad_at = {}
    for i, text in enumerate(BAD):
        lines.insert(3 * i + 1, text)
        bad_at[3 * i + 2] = BAD[text]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
    return bad_at


def _check_counts(run: RunDir, path: Path, bad_at: dict[int, str], data: dict) -> None:
    assert data["bad"] == len(BAD) and data["records"] == 60 + len(BAD) and data["sequences"] <= 60
    assert sum(data["skipped"].values()) >= len(BAD)
    log = (run.logs / "data.log").read_text()
    for line, reason in bad_at.items():
        assert f"{path}:{line}: {reason}" in log
    assert f"{len(BAD)} bad" in log


def _run_job(module: str, repo: Path, tmp_path: Path, path: Path, *sets: str) -> RunDir:
    """The real job (tests/jobs.py's start_job) on the demo config over the data file `path`."""
    run_dir = tmp_path / "run"
    sets = ("data.responses=false", *sets)  # the reader of training records is the subject, not responses
    args = [
        a
        for s in (f"data.path={path}", "attention.compile=false", "train.tau_eval=false", *sets)
        for a in ("--set", s)
    ]
    proc = start_job(module, repo, tmp_path, run_dir, *args)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return RunDir(run_dir)


def test_the_single_process_job_skips_them_and_reports_counts(repo, tmp_path):
    path = tmp_path / "data.jsonl"
    bad_at = _job_data(path)
    run = _run_job("dflash.train", repo, tmp_path, path, "train.total_steps=1")
    [started] = run.read_events("started")
    _check_counts(run, path, bad_at, started["data"])


def test_the_pipeline_skips_them_and_reports_counts(repo, tmp_path):
    path = tmp_path / "data.jsonl"
    bad_at = _job_data(path)
    sets = ("train.total_steps=2", "pipeline.queue_depth=2", "pipeline.prefetch_depth=2")
    run = _run_job("dflash.launch", repo, tmp_path, path, *sets)
    [launched] = run.read_events("launched")
    [ready] = run.read_events("worker_ready")
    [started] = run.read_events("started")
    for data in (launched["data"], ready["data"], started["data"]):
        _check_counts(run, path, bad_at, data)
    assert ready["data"]["cache_hit"], "the targets read the tokenized cache the launcher wrote"
