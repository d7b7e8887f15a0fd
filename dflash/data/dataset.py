"""Training data: JSONL records -> token ids + loss masks (cached on disk) -> token-budget batches.

Records are `{"text": str}` (loss on every token), `{"messages": [{"role", "content"}, ...]}` (loss on
assistant content only) or `{"input_ids": [int, ...], "loss_mask": [0|1, ...]}` (token ids as they are,
loss where the mask is 1; dflash.data.responses writes these: the exact tokens the target said, which a
decode and re-encode would not always give back). A record that fails anywhere on its way to token ids (not UTF-8, not JSON,
an integer past Python's digit limit, nesting past the recursion limit, wrong types, text the
tokenizer rejects such as a lone surrogate) is skipped, counted by reason and logged with file:line;
records skipped for their length only are counted too. A file of mostly bad records stops the job
(data.max_bad_fraction): it is the wrong file, or a broken export.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dflash.data.tokenizer import RecordError, Tokenizer, lone_surrogate
from dflash.errors import DFlashError
from dflash.plan.shapes import ShapePlan, round_up
from dflash.rundir import atomic_write_bytes, unusable_reason

if TYPE_CHECKING:
    from dflash.config import DataConfig

CACHE_FORMAT = "tokcache-v1"
_LOGGED_PER_REASON = 20  # individual file:line messages per reason; the rest only counted
_CHUNK_LINES = 1024  # lines per batched tokenizer call
_JUDGE_AFTER = 1000  # records read before the bad fraction is judged mid-file (and at the end, always)


@dataclass(kw_only=True, slots=True)
class TokenizedDataset:
    tokens: np.ndarray
    """All sequences' ids concatenated (int32)."""
    loss_mask: np.ndarray
    """Same length as tokens (bool)."""
    offsets: np.ndarray
    """Sequence i is tokens[offsets[i]:offsets[i+1]] (int64, n+1 entries)."""
    pad_token_id: int
    skipped: dict[str, int] = field(default_factory=dict)
    """Records skipped, by reason (bad ones and those skipped for their length)."""
    records: int = 0
    """Records read: the file's non-blank lines."""
    bad: int = 0
    """Skipped records that are broken (not those skipped for their length): data.max_bad_fraction."""
    truncated: int = 0
    cache_hit: bool = False
    cache_path: Path | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.loss_mask[a:b]

    def summary(self) -> dict[str, Any]:
        """The counts the `started` (and `launched`, `worker_ready`) events carry as `data`."""
        return {
            "records": self.records,
            "sequences": len(self),
            "tokens": self.num_tokens,
            "bad": self.bad,
            "skipped": dict(sorted(self.skipped.items())),
            "truncated": self.truncated,
            "cache_hit": self.cache_hit,
        }


class _TooShort(RecordError):
    """A well-formed record that the length settings leave nothing of: skipped, but not bad."""


def _token_record(rec: dict[str, Any]) -> tuple[list[int], list[bool]]:
    ids, mask = rec["input_ids"], rec.get("loss_mask")
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise RecordError("`input_ids` is not a list of non-negative integers")
    if mask is None:
        return ids, [True] * len(ids)
    if not isinstance(mask, list) or len(mask) != len(ids) or not all(m in (0, 1) for m in mask):
        raise RecordError("`loss_mask` is not a list of 0 and 1 as long as `input_ids`")
    return ids, [bool(m) for m in mask]


def _parse_record(raw: bytes) -> str | list[Any] | tuple[list[int], list[bool]]:
    """A record's `text` string, its `messages` list or its (input_ids, loss mask); RecordError names
    what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RecordError("not UTF-8") from e
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError(f"bad JSON ({e.msg})") from e
    except RecursionError as e:
        raise RecordError("bad JSON (nested deeper than Python's recursion limit)") from e
    except ValueError as e:  # an integer past Python's int-string digit limit, and the like
        raise RecordError(f"bad JSON ({str(e).split(':')[0]})") from e
    if not isinstance(rec, dict):
        raise RecordError("not a JSON object")
    if "input_ids" in rec:
        return _token_record(rec)
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise RecordError("`text` is not a string")
        bad = lone_surrogate(rec["text"])
        if bad is not None:
            raise RecordError(
                f"`text` is not valid Unicode (a lone surrogate U+{bad[0]:04X} at character {bad[1]})"
            )
        return rec["text"]
    if "messages" in rec:
        if not isinstance(rec["messages"], list):
            raise RecordError("`messages` is not a list")
        return rec["messages"]
    raise RecordError("has no `text`, `messages` or `input_ids`")


def _reason_key(message: str) -> str:
    # Group by the stable part of the message (bad JSON details vary per line).
    return message.split(" (")[0]


def _numbered_chunks(path: Path, size: int) -> Iterator[list[tuple[int, bytes]]]:
    chunk: list[tuple[int, bytes]] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if raw.strip():  # blank lines are formatting, not records
                chunk.append((line_no, raw.strip()))
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _one_record(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) for one record: any exception is that record's RecordError, except the job's own
    errors (DFlashError: a tokenizer without a chat template is the config's fault, not a record's)."""
    try:
        return fn(*args)
    except (RecordError, DFlashError):
        raise
    except Exception as e:
        detail = " ".join(str(e).split())[:120]
        raise RecordError(f"cannot be encoded ({type(e).__name__}: {detail})") from e


def _encode_texts(texts: list[str], tok: Tokenizer) -> list[list[int] | RecordError]:
    """One batched tokenizer call; when it fails, each text alone, so only the culprits are lost."""
    if not texts:
        return []
    try:
        return list(_one_record(tok.encode_batch, texts))
    except RecordError:
        out: list[list[int] | RecordError] = []
        for text in texts:
            try:
                out.append(_one_record(tok.encode, text))
            except RecordError as e:
                out.append(e)
        return out


def _encode_chunk(
    chunk: list[tuple[int, bytes]], tok: Tokenizer
) -> list[tuple[int, tuple[list[int], list[bool]] | RecordError]]:
    """Encode a chunk of lines in order; plain texts go through the tokenizer in one batch call."""
    parsed: list[tuple[int, str | list[Any] | tuple[list[int], list[bool]] | RecordError]] = []
    for line_no, raw in chunk:
        try:
            parsed.append((line_no, _one_record(_parse_record, raw)))
        except RecordError as e:
            parsed.append((line_no, e))
    text_ids = iter(_encode_texts([p for _, p in parsed if isinstance(p, str)], tok))
    out: list[tuple[int, tuple[list[int], list[bool]] | RecordError]] = []
    for line_no, p in parsed:
        if isinstance(p, RecordError):
            out.append((line_no, p))
        elif isinstance(p, tuple):
            top = max(p[0], default=0)
            fits = top < tok.vocab_size
            out.append((line_no, p if fits else RecordError(
                f"`input_ids` has a token past the tokenizer's vocabulary ({top} >= {tok.vocab_size})"
            )))  # fmt: skip
        elif isinstance(p, str):
            ids = next(text_ids)
            out.append((line_no, ids if isinstance(ids, RecordError) else (ids, [True] * len(ids))))
        else:
            try:
                out.append((line_no, _one_record(tok.encode_chat, p)))
            except RecordError as e:
                out.append((line_no, e))
    return out


def _checked(ids: list[int], mask: list[bool], cfg: DataConfig) -> tuple[list[int], list[bool], bool]:
    if len(ids) < cfg.min_seq_len:
        raise _TooShort(f"too short ({len(ids)} tokens < data.min_seq_len {cfg.min_seq_len})")
    cut = len(ids) > cfg.max_seq_len
    if cut:
        ids, mask = ids[: cfg.max_seq_len], mask[: cfg.max_seq_len]
    if not any(mask):
        raise _TooShort("no loss tokens within data.max_seq_len")
    return ids, mask, cut


def _skip(
    e: RecordError, path: Path, line_no: int, skipped: Counter[str], log: Callable[[str], None]
) -> bool:
    """Count (and log, the first ones of each reason) a skipped record; True when it is a bad one."""
    reason = _reason_key(str(e))
    skipped[reason] += 1
    if skipped[reason] <= _LOGGED_PER_REASON:
        log(f"data: skipped {path}:{line_no}: {e}")
    elif skipped[reason] == _LOGGED_PER_REASON + 1:
        log(f"data: more records skipped for '{reason}'; only counting them from here")
    return not isinstance(e, _TooShort)


def source_records(path: Path, cfg: DataConfig, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The records of a data file that parse, in order: what dflash.data.responses takes its prompts
    from. The others are skipped, logged and counted as training's reader does, and a file of mostly
    bad records is refused alike (data.max_bad_fraction)."""
    if not path.is_file():
        raise _unreadable(path)
    out: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    records = bad = 0
    for chunk in _numbered_chunks(path, _CHUNK_LINES):
        for line_no, raw in chunk:
            records += 1
            try:
                _one_record(_parse_record, raw)
            except RecordError as e:
                bad += _skip(e, path, line_no, skipped, log)
                continue
            out.append(json.loads(raw))
    _judge(path, cfg, records, bad, skipped, log, whole_file=True)
    return out


def _tokenize_file(
    path: Path, cfg: DataConfig, tok: Tokenizer, log: Callable[[str], None]
) -> TokenizedDataset:
    tokens: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    lengths: list[int] = []
    skipped: Counter[str] = Counter()
    truncated = records = bad = 0
    for chunk in _numbered_chunks(path, _CHUNK_LINES):
        for line_no, result in _encode_chunk(chunk, tok):
            records += 1
            try:
                if isinstance(result, RecordError):
                    raise result
                ids, mask, cut = _checked(*result, cfg)
            except RecordError as e:
                bad += _skip(e, path, line_no, skipped, log)
                continue
            truncated += cut
            tokens.append(np.asarray(ids, dtype=np.int32))
            masks.append(np.asarray(mask, dtype=np.bool_))
            lengths.append(len(ids))
        if records >= _JUDGE_AFTER:  # stop early: no need to read a huge wrong file to its end
            _judge(path, cfg, records, bad, skipped, log, whole_file=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return TokenizedDataset(
        tokens=np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
        loss_mask=np.concatenate(masks) if masks else np.zeros(0, np.bool_),
        offsets=offsets,
        pad_token_id=tok.pad_token_id,
        skipped=dict(skipped),
        records=records,
        bad=bad,
        truncated=truncated,
    )


def _judge(
    path: Path,
    cfg: DataConfig,
    records: int,
    bad: int,
    skipped: dict[str, int],
    log: Callable[[str], None],
    *,
    whole_file: bool,
) -> None:
    """Stop (DFlashError) when more than data.max_bad_fraction of the records read are bad."""
    if not records or bad <= cfg.max_bad_fraction * records:
        return
    reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(skipped.items()))
    message = (
        f"data.path {path}: {bad} of {'its' if whole_file else 'the first'} {records} records are bad "
        f"({100 * bad / records:.0f}%, more than data.max_bad_fraction={cfg.max_bad_fraction:g}; skipped: "
        f"{reasons}). Each line must be a JSON object with a `text` string or a `messages` list (the data "
        "log names file:line of each bad record): fix the file, or raise data.max_bad_fraction"
    )
    log(f"data: stopped: {message}")
    raise DFlashError(message)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_key(path: Path, cfg: DataConfig, tok: Tokenizer) -> str:
    parts = [
        CACHE_FORMAT,
        _file_sha256(path),
        tok.identity(),
        f"max={cfg.max_seq_len}",
        f"min={cfg.min_seq_len}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]


def _save_cache(ds: TokenizedDataset, target: Path) -> None:
    meta = json.dumps(
        {
            "skipped": ds.skipped,
            "records": ds.records,
            "bad": ds.bad,
            "truncated": ds.truncated,
            "pad_token_id": ds.pad_token_id,
        }
    )
    buf = io.BytesIO()
    np.savez(buf, tokens=ds.tokens, loss_mask=ds.loss_mask, offsets=ds.offsets, meta=np.array(meta))
    atomic_write_bytes(target, buf.getvalue())


def _load_cache(target: Path) -> TokenizedDataset | None:
    try:
        with np.load(target, allow_pickle=False) as z:
            meta: dict[str, Any] = json.loads(str(z["meta"]))
            ds = TokenizedDataset(
                tokens=z["tokens"],
                loss_mask=z["loss_mask"],
                offsets=z["offsets"],
                pad_token_id=int(meta["pad_token_id"]),
                skipped={str(k): int(v) for k, v in meta["skipped"].items()},
                records=int(meta["records"]),
                bad=int(meta["bad"]),
                truncated=int(meta["truncated"]),
            )
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None  # unreadable or torn cache entries are rebuilt, never trusted
    if len(ds.offsets) < 2 or ds.num_tokens != len(ds.tokens) or len(ds.tokens) != len(ds.loss_mask):
        return None
    return ds


def load_dataset(
    cfg: DataConfig, tok: Tokenizer, cache_root: Path, log: Callable[[str], None]
) -> TokenizedDataset:
    """Tokenize (or load from the cache) the JSONL file named by cfg.path; `demo` writes the built-in
    demo corpus under cache_root first. Raises DFlashError when nothing usable is left."""
    cache_root = Path(cache_root)
    if cfg.path == "demo":
        from dflash.data.demo import write_demo_corpus

        try:
            path = write_demo_corpus(cache_root / "demo-corpus.jsonl")
        except OSError as e:
            raise _cache_error(cache_root, e) from None
    else:
        path = Path(cfg.path)
    if not path.is_file():
        raise _unreadable(path)
    try:
        key = cache_key(path, cfg, tok)
    except OSError as e:
        raise DFlashError(f"data.path {path} cannot be read: {e}") from e
    cache_file = cache_root / f"{key}.npz"
    ds = _load_cache(cache_file) if cache_file.is_file() else None
    if ds is not None:
        ds.cache_hit = True
        log(f"data: tokenized cache hit {cache_file}")
    else:
        log(f"data: tokenized cache miss; tokenizing {path}")
        ds = _tokenize_file(path, cfg, tok, log)
    # A cache hit is judged too: data.max_bad_fraction may have been lowered since it was written.
    _judge(path, cfg, ds.records, ds.bad, ds.skipped, log, whole_file=True)
    if not ds.cache_hit and len(ds) > 0:
        try:
            _save_cache(ds, cache_file)
        except OSError as e:
            raise _cache_error(cache_root, e) from None
    ds.cache_path = cache_file
    skipped = ", ".join(f"{reason}: {n}" for reason, n in sorted(ds.skipped.items())) or "none"
    if len(ds) == 0:
        raise DFlashError(
            f"data.path {path} has no usable records (skipped: {skipped}). Each line must be a JSON object "
            f"with a `text` string or a `messages` list, at least data.min_seq_len={cfg.min_seq_len} tokens long"
        )
    log(
        f"data: {ds.records} records: {len(ds)} sequences, {ds.num_tokens} tokens, {ds.truncated} truncated "
        f"to {cfg.max_seq_len}, {ds.bad} bad, skipped: {skipped}"
    )
    return ds


def _unreadable(path: Path) -> DFlashError:
    return DFlashError(
        f"data.path {path} is not a readable file; pass a JSONL file of text/messages records, or `demo`"
    )


def _cache_error(cache_root: Path, e: OSError) -> DFlashError:
    return DFlashError(
        f"tokenized-data cache {cache_root}: cannot write there: {unusable_reason(cache_root, e)}; set "
        "data.cache_dir (default: <run.runs_root>/.tokcache) to a directory this user can write"
    )


@dataclass(kw_only=True, slots=True)
class Batch:
    input_ids_BL: torch.Tensor
    """Right-padded token ids (int64)."""
    loss_mask_BL: torch.Tensor
    """True where a token is trained on (never on padding)."""
    seq_lens_B: torch.Tensor
    sample_ids: list[int]
    epoch: int = 0
    index: int = 0
    """Position of this batch in its rank's sequence: batch `index` of `epoch` (see state_after)."""

    @property
    def num_tokens(self) -> int:
        return int(self.seq_lens_B.sum())

    @property
    def padded_tokens(self) -> int:
        return self.input_ids_BL.numel()


class TokenBudgetBatcher:
    """Endless batches: per epoch the samples are permuted (seed + epoch), each goes to the bucket of its
    length rounded up to bucket_multiple, and a bucket is emitted once it holds as many rows as fit
    (the shape plan's rows for that bucket, dflash.plan.shapes); leftovers close the epoch as smaller batches.
    The epoch's global batch list is the same on every rank; rank r takes batches r, r+W, ... and the
    last (< W) batches are dropped so that every rank runs the same number of steps."""

    def __init__(
        self,
        ds: TokenizedDataset,
        *,
        plan: ShapePlan,
        seed: int,
        shuffle: bool,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise DFlashError(f"data rank {rank} is outside world size {world_size}")
        self.ds = ds
        self.shapes = plan
        self.bucket_multiple = plan.bucket_multiple
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self._lengths = ds.lengths  # np.diff over every offset: once, not per batch
        m = self.bucket_multiple
        self._bucket_len = round_up(self._lengths, m)
        outside = sorted(set(np.unique(self._bucket_len).tolist()) - set(plan.lengths))
        if outside:
            raise DFlashError(
                f"the data has sequences padded to {outside[:5]} tokens, outside the shape plan's buckets "
                f"{plan.lengths}: raise train.token_budget to at least {max(outside)} or lower "
                "data.max_seq_len"
            )
        self.epoch = 0
        self.index = 0
        self._plan_epoch = -1
        self._plan: list[list[int]] = []

    def rows_for(self, bucket_len: int) -> int:
        return self.shapes.rows_for(bucket_len)

    def _global_batches(self, epoch: int) -> list[list[int]]:
        n = len(self.ds)
        if self.shuffle:
            order = np.random.default_rng(self.seed + epoch).permutation(n)
        else:
            order = np.arange(n)
        pending: dict[int, list[int]] = {}
        batches: list[list[int]] = []
        for i in order.tolist():
            blen = int(self._bucket_len[i])
            rows = pending.setdefault(blen, [])
            rows.append(i)
            if len(rows) == self.rows_for(blen):
                batches.append(rows)
                pending[blen] = []
        batches.extend(rows for _, rows in sorted(pending.items()) if rows)
        return batches

    def _rank_batches(self, epoch: int) -> list[list[int]]:
        if self._plan_epoch != epoch:
            batches = self._global_batches(epoch)
            usable = len(batches) // self.world_size * self.world_size
            self._plan = batches[self.rank : usable : self.world_size]
            self._plan_epoch = epoch
        return self._plan

    @property
    def batches_per_epoch(self) -> int:
        return len(self._rank_batches(self.epoch))

    @property
    def epoch_progress(self) -> float:
        per_epoch = self.batches_per_epoch
        return self.epoch + (self.index / per_epoch if per_epoch else 0.0)

    def collate(self, sample_ids: list[int], epoch: int, index: int) -> Batch:
        seq_lens = [int(self._lengths[i]) for i in sample_ids]
        length = int(max(self._bucket_len[i] for i in sample_ids))
        ids = np.full((len(sample_ids), length), self.ds.pad_token_id, dtype=np.int64)
        mask = np.zeros((len(sample_ids), length), dtype=np.bool_)
        for row, i in enumerate(sample_ids):
            toks, m = self.ds[i]
            ids[row, : len(toks)] = toks
            mask[row, : len(m)] = m
        return Batch(
            input_ids_BL=torch.from_numpy(ids),
            loss_mask_BL=torch.from_numpy(mask),
            seq_lens_B=torch.tensor(seq_lens, dtype=torch.long),
            sample_ids=list(sample_ids),
            epoch=epoch,
            index=index,
        )

    def __iter__(self) -> Iterator[Batch]:
        while True:
            plan = self._rank_batches(self.epoch)
            if not plan:
                raise DFlashError(
                    f"the dataset ({len(self.ds)} sequences) makes fewer batches than there are data ranks "
                    f"({self.world_size}); add data or lower train.max_batch_size / the number of workers"
                )
            if self.index >= len(plan):
                self.epoch, self.index = self.epoch + 1, 0
                continue
            epoch, index = self.epoch, self.index
            # Advance before yielding: a state_dict taken after receiving this batch resumes after it.
            self.index += 1
            yield self.collate(plan[index], epoch, index)

    def _identity(self) -> dict[str, Any]:
        return {
            "num_samples": len(self.ds),
            "num_tokens": self.ds.num_tokens,
            "token_budget": self.shapes.token_budget,
            "block_token_budget": self.shapes.block_token_budget,
            "bucket_multiple": self.bucket_multiple,
            "rows": self.shapes.buckets(),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, **self._identity()}

    def state_after(self, batch: Batch) -> dict[str, Any]:
        """The state that resumes right after `batch` (for consumers that run behind a prefetching producer)."""
        return {"epoch": batch.epoch, "index": batch.index + 1, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self._identity()
        diff = [k for k, v in mine.items() if state.get(k) != v]
        if diff:
            detail = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in diff)
            raise DFlashError(
                f"cannot resume the data position: the data or batching settings changed ({detail}). "
                "Resume with the same data and settings, or start a new run"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
