"""Tokenizers for the job: the target's own (transformers AutoTokenizer, local files only) or a
built-in byte-level one for the demo and tests. Both expose the same small surface (`Tokenizer`).

Chat records are trained on assistant turns only. For the target tokenizer the loss mask is derived
from the rendered chat template by locating each assistant message's content in the rendered text
and marking the tokens whose character spans overlap it (offset mapping). That works with any
template that renders the content verbatim, which is why it is used instead of `{% generation %}`
markers (most released templates, Qwen3's included, have none).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Protocol

from dflash.errors import DFlashError

# Bump when the way records become (ids, loss_mask) changes: it is part of the cache key.
ENCODING_VERSION = "enc-v2"  # v2: `input_ids` records


class RecordError(ValueError):
    """One data record cannot be encoded; the data loader skips and counts it."""


class Tokenizer(Protocol):
    vocab_size: int
    pad_token_id: int
    eos_token_id: int
    mask_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def encode_chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]: ...
    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]: ...
    def identity(self) -> str: ...


def _prompt_turns(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The turns of a prompt (no assistant reply yet), checked as a training record's are."""
    return _check_messages([*messages, {"role": "assistant", "content": "-"}])[:-1]


def record_prompt(rec: Any, tok: Tokenizer, prompt_tokens: int) -> list[int] | None:
    """The prompt a record gives, as token ids, or None: a `messages` record's turns before its last
    assistant turn with the assistant's turn opened (what a served model is given to answer), or a
    `text` record's first prompt_tokens tokens. The one rule for the target's responses
    (dflash.data.responses) and for the eval's prompts (dflash.eval), so both ask the target alike."""
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("messages"), list):
        msgs = rec["messages"]
        last = max(
            (i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
            default=None,
        )
        if not last:  # no assistant turn, or nothing before it
            return None
        return tok.encode_prompt(msgs[:last])
    if isinstance(rec.get("text"), str):
        return tok.encode(rec["text"])[:prompt_tokens] or None
    return None


def lone_surrogate(text: str) -> tuple[int, int] | None:
    """(code point, character index) of the first lone surrogate in text, if any: JSON allows its
    escape ("\\ud800"), UTF-8 and tokenizers do not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return ord(text[e.start]), e.start
    return None


def _check_messages(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RecordError("`messages` must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RecordError(f"messages[{i}] is not an object")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise RecordError(f"messages[{i}] needs string `role` and `content`")
        for name, text in (("role", role), ("content", content)):
            bad = lone_surrogate(text)
            if bad is not None:
                raise RecordError(
                    f"messages[{i}].{name} is not valid Unicode (a lone surrogate U+{bad[0]:04X})"
                )
        out.append((role, content))
    if not any(role == "assistant" and content for role, content in out):
        raise RecordError("no non-empty assistant turn to train on")
    return out


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens follow. Chat uses a ChatML-like built-in template:
    `<|im_start|>role\\ncontent<|im_end|>\\n` per message."""

    SPECIALS = ("<|pad|>", "<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>")

    def __init__(self) -> None:
        self.special_ids = {name: 256 + i for i, name in enumerate(self.SPECIALS)}
        self.pad_token_id = self.special_ids["<|pad|>"]
        self.eos_token_id = self.special_ids["<|endoftext|>"]
        self.mask_token_id: int | None = self.special_ids["<|mask|>"]
        self.im_start_id = self.special_ids["<|im_start|>"]
        self.im_end_id = self.special_ids["<|im_end|>"]
        self.vocab_size = 256 + len(self.SPECIALS)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.special_ids.items()}
        parts: list[str] = []
        pending = bytearray()
        for i in ids:
            if i < 256:
                pending.append(i)
                continue
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            parts.append(names.get(i, f"<|{i}|>"))
        parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def encode_chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        mask: list[bool] = []
        for role, content in _check_messages(messages):
            head = [self.im_start_id, *self.encode(f"{role}\n")]
            body = self.encode(content)
            tail = [self.im_end_id, *self.encode("\n")]
            ids += head + body + tail
            train = role == "assistant"
            mask += [False] * len(head) + [train] * len(body) + [False] * len(tail)
        return ids, mask

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The turns, then the assistant's turn opened: what a served model is given to answer."""
        ids: list[int] = []
        for role, content in _prompt_turns(messages):
            ids += [self.im_start_id, *self.encode(f"{role}\n"), *self.encode(content)]
            ids += [self.im_end_id, *self.encode("\n")]
        return [*ids, self.im_start_id, *self.encode("assistant\n")]

    def identity(self) -> str:
        return f"byte-v1:{ENCODING_VERSION}"


# Files that define an HF tokenizer's behaviour; their bytes make up its cache identity.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


class HFTokenizer:
    """Wraps a transformers fast tokenizer loaded from the target's local directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = Path(path)
        try:
            self.hf = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise DFlashError(
                f"could not load the target's tokenizer from {self.path}: {e}. Pass a local Hugging Face "
                'model directory that holds tokenizer files, or set data.tokenizer = "byte"'
            ) from e
        if not getattr(self.hf, "is_fast", False):
            raise DFlashError(
                f"the tokenizer in {self.path} is not a fast (tokenizers-backed) tokenizer; chat loss masks "
                "need its offset mapping. Provide a tokenizer.json in the model directory"
            )
        special = [
            t for t in (self.hf.pad_token_id, self.hf.eos_token_id, self.hf.mask_token_id) if t is not None
        ]
        self.vocab_size = max([len(self.hf), *(s + 1 for s in special)])
        eos = self.hf.eos_token_id
        if eos is None:
            raise DFlashError(
                f"the tokenizer in {self.path} has no eos token; set eos_token in tokenizer_config.json"
            )
        self.eos_token_id = int(eos)
        # Padding is masked out everywhere, so eos is a safe stand-in when there is no pad token.
        self.pad_token_id = int(self.hf.pad_token_id if self.hf.pad_token_id is not None else eos)
        self.mask_token_id = None if self.hf.mask_token_id is None else int(self.hf.mask_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=True)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # One call: the Rust tokenizer encodes the batch on all cores.
        return [list(ids) for ids in self.hf(texts, add_special_tokens=True)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids))

    def encode_chat(self, messages: list[dict[str, Any]]) -> tuple[list[int], list[bool]]:
        turns = _check_messages(messages)
        if not self.hf.chat_template:
            raise DFlashError(
                f"the tokenizer in {self.path} has no chat template, so `messages` records cannot be encoded; "
                "use `text` records or a model directory with a chat template"
            )
        plain = [{"role": r, "content": c} for r, c in turns]
        rendered = self.hf.apply_chat_template(plain, tokenize=False)
        if not isinstance(rendered, str):
            raise RecordError("chat template did not render to text")
        spans: list[tuple[int, int]] = []
        cursor = 0
        for role, content in turns:
            if not content:
                continue
            at = rendered.find(content, cursor)
            if at < 0:
                raise RecordError(f"chat template does not render the {role} content verbatim")
            if role == "assistant":
                spans.append((at, at + len(content)))
            cursor = at + len(content)
        enc = self.hf(rendered, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = [False] * len(ids)
        span_i = 0
        for t, (start, end) in enumerate(enc["offset_mapping"]):
            while span_i < len(spans) and spans[span_i][1] <= start:
                span_i += 1
            if span_i < len(spans) and end > start and start < spans[span_i][1] and end > spans[span_i][0]:
                mask[t] = True
        return ids, mask

    def encode_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """The turns through the chat template with its generation prompt: what a served model is given."""
        turns = _prompt_turns(messages)
        if not self.hf.chat_template:
            raise DFlashError(
                f"the tokenizer in {self.path} has no chat template to render `messages` prompts with"
            )
        plain = [{"role": r, "content": c} for r, c in turns]
        rendered = self.hf.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        return list(self.hf(str(rendered), add_special_tokens=False)["input_ids"])

    def identity(self) -> str:
        digest = hashlib.sha256()
        for name in _HF_TOKENIZER_FILES:
            f = self.path / name
            if f.is_file():
                digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
        digest.update(str(self.hf.chat_template or "").encode())
        return f"hf:{type(self.hf).__name__}:{digest.hexdigest()[:32]}:{ENCODING_VERSION}"


def load_tokenizer(kind: str, target_path: str | None) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "target":
        if not target_path:
            raise DFlashError('data.tokenizer = "target" needs target.path (a local HF model directory)')
        if not Path(target_path).is_dir():
            raise DFlashError(
                f"target.path {target_path} is not a directory; pass a local Hugging Face model directory "
                '(or set data.tokenizer = "byte")'
            )
        return HFTokenizer(target_path)
    raise DFlashError(f"data.tokenizer must be target or byte, got {kind!r}")


def require_mask_token(tok: Tokenizer, configured_id: int) -> int:
    """The drafter's mask token id, checked before any model is loaded."""
    if configured_id >= 0:
        # Not checked against the tokenizer: the usual choice is an embedding row above the
        # tokenizer's ids (Qwen3: 151669 tokens, 151936 rows). resolve_spec checks it against the
        # target's embedding rows, still before any weights load.
        return configured_id
    if tok.mask_token_id is not None:
        return tok.mask_token_id
    raise DFlashError(
        "the tokenizer has no mask token and drafter.mask_token_id is not set. Set drafter.mask_token_id "
        "to an unused (e.g. reserved special) token id of the target's vocabulary, or add a mask_token "
        "to the tokenizer's tokenizer_config.json"
    )
