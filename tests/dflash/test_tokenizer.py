"""Tokenizers: the built-in byte tokenizer and the tiny target's real HF tokenizer, chat loss masks,
and the mask-token requirement."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash.data.demo import make_tiny_target
from dflash.data.tokenizer import ByteTokenizer, RecordError, load_tokenizer, require_mask_token
from dflash.errors import DFlashError

CHAT = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "Please add: 2 and 3."},
    {"role": "assistant", "content": "2 + 3 = 5."},
    {"role": "user", "content": "And 10 and 4?"},
    {"role": "assistant", "content": "10 + 4 = 14. Done — ünïcode ok."},
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tok") / "tiny", layers=2)


def _runs(mask: list[bool]) -> int:
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_byte_round_trip_and_specials() -> None:
    tok = load_tokenizer("byte", None)
    text = "Hello, wörld! 3 + 4 = 7 ✓\n\ttabs"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([*ids[:5], tok.eos_token_id]) == text[:5] + "<|endoftext|>"
    specials = {tok.pad_token_id, tok.eos_token_id, tok.mask_token_id}
    assert len(specials) == 3 and all(256 <= s < tok.vocab_size for s in specials)  # type: ignore[operator]


def test_byte_chat_mask_is_exactly_assistant_content() -> None:
    tok = ByteTokenizer()
    ids, mask = tok.encode_chat(CHAT)
    assert len(ids) == len(mask)
    trained = bytes(i for i, m in zip(ids, mask, strict=True) if m).decode()
    assert trained == "2 + 3 = 5." + "10 + 4 = 14. Done — ünïcode ok."
    assert _runs(mask) == 2
    assert "<|im_start|>assistant\n2 + 3" in tok.decode(ids)


def test_chat_without_assistant_is_a_record_error() -> None:
    tok = ByteTokenizer()
    with pytest.raises(RecordError, match="assistant"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    with pytest.raises(RecordError, match="role"):
        tok.encode_chat([{"role": "assistant", "content": 3}])
    with pytest.raises(RecordError):
        tok.encode_chat([])


def test_hf_tokenizer_loads_from_target_dir(tiny_dir: Path) -> None:
    tok = load_tokenizer("target", str(tiny_dir))
    text = "The red cat sees the blue dog near the park. 12 + 5 = 17."
    ids = tok.encode(text)
    assert len(ids) < len(text.encode())  # the learned merges are used
    assert tok.decode(ids) == text
    assert tok.mask_token_id is not None and tok.mask_token_id < tok.vocab_size
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.identity() == load_tokenizer("target", str(tiny_dir)).identity()
    assert tok.identity() != ByteTokenizer().identity()


def test_hf_chat_mask_is_exactly_assistant_content(tiny_dir: Path) -> None:
    tok = load_tokenizer("target", str(tiny_dir))
    ids, mask = tok.encode_chat(CHAT)
    trained = [i for i, m in zip(ids, mask, strict=True) if m]
    assert tok.decode(trained) == "2 + 3 = 5." + "10 + 4 = 14. Done — ünïcode ok."
    assert _runs(mask) == 2
    assert tok.decode(ids).startswith("<|im_start|>system\nYou add numbers.<|im_end|>")


def test_hf_chat_template_that_rewrites_content_is_a_record_error(tiny_dir: Path) -> None:
    tok = load_tokenizer("target", str(tiny_dir))
    tok.hf.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"  # type: ignore[attr-defined]
    with pytest.raises(RecordError, match="verbatim"):
        tok.encode_chat(CHAT)
    tok.hf.chat_template = None  # type: ignore[attr-defined]
    with pytest.raises(DFlashError, match="no chat template"):
        tok.encode_chat(CHAT)


def test_identity_follows_tokenizer_files(tiny_dir: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    before = load_tokenizer("target", str(copy)).identity()
    template = copy / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|im_end|>\n", "<|im_end|>\n\n"))
    assert load_tokenizer("target", str(copy)).identity() != before


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(DFlashError, match="target.path"):
        load_tokenizer("target", None)
    with pytest.raises(DFlashError, match="not a directory"):
        load_tokenizer("target", str(tmp_path / "missing"))
    with pytest.raises(DFlashError, match="could not load"):
        load_tokenizer("target", str(tmp_path))
    with pytest.raises(DFlashError, match="target or byte"):
        load_tokenizer("sentencepiece", None)


def test_require_mask_token() -> None:
    tok = ByteTokenizer()
    assert require_mask_token(tok, -1) == tok.mask_token_id
    assert require_mask_token(tok, 7) == 7
    # An embedding row above the tokenizer's ids (how Qwen3 drafters pick theirs) is accepted here;
    # the target's embedding size bounds it (test_model: resolve_spec).
    assert require_mask_token(tok, tok.vocab_size) == tok.vocab_size
    tok.mask_token_id = None
    with pytest.raises(DFlashError, match="drafter.mask_token_id"):
        require_mask_token(tok, -1)
