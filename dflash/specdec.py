"""Speculative decoding with a DFlash drafter and its target, written here: what a served drafter
does, measured the way engines and the DFlash paper count it.

Each round: the drafter proposes a block from the target's features of every verified token (one
drafter pass: [last token, mask x (K-1)] anchored after them, as in training); the target verifies
the block in one forward ([last token, draft 1..K-1]); the longest prefix of the draft that the
target agrees with is accepted, plus the target's own next token after it. So a round yields m + 1
tokens for m accepted draft tokens, and tau (the mean acceptance length) is tokens per target
verification, the target's token counted: 1.0 when no draft token is ever accepted, at most K.

Two implementations of the same loop:
  - `decode_plain`: no caches. Each round runs the target over the whole sequence so far plus the
    draft, and the drafter's training forward over the whole context. Slow and obviously right.
  - `decode`: the target with its KV cache (cropped to the accepted tokens after each round) and
    the drafter with its context rows (each position's keys and values, DFlashDrafter.context_rows;
    only the accepted positions' rows are appended). The one `python -m dflash.eval` runs.
Greedy verification is lossless: the output is the target's own greedy decode (`greedy`), which
the tests check. With temperature > 0, verification samples: a draft token d is accepted with
probability min(1, p(d) / q(d)) (p the target's, q the drafter's distribution at that position),
else the target's token is drawn from max(p - q, 0) renormalised; after an accepted block, from p.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from dflash.step.model import DFlashDrafter


class Target:
    """The target as decoding needs it: next-token logits and the drafter's features (the outputs of
    the drafter's target layers, before the final norm, concatenated in target_layer_ids order, as
    dflash.target.TargetCapture captures them for training), with or without a KV cache."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        from dflash.target import _decoder_layers

        self.model = model.eval()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layers = _decoder_layers(model.model if hasattr(model, "model") else model, config.num_hidden_layers)
        self.layer_ids = list(layer_ids)
        self._out: dict[int, Tensor] = {}
        for slot, layer_id in enumerate(self.layer_ids):
            layers[layer_id].register_forward_hook(self._hook(slot))
        self.device = next(model.parameters()).device

    def _hook(self, slot: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            self._out[slot] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def __call__(self, ids_BL: Tensor, cache: Any = None) -> tuple[Tensor, Tensor]:
        """(logits [B, L, V] in float32, features [B, L, k*H]) of ids following the cache's tokens."""
        with warnings.catch_warnings():  # transformers 5.x renames past_key_values; both spellings work
            warnings.simplefilter("ignore", FutureWarning)
            out = self.model(input_ids=ids_BL, past_key_values=cache, use_cache=cache is not None)
        feats = torch.cat([self._out[i] for i in range(len(self.layer_ids))], dim=-1)
        self._out.clear()
        return out.logits.float(), feats

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


@dataclass
class Decoded:
    """One prompt's decode: the new tokens (at most max_new, cut after an eos) and, per target
    verification, how many tokens it yielded (accepted draft tokens + the target's one)."""

    tokens: list[int]
    rounds: list[int] = field(default_factory=list)
    seconds: float = 0.0


def _pick(logits_V: Tensor, temperature: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits_V.argmax())
    probs = torch.softmax(logits_V / temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def _verify(
    draft: list[int],
    draft_logits_KV: Tensor | None,
    target_logits_KV: Tensor,
    temperature: float,
    gen: torch.Generator | None,
) -> tuple[int, int]:
    """(m accepted draft tokens, the target's token after them). target_logits row j is the target's
    distribution for the token after block position j (row 0 follows the last verified token)."""
    if temperature <= 0:
        target = target_logits_KV.argmax(dim=-1).tolist()
        m = 0
        while m < len(draft) and draft[m] == target[m]:
            m += 1
        return m, int(target[m])
    assert draft_logits_KV is not None
    p = torch.softmax(target_logits_KV.cpu() / temperature, dim=-1)
    q = torch.softmax(draft_logits_KV.cpu().float() / temperature, dim=-1)
    for j, d in enumerate(draft):
        u = float(torch.rand((), generator=gen))
        if u * float(q[j, d]) <= float(p[j, d]):  # accepted with probability min(1, p/q)
            continue
        residual = (p[j] - q[j]).clamp(min=0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        return j, int(torch.multinomial(dist, 1, generator=gen))
    return len(draft), int(torch.multinomial(p[len(draft)], 1, generator=gen))


def _finish(out: Decoded, new: list[int], max_new: int, eos: int | None) -> bool:
    """Append a round's tokens; True when the decode is done (max_new reached or an eos seen)."""
    for t in new:
        out.tokens.append(t)
        if (eos is not None and t == eos) or len(out.tokens) >= max_new:
            return True
    return False


def _draft(drafter: DFlashDrafter, hidden_KH: Tensor, temperature: float, gen: torch.Generator | None):
    logits = drafter.lm_head(hidden_KH[1:]).float()
    return [_pick(row, temperature, gen) for row in logits], logits


@torch.no_grad()
def decode(
    target: Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    *,
    max_new: int,
    eos: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Decoded:
    """Speculative decoding with the target's KV cache and the drafter's context rows (module doc)."""
    dev = target.device
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, feats = target(torch.tensor([prompt], device=dev), cache)
    rows = drafter.context_rows(feats.to(drafter.fc.weight.dtype))
    last = _pick(logits[0, -1], temperature, gen)
    out = Decoded([])
    done = _finish(out, [last], max_new, eos)
    while not done:
        hidden = drafter.draft_block(rows, torch.tensor([last], device=dev))[0]
        draft, draft_logits = _draft(drafter, hidden, temperature, gen)
        logits, feats = target(torch.tensor([[last, *draft]], device=dev), cache)
        m, nxt = _verify(draft, draft_logits, logits[0], temperature, gen)
        if len(draft) > m:  # keep the verified tokens (`last` and the accepted ones): crop the rest
            cache.crop(m - len(draft))
        rows = torch.cat([rows, drafter.context_rows(feats[:, : m + 1].to(rows.dtype))], dim=1)
        out.rounds.append(m + 1)
        done = _finish(out, [*draft[:m], nxt], max_new, eos)
        last = nxt
    out.seconds = time.perf_counter() - t0
    return out


@torch.no_grad()
def decode_plain(
    target: Target,
    drafter: DFlashDrafter,
    prompt: list[int],
    *,
    max_new: int,
    eos: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
) -> Decoded:
    """The same loop without caches: every round the target runs over the whole sequence and the
    draft, and the drafter's training forward over the whole context (module doc)."""
    dev = target.device
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    t0 = time.perf_counter()
    seq = list(prompt)
    logits, feats = target(torch.tensor([seq], device=dev))
    last = _pick(logits[0, -1], temperature, gen)
    out = Decoded([])
    done = _finish(out, [last], max_new, eos)
    while not done:
        n = len(seq)  # `last` sits at position n; the context is positions 0..n-1
        ids = torch.tensor([[*seq, last]], device=dev)
        hidden_F = torch.cat([feats[:, :n], feats.new_zeros(1, 1, feats.shape[-1])], dim=1)
        hidden = drafter(
            ids,
            hidden_F.to(drafter.fc.weight.dtype),
            torch.tensor([[n]], device=dev),
            torch.tensor([n + 1], device=dev),
        )[0, 0]
        draft, draft_logits = _draft(drafter, hidden, temperature, gen)
        logits, feats = target(torch.tensor([[*seq, last, *draft]], device=dev))
        m, nxt = _verify(draft, draft_logits, logits[0, n:], temperature, gen)
        seq += [last, *draft[:m]]
        out.rounds.append(m + 1)
        done = _finish(out, [*draft[:m], nxt], max_new, eos)
        last = nxt
    out.seconds = time.perf_counter() - t0
    return out


@torch.no_grad()
def greedy(target: Target, prompt: list[int], *, max_new: int, eos: int | None = None) -> Decoded:
    """The target alone, greedy, with its KV cache: what lossless speculative decoding must equal,
    and the baseline its speed-up is against."""
    dev = target.device
    t0 = time.perf_counter()
    cache = target.new_cache()
    logits, _ = target(torch.tensor([prompt], device=dev), cache)
    out = Decoded([])
    while True:
        t = int(logits[0, -1].argmax())
        if _finish(out, [t], max_new, eos):
            break
        logits, _ = target(torch.tensor([[t]], device=dev), cache)
    out.seconds = time.perf_counter() - t0
    return out


def summarize(decodes: list[Decoded], block_size: int, baseline_s: float | None = None) -> dict[str, Any]:
    """tau, its histogram (rounds per acceptance length 1..K), per block position the share of rounds
    whose draft token there was accepted, tokens and seconds."""
    rounds = [r for d in decodes for r in d.rounds]
    tokens = sum(len(d.tokens) for d in decodes)
    seconds = sum(d.seconds for d in decodes)
    hist = [sum(1 for r in rounds if r == n) for n in range(1, block_size + 1)]
    per_pos = [
        sum(1 for r in rounds if r - 1 >= j) / len(rounds) if rounds else 0.0 for j in range(1, block_size)
    ]
    out: dict[str, Any] = {
        "tau": sum(rounds) / len(rounds) if rounds else None,
        "rounds": len(rounds),
        "histogram": {str(n): c for n, c in zip(range(1, block_size + 1), hist, strict=True)},
        "acceptance_per_position": [round(a, 4) for a in per_pos],
        "prompts": len(decodes),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds else None,
    }
    if baseline_s:
        out["target_alone_tokens_per_s"] = round(tokens / baseline_s, 1)
        out["speedup"] = round(baseline_s / seconds, 3) if seconds else None
    return out
