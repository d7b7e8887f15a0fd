"""The built-in demo: a deterministic, learnable synthetic corpus and a tiny random Qwen3 target with a
real Hugging Face tokenizer, both written to disk so that the job loads them through the same code
paths as a real run (AutoTokenizer, AutoModelForCausalLM, safetensors)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.errors import DFlashError
from dflash.rundir import atomic_write_bytes, install_dir

_COLORS = ["red", "blue", "green", "small", "old", "happy"]
_ANIMALS = ["cat", "dog", "bird", "fox", "horse", "fish"]
_VERBS = ["sees", "likes", "follows", "finds", "helps"]
_PLACES = ["park", "house", "river", "garden", "forest"]


def _story(rng: random.Random) -> str:
    # Subject-verb-object sentences over a tiny vocabulary: after a few words the rest is predictable.
    out = []
    for _ in range(rng.randint(4, 9)):
        a, b = rng.sample(_ANIMALS, 2)
        out.append(
            f"The {rng.choice(_COLORS)} {a} {rng.choice(_VERBS)} the {rng.choice(_COLORS)} {b} "
            f"near the {rng.choice(_PLACES)}."
        )
    return " ".join(out)


def _sums(rng: random.Random, n: int) -> str:
    return " ".join(
        f"{a} + {b} = {a + b}." for a, b in ((rng.randint(0, 20), rng.randint(0, 20)) for _ in range(n))
    )


def _counting(rng: random.Random) -> str:
    start, step = rng.randint(0, 50), rng.randint(1, 3)
    return "Count: " + " ".join(str(start + step * i) for i in range(rng.randint(15, 40))) + "."


def _chat(rng: random.Random) -> dict[str, object]:
    pairs = [(rng.randint(0, 20), rng.randint(0, 20)) for _ in range(rng.randint(3, 6))]
    question = "Please add: " + ", ".join(f"{a} and {b}" for a, b in pairs) + "."
    answer = " ".join(f"{a} + {b} = {a + b}." for a, b in pairs)
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.5:
        messages = [{"role": "system", "content": "You are a careful calculator."}, *messages]
    return {"messages": messages}


def demo_records(n_records: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    records: list[dict[str, object]] = []
    for i in range(n_records):
        kind = i % 5
        if kind in (0, 1):
            records.append({"text": _story(rng)})
        elif kind == 2:
            records.append({"text": _sums(rng, rng.randint(6, 14))})
        elif kind == 3:
            records.append({"text": _counting(rng)})
        else:
            records.append(_chat(rng))
    return records


def write_demo_corpus(path: Path, n_records: int = 2000, seed: int = 0) -> Path:
    """Write the demo JSONL (deterministic in n_records and seed). Rewriting the same bytes keeps the
    tokenized-data cache valid because the cache is keyed by content, not mtime."""
    path = Path(path)
    text = "".join(json.dumps(r) + "\n" for r in demo_records(n_records, seed))
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    atomic_write_bytes(path, text.encode("utf-8"))
    return path


# ---- tiny target: tokenizer -------------------------------------------------------------------

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes map to themselves, the rest to code points from
    256 up, so every byte is a visible character that BPE can merge."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _learn_merges(words: Counter[str], num_merges: int) -> list[tuple[str, str]]:
    """Plain BPE on byte-level words; ties broken by the pair itself so the result is reproducible."""
    split = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, count in words.items():
            parts = split[w]
            for a, b in zip(parts, parts[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < 2:
            break
        merges.append(best)
        for w, parts in split.items():
            i, merged = 0, []
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            split[w] = merged
    return merges


def build_tiny_tokenizer(num_merges: int = 96):  # -> transformers tokenizer
    """A byte-level BPE tokenizer (real `tokenizers` model, merges learned here from the demo corpus)
    with pad/eos/mask specials and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words: Counter[str] = Counter()
    for rec in demo_records(200, seed=1):
        messages: list[dict[str, str]] = rec.get("messages", [])  # type: ignore[assignment]
        texts = [str(rec["text"])] if "text" in rec else [m["content"] for m in messages]
        for t in texts:
            words.update(piece for piece, _ in pre.pre_tokenize_str(t))
    alphabet = [_bytes_to_unicode()[b] for b in range(256)]
    merges = _learn_merges(words, num_merges)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.pre_tokenizer = pre
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# ---- tiny target: model -----------------------------------------------------------------------

_MARKER = "dflash_tiny.json"


def _tiny_spec(layers: int, hidden: int, seed: int, tie_embeddings: bool) -> dict[str, int | bool]:
    """What a tiny target's weights depend on: its marker file holds this."""
    return {"version": 1, "layers": layers, "hidden": hidden, "seed": seed, "tie": tie_embeddings}


def tiny_target_ready(
    path: Path, *, layers: int, hidden: int, seed: int, tie_embeddings: bool = False
) -> bool:
    """A complete tiny target with these parameters is at `path` (read only: nothing is built)."""
    return _tiny_complete(Path(path), _tiny_spec(layers, hidden, seed, tie_embeddings))


def _tiny_complete(path: Path, spec: dict[str, int | bool]) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == spec
    except (OSError, json.JSONDecodeError):
        return False


def check_tiny(layers: int, hidden: int) -> None:
    if layers < 1 or hidden < 16 or hidden % 16:
        raise DFlashError(
            f"tiny target: layers must be >= 1 and hidden a multiple of 16, got {layers}, {hidden}"
        )


def tiny_config(layers: int, hidden: int, *, vocab: int = 256, **extra: Any) -> Any:
    """The tiny target's Qwen3Config (16-dim heads, half as many KV heads); `vocab` is the
    tokenizer's padded size where it matters (the drafter's trainable sizes do not depend on it)."""
    from transformers import Qwen3Config

    head_dim = 16
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=8192,
        **extra,
    )


def make_tiny_target(
    path: Path, *, layers: int = 8, hidden: int = 64, seed: int = 0, tie_embeddings: bool = False
) -> Path:
    """A tiny random Qwen3ForCausalLM + tokenizer saved in the HF format (bf16 safetensors). Reused when
    a complete one with the same parameters exists; built in a temp dir and renamed into place."""
    path = Path(path)
    check_tiny(layers, hidden)
    spec = _tiny_spec(layers, hidden, seed, tie_embeddings)
    if _tiny_complete(path, spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Launches sharing a runs root (several hosts' launchers on one machine, a test, a rerun) build it
    # once: the others wait on the lock and then find it complete. Without the lock a late builder
    # would swap the directory out from under a process that is already loading it.
    with _exclusive(path.parent / f".{path.name}.lock"):
        if _tiny_complete(path, spec):
            return path
        _build_tiny_target(path, spec, layers=layers, hidden=hidden, seed=seed, tie_embeddings=tie_embeddings)
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build_tiny_target(
    path: Path, spec: dict[str, int | bool], *, layers: int, hidden: int, seed: int, tie_embeddings: bool
) -> None:
    import torch
    from transformers import Qwen3ForCausalLM

    tok = build_tiny_tokenizer()
    vocab = -(-len(tok) // 64) * 64  # padded like real checkpoints: the embedding is larger than len(tok)
    config = tiny_config(
        layers,
        hidden,
        vocab=vocab,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype=torch.bfloat16)

    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(spec))
        install_dir(tmp, path)  # replaces a stale or incomplete one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
