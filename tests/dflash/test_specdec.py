"""Speculative decoding written here (dflash.specdec), on the CPU with a tiny random Qwen3 target
loaded through transformers and real drafters: lossless against the target's own greedy decode, the
cached and the cache-free loops agreeing round by round, and tau where the right answer is known
from the target alone (a drafter that always proposes token 0: each round accepts exactly the run
of 0s the target's greedy decode has there)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from dflash.config import load_config
from dflash.data.demo import make_tiny_target
from dflash.specdec import Target, decode, decode_plain, greedy, summarize
from dflash.step.model import DFlashDrafter, resolve_spec
from dflash.target import load_frozen_head

K = 16


def _target_dir(tmp_path_factory, name: str, boost: float | None = None):
    """A tiny random target; boost: token 0's LM-head row scaled by it (the target then emits 0 at
    some positions, not all), saved back through safetensors."""
    path = make_tiny_target(tmp_path_factory.mktemp(name) / "t", layers=4, hidden=64, seed=3)
    if boost is not None:
        f = next(path.glob("*.safetensors"))
        w = load_file(str(f))
        w["lm_head.weight"][0] *= boost
        save_file(w, str(f), metadata={"format": "pt"})
    return path


def _pair(path, *, zero_drafter: bool):
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
    cfg = load_config("configs/demo-cpu.toml", ["target.path=tiny", "drafter.num_target_layers=2"])
    spec = resolve_spec(cfg.drafter, model.config, mask_token_id=model.config.vocab_size - 1)
    embed, head, _ = load_frozen_head(str(path), dtype=torch.float32, device="cpu")
    torch.manual_seed(0)
    drafter = DFlashDrafter(spec, embed, head, backend="sdpa", compile=False).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0.0, 0.05)  # not the init's 0.02-only: a drafter whose proposals vary
        if zero_drafter:
            drafter.norm.weight.zero_()  # every logit 0: it always proposes token 0
    return Target(model, spec.target_layer_ids), drafter


PROMPTS = [[5, 9, 17, 33, 2, 8], [101, 7, 7, 7], [200, 150, 100, 50, 25, 12, 6, 3, 1]]


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    return _pair(_target_dir(tmp_path_factory, "random"), zero_drafter=False)


@pytest.fixture(scope="module")
def zero_pair(tmp_path_factory):
    return _pair(_target_dir(tmp_path_factory, "boosted", boost=4.0), zero_drafter=True)


def _expected_rounds(tokens: list[int]) -> list[int]:
    """The rounds a drafter proposing only 0s must take on the greedy decode `tokens`: after the
    first token (the prefill's), each round accepts the run of 0s that follows, up to K - 1, then the
    target's own token."""
    rounds, i = [], 1
    while i < len(tokens):
        m = 0
        while m < K - 1 and i + m < len(tokens) and tokens[i + m] == 0:
            m += 1
        rounds.append(m + 1)
        i += m + 1
    return rounds


@pytest.mark.parametrize("loop", [decode, decode_plain], ids=["cached", "plain"])
def test_greedy_speculative_decoding_is_the_targets_own_greedy_decode(random_pair, loop) -> None:
    target, drafter = random_pair
    for prompt in PROMPTS:
        want = greedy(target, prompt, max_new=40).tokens
        got = loop(target, drafter, prompt, max_new=40)
        assert got.tokens == want
        assert sum(got.rounds) + 1 >= len(got.tokens)  # every token came from a round (or the prefill)


def test_a_drafter_of_zeros_is_accepted_exactly_where_the_target_says_zero(zero_pair) -> None:
    target, drafter = zero_pair
    decodes, zeros = [], 0
    for prompt in PROMPTS:
        want = greedy(target, prompt, max_new=60).tokens
        zeros += want.count(0)
        cached = decode(target, drafter, prompt, max_new=60)
        plain = decode_plain(target, drafter, prompt, max_new=60)
        assert cached.tokens == plain.tokens == want
        assert cached.rounds == plain.rounds
        # The last round may run past max_new: its tokens are cut, its acceptance is counted whole.
        assert cached.rounds[:-1] == _expected_rounds(want)[: len(cached.rounds) - 1]
        decodes.append(cached)
    assert 0 < zeros < 60 * len(PROMPTS), "the boosted target should emit 0 at some positions only"
    s = summarize(decodes, K)
    rounds = [r for d in decodes for r in d.rounds]
    assert s["tau"] == pytest.approx(sum(rounds) / len(rounds)) and s["rounds"] == len(rounds)
    assert 1.0 < s["tau"] < K and len({r for r in rounds}) >= 2
    assert sum(s["histogram"].values()) == len(rounds)
    first = s["acceptance_per_position"][0]
    assert first == pytest.approx(sum(1 for r in rounds if r >= 2) / len(rounds), abs=1e-4)
    assert s["acceptance_per_position"] == sorted(s["acceptance_per_position"], reverse=True)


def test_when_the_target_always_agrees_every_block_is_accepted_whole(tmp_path_factory) -> None:
    path = _target_dir(tmp_path_factory, "zero")
    f = next(path.glob("*.safetensors"))
    w = load_file(str(f))
    w["model.norm.weight"].zero_()  # every target logit 0: its greedy token is always 0
    save_file(w, str(f), metadata={"format": "pt"})
    target, drafter = _pair(path, zero_drafter=True)
    d = decode(target, drafter, [4, 5, 6], max_new=49)
    assert d.tokens == [0] * 49 and d.rounds == [K, K, K]
    s = summarize([d], K)
    assert s["tau"] == K and s["histogram"][str(K)] == 3 and s["acceptance_per_position"] == [1.0] * (K - 1)


def test_sampled_verification_is_the_same_in_both_loops_for_one_seed(random_pair) -> None:
    target, drafter = random_pair
    a = decode(target, drafter, PROMPTS[0], max_new=30, temperature=0.8, seed=7)
    b = decode_plain(target, drafter, PROMPTS[0], max_new=30, temperature=0.8, seed=7)
    assert a.tokens == b.tokens and a.rounds == b.rounds
    c = decode(target, drafter, PROMPTS[0], max_new=30, temperature=0.8, seed=8)
    assert c.tokens != a.tokens  # the seed decides the samples
    assert all(1 <= r <= K for r in a.rounds)
