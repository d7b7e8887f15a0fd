"""Data: JSONL parsing with bad-record accounting, the tokenized cache, the demo corpus and the
token-budget batcher (budget, buckets, coverage, sharding, exact resume)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflash.config import DataConfig
from dflash.data.dataset import TokenBudgetBatcher, TokenizedDataset, load_dataset
from dflash.data.demo import write_demo_corpus
from dflash.data.tokenizer import ByteTokenizer
from dflash.errors import DFlashError
from dflash.plan.shapes import make_plan


def _cfg(path: Path | str, **kw: object) -> DataConfig:
    base: dict[str, object] = {"path": str(path), "tokenizer": "byte", "max_seq_len": 64, "min_seq_len": 8}
    base.update(kw)
    return DataConfig(**base)  # type: ignore[arg-type]


def _write(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((ln if isinstance(ln, bytes) else ln.encode()) + b"\n" for ln in lines))
    return path


GOOD_CHAT = {
    "messages": [{"role": "user", "content": "add 2 and 2"}, {"role": "assistant", "content": "2 + 2 = 4."}]
}


def test_bad_records_are_skipped_counted_and_logged(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "d.jsonl",
        [
            json.dumps({"text": "a perfectly fine record"}),  # 1
            '{"text": "broken',  # 2 bad JSON
            "[1, 2, 3]",  # 3 not an object
            json.dumps({"title": "no text here"}),  # 4 missing fields
            json.dumps({"text": 42}),  # 5 wrong type
            json.dumps({"text": "short"}),  # 6 too short
            "",  # 7 blank: not a record
            json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # 8 no assistant
            b"\xff\xfe not utf8",  # 9
            json.dumps(GOOD_CHAT),  # 10
            json.dumps({"text": "x" * 100}),  # 11 truncated
        ],
    )
    logs: list[str] = []
    # 6 of the 10 records are bad: more than the default data.max_bad_fraction (0.5) allows.
    ds = load_dataset(_cfg(path, max_bad_fraction=0.9), ByteTokenizer(), tmp_path / "cache", logs.append)
    assert len(ds) == 3 and (ds.records, ds.bad) == (10, 6)
    assert ds.truncated == 1 and ds.lengths.max() == 64
    assert ds.skipped == {
        "bad JSON": 1,
        "not a JSON object": 1,
        "has no `text`, `messages` or `input_ids`": 1,
        "`text` is not a string": 1,
        "too short": 1,
        "no non-empty assistant turn to train on": 1,
        "not UTF-8": 1,
    }
    joined = "\n".join(logs)
    for line in (2, 3, 4, 5, 6, 8, 9):
        assert f"{path}:{line}:" in joined
    for line in (1, 7, 10, 11):
        assert f"{path}:{line}:" not in joined
    toks, mask = ds[1]
    assert bytes(toks[mask].tolist()).decode() == "2 + 2 = 4."
    assert not mask[:5].any()


def test_token_id_records_are_trained_as_they_are(tmp_path: Path) -> None:
    """`input_ids` records (what dflash.data.responses writes) keep their exact ids and loss mask; ids a
    decode and re-encode would change, a mask of the wrong length or an id past the vocabulary are
    that record's problem, skipped and counted."""
    tok = ByteTokenizer()
    ids = [tok.im_start_id, 0xE2, 0x82, 0xFF, *range(97, 117)]  # 0xFF alone is no UTF-8 text
    mask = [0, 0, 0, 1, *([1] * 20)]
    path = _write(
        tmp_path / "ids.jsonl",
        [
            json.dumps({"input_ids": ids, "loss_mask": mask, "prompt": "ignored by the loader"}),
            json.dumps({"input_ids": ids}),  # no mask: loss on every token
            json.dumps({"input_ids": ids, "loss_mask": mask[:-1]}),
            json.dumps({"input_ids": [*ids, tok.vocab_size]}),
            json.dumps({"input_ids": [1.5, *ids]}),
        ],
    )
    logs: list[str] = []
    ds = load_dataset(_cfg(path, max_bad_fraction=0.9), tok, tmp_path / "cache", logs.append)
    assert len(ds) == 2 and ds.bad == 3
    got, got_mask = ds[0]
    assert got.tolist() == ids and got_mask.tolist() == [bool(m) for m in mask]
    assert ds[1][1].all()
    assert ds.skipped == {
        "`loss_mask` is not a list of 0 and 1 as long as `input_ids`": 1,
        "`input_ids` has a token past the tokenizer's vocabulary": 1,
        "`input_ids` is not a list of non-negative integers": 1,
    }, ds.skipped


def test_empty_or_missing_dataset_is_an_error(tmp_path: Path) -> None:
    bad = _write(tmp_path / "bad.jsonl", ["not json", json.dumps({"text": "tiny"})])
    with pytest.raises(DFlashError, match=r"no usable records \(skipped: bad JSON: 1, too short: 1\)"):
        load_dataset(_cfg(bad), ByteTokenizer(), tmp_path / "cache", lambda _: None)
    empty = _write(tmp_path / "empty.jsonl", [])
    with pytest.raises(DFlashError, match="no usable records"):
        load_dataset(_cfg(empty), ByteTokenizer(), tmp_path / "cache", lambda _: None)
    with pytest.raises(DFlashError, match="not a readable file"):
        load_dataset(_cfg(tmp_path / "nope.jsonl"), ByteTokenizer(), tmp_path / "cache", lambda _: None)


def test_cache_hit_and_invalidation(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [json.dumps({"text": f"record number {i} " * 3}) for i in range(5)])
    cache = tmp_path / "cache"
    logs: list[str] = []
    first = load_dataset(_cfg(path), ByteTokenizer(), cache, logs.append)
    assert not first.cache_hit and "cache miss" in logs[0]
    second = load_dataset(_cfg(path), ByteTokenizer(), cache, logs.append)
    assert second.cache_hit and any("cache hit" in m for m in logs)
    assert np.array_equal(first.tokens, second.tokens) and np.array_equal(first.offsets, second.offsets)
    assert np.array_equal(first.loss_mask, second.loss_mask)

    # A different max_seq_len is a different tokenization.
    assert not load_dataset(_cfg(path, max_seq_len=16), ByteTokenizer(), cache, logs.append).cache_hit
    # Changing the file's content invalidates it.
    with path.open("a") as f:
        f.write(json.dumps({"text": "one more record here"}) + "\n")
    third = load_dataset(_cfg(path), ByteTokenizer(), cache, logs.append)
    assert not third.cache_hit and len(third) == 6
    # A torn cache file is rebuilt, not trusted.
    assert third.cache_path is not None
    third.cache_path.write_bytes(b"PK\x03\x04 torn")
    fourth = load_dataset(_cfg(path), ByteTokenizer(), cache, logs.append)
    assert not fourth.cache_hit and len(fourth) == 6
    assert load_dataset(_cfg(path), ByteTokenizer(), cache, logs.append).cache_hit
    assert not list(cache.glob("*.tmp"))


def test_demo_corpus_is_deterministic_and_loads(tmp_path: Path) -> None:
    a = write_demo_corpus(tmp_path / "a.jsonl", n_records=50, seed=3)
    b = write_demo_corpus(tmp_path / "b.jsonl", n_records=50, seed=3)
    c = write_demo_corpus(tmp_path / "c.jsonl", n_records=50, seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    records = [json.loads(line) for line in a.read_text().splitlines()]
    assert sum("messages" in r for r in records) == 10 and sum("text" in r for r in records) == 40
    ds = load_dataset(
        _cfg("demo", max_seq_len=512, min_seq_len=32), ByteTokenizer(), tmp_path / "cache", lambda _: None
    )
    assert len(ds) == 2000 and not ds.skipped


def _dataset(lengths: list[int]) -> TokenizedDataset:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.arange(offsets[-1], dtype=np.int32) % 250
    return TokenizedDataset(
        tokens=tokens, loss_mask=np.ones_like(tokens, dtype=np.bool_), offsets=offsets, pad_token_id=256
    )


LENGTHS = [int(x) for x in np.random.default_rng(0).integers(9, 200, size=157)]


def _batcher(ds: TokenizedDataset, **kw: object) -> TokenBudgetBatcher:
    """A batcher over a plan of budgets alone (block_token_budget so large it never binds, unless given)."""
    budgets: dict[str, Any] = {
        "token_budget": 512,
        "max_batch_size": 6,
        "bucket_multiple": 32,
        "block_token_budget": 10**9,
        "num_anchors": 8,
    }
    for k in list(kw):
        if k in budgets:
            budgets[k] = kw.pop(k)
    plan = make_plan(min_seq_len=1, max_seq_len=int(max(ds.lengths)), block_size=16, **budgets)
    args: dict[str, Any] = {"seed": 1, "shuffle": True, **kw}
    return TokenBudgetBatcher(ds, plan=plan, **args)


def test_batcher_budget_buckets_and_coverage() -> None:
    ds = _dataset(LENGTHS)
    batcher = _batcher(ds)
    per_epoch = batcher.batches_per_epoch
    it = iter(batcher)
    epochs: list[list[int]] = []
    for _ in range(2):
        seen: list[int] = []
        for _ in range(per_epoch):
            b = next(it)
            B, L = b.input_ids_BL.shape
            assert L % 32 == 0 and B * L <= 512 and B <= 6
            assert int(b.seq_lens_B.max()) > L - 32  # padding bounded by the bucket multiple
            assert b.padded_tokens == B * L and b.num_tokens == sum(LENGTHS[i] for i in b.sample_ids)
            for row, i in enumerate(b.sample_ids):
                toks, _ = ds[i]
                n = len(toks)
                assert b.seq_lens_B[row] == n
                assert np.array_equal(b.input_ids_BL[row, :n].numpy(), toks)
                assert (b.input_ids_BL[row, n:] == 256).all() and not b.loss_mask_BL[row, n:].any()
                assert b.loss_mask_BL[row, :n].all()
            seen += b.sample_ids
        assert sorted(seen) == list(range(len(LENGTHS)))
        epochs.append(seen)
    assert epochs[0] != epochs[1]  # reshuffled per epoch
    assert batcher.epoch_progress == pytest.approx(2.0)
    assert next(it).epoch == 2


def test_batcher_without_shuffle_keeps_file_order_within_buckets() -> None:
    ds = _dataset([40] * 10)
    batches = list(itertools.islice(iter(_batcher(ds, shuffle=False, max_batch_size=64)), 3))
    assert [b.sample_ids for b in batches] == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9], [0, 1, 2, 3, 4, 5, 6, 7]]


def test_batcher_shards_disjointly_with_equal_step_counts() -> None:
    ds = _dataset(LENGTHS)
    world = 3
    shards = [_batcher(ds, rank=r, world_size=world) for r in range(world)]
    counts = {s.batches_per_epoch for s in shards}
    assert len(counts) == 1
    n = counts.pop()
    taken = [[i for b in itertools.islice(iter(s), n) for i in b.sample_ids] for s in shards]
    flat = [i for t in taken for i in t]
    assert len(flat) == len(set(flat))  # disjoint
    full = _batcher(ds)
    dropped = full.batches_per_epoch - world * n
    assert 0 <= dropped < world
    assert len(set(flat)) >= len(LENGTHS) - dropped * 6


def test_batcher_exact_resume() -> None:
    ds = _dataset(LENGTHS)
    reference = _batcher(ds)
    stream = iter(reference)
    consumed = reference.batches_per_epoch + 3  # cross an epoch boundary
    for _ in range(consumed):
        next(stream)
    state = reference.state_dict()
    expected = [next(stream).sample_ids for _ in range(10)]

    resumed = _batcher(ds)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [b.sample_ids for b in itertools.islice(iter(resumed), 10)] == expected

    # state_after(batch) resumes right after a batch that a prefetching producer handed out earlier.
    producer = _batcher(ds)
    batches = list(itertools.islice(iter(producer), 8))
    again = _batcher(ds)
    again.load_state_dict(producer.state_after(batches[4]))
    assert [b.sample_ids for b in itertools.islice(iter(again), 3)] == [b.sample_ids for b in batches[5:8]]


def test_batcher_rejects_changed_settings_and_impossible_budgets() -> None:
    ds = _dataset(LENGTHS)
    state = _batcher(ds).state_dict()
    with pytest.raises(DFlashError, match="token_budget: saved 512, now 1024"):
        _batcher(ds, token_budget=1024).load_state_dict(state)
    with pytest.raises(DFlashError, match="block_token_budget: saved 1000000000, now 256"):
        _batcher(ds, block_token_budget=256).load_state_dict(state)
    with pytest.raises(DFlashError, match="train.token_budget"):
        _batcher(ds, token_budget=128)
    with pytest.raises(DFlashError, match="fewer batches than there are data ranks"):
        next(iter(_batcher(_dataset([40]), rank=1, world_size=2)))


def test_target_tokenizer_batches_in_order_across_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dflash.data.dataset as data_mod
    from dflash.data.demo import demo_records, make_tiny_target
    from dflash.data.tokenizer import load_tokenizer

    tok = load_tokenizer("target", str(make_tiny_target(tmp_path / "tiny", layers=1)))
    path = write_demo_corpus(tmp_path / "demo.jsonl", n_records=23, seed=5)
    monkeypatch.setattr(data_mod, "_CHUNK_LINES", 4)  # several chunks, text and chat records interleaved
    ds = load_dataset(_cfg(path, max_seq_len=4096, min_seq_len=1), tok, tmp_path / "cache", lambda _: None)
    records = demo_records(23, seed=5)
    assert len(ds) == len(records)
    for i, rec in enumerate(records):
        ids, mask = ds[i]
        if "text" in rec:
            assert ids.tolist() == tok.encode(str(rec["text"])) and mask.all()
        else:
            want_ids, want_mask = tok.encode_chat(rec["messages"])  # type: ignore[arg-type]
            assert ids.tolist() == want_ids and mask.tolist() == want_mask
