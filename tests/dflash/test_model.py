"""The drafter at tiny size on CPU: backends agree, frozen target weights stay out, config round-trips."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

from dflash.config import DrafterConfig
from dflash.errors import ConfigError
from dflash.step.model import DFlashDrafter, DrafterSpec, default_target_layer_ids, resolve_spec

S = 23
ANCHORS = torch.tensor([[0, 5, 11, 22], [2, 9, -1, -1]])
SEQ_LENS = torch.tensor([23, 14])


def tiny_target(layers: int = 8) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )


def tiny_spec(**overrides) -> DrafterSpec:
    cfg = DrafterConfig(num_layers=3, block_size=4, num_target_layers=3, sliding_window=6, **overrides)
    return resolve_spec(cfg, tiny_target(), mask_token_id=60)


def build(spec: DrafterSpec, backend: str, seed: int = 0) -> DFlashDrafter:
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
    head = torch.randn(spec.vocab_size, spec.hidden_size, generator=g)
    torch.manual_seed(seed)
    return DFlashDrafter(spec, embed, head, backend=backend, sdpa_chunk_blocks=3)


def batch(spec: DrafterSpec):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 60, (2, S), generator=g)
    feats = torch.randn(2, S, len(spec.target_layer_ids) * spec.target_hidden_size, generator=g)
    return ids, feats


@pytest.mark.parametrize("sliding_block_causal", [False, True])
def test_sdpa_and_eager_drafters_agree_on_hidden_states_and_grads(sliding_block_causal):
    spec = tiny_spec(sliding_block_causal=sliding_block_causal)
    ids, feats = batch(spec)
    outs = []
    for backend in ("eager", "sdpa"):
        model = build(spec, backend)
        hidden = model(ids, feats, ANCHORS, SEQ_LENS)
        assert hidden.shape == (2, 4, 4, spec.hidden_size)
        logits = model.lm_head(hidden.flatten(0, 2))
        loss = torch.nn.functional.cross_entropy(logits, torch.arange(logits.shape[0]) % spec.vocab_size)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        outs.append((hidden.detach(), grads))
    (h_ref, g_ref), (h, g) = outs
    assert torch.isfinite(h).all()
    if sliding_block_causal:  # the last token of a block sees its whole block either way; the first differs
        bidi = build(tiny_spec(), "eager")(ids, feats, ANCHORS, SEQ_LENS).detach()
        assert not torch.allclose(bidi[:, :, 0], h_ref[:, :, 0])
    torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=1e-5)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(
            g[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def published_forward(model: DFlashDrafter, ids, feats, anchors, seq_lens) -> torch.Tensor:
    """The published DFlash layer, written out: each layer's k_proj and v_proj over the rows
    [context; normed block] (the model computes the context's part of all layers in one product).
    The layers' inputs are the model's own (layer_inputs)."""
    from dflash.step.model import norm_rope

    B, A, K = *anchors.shape, model.spec.block_size
    windows, plans, ctx, h, rope_q, rope_kv = model.layer_inputs(ids, feats, anchors, seq_lens)
    for layer, window in zip(model.layers, windows, strict=True):
        att, x = layer.self_attn, layer.input_layernorm(h)
        kv_in = torch.cat([ctx, x], dim=1)
        L = kv_in.shape[1]
        q = norm_rope(att.q_proj(x).view(B, A * K, att.heads, att.head_dim), att.q_norm, rope_q, False)
        k = norm_rope(att.k_proj(kv_in).view(B, L, att.kv_heads, att.head_dim), att.k_norm, rope_kv, False)
        v = att.v_proj(kv_in).view(B, L, att.kv_heads, att.head_dim).transpose(1, 2)
        o = model.backend.attend(q, k, v.contiguous(), plans[window])
        h = h + att.o_proj(o.transpose(1, 2).reshape(B, A * K, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.norm(h).view(B, A, K, -1)


def test_the_context_keys_and_values_in_one_product_are_the_published_layers():
    """context_kv (every layer's context keys and values in one product) against the published
    layer written out, in float64: the same hidden states and the same gradients for every
    parameter, each layer's k_proj and v_proj included."""
    spec = tiny_spec()
    model = build(spec, "eager").double()
    ids, feats = batch(spec)
    feats = feats.double()
    results = []
    for forward in (model.forward, lambda *a: published_forward(model, *a)):
        model.zero_grad()
        hidden = forward(ids, feats, ANCHORS, SEQ_LENS)
        (hidden * torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).view_as(hidden)).sum().backward()
        results.append((hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (h, g), (h_ref, g_ref) = results
    torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=1e-10)
    assert g.keys() == g_ref.keys() and any("k_proj" in n for n in g)
    for name in g:
        assert g[name].abs().max() > 0, name
        torch.testing.assert_close(
            g[name], g_ref[name], atol=1e-12, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_context_features_matter_only_before_the_anchor():
    """Changing target features at or after a block's anchor must not change that block."""
    spec = tiny_spec()
    model = build(spec, "sdpa").eval()
    ids, feats = batch(spec)
    base = model(ids, feats, ANCHORS, SEQ_LENS)
    feats2 = feats.clone()
    feats2[0, 11:] += 5.0
    out = model(ids, feats2, ANCHORS, SEQ_LENS)
    torch.testing.assert_close(out[0, :3], base[0, :3])  # anchors 0, 5, 11 only see < 11
    assert not torch.allclose(out[0, 3], base[0, 3])  # anchor 22 sees 11..21 (full layer)


def test_frozen_target_weights_are_not_trained_or_stored():
    spec = tiny_spec()
    model = build(spec, "sdpa")
    sd = model.trainable_state_dict()
    assert not any("embed" in k or "lm_head" in k or "rotary" in k for k in sd), sorted(sd)
    assert set(sd) == {n for n, _ in model.named_parameters()}
    assert "fc.weight" in sd and "layers.2.self_attn.k_norm.weight" in sd and "norm.weight" in sd
    assert sd["fc.weight"].shape == (spec.hidden_size, 3 * spec.target_hidden_size)
    ids, feats = batch(spec)
    model(ids, feats, ANCHORS, SEQ_LENS).sum().backward()
    assert model.embed_weight_VH.grad is None and not model.embed_weight_VH.requires_grad
    assert model.lm_head_weight_VH.grad is None


def test_noise_only_in_training():
    spec = tiny_spec()
    model = build(spec, "sdpa")
    ids, feats = batch(spec)
    model.eval()
    torch.testing.assert_close(
        model(ids, feats, ANCHORS, SEQ_LENS, noise_std=0.5), model(ids, feats, ANCHORS, SEQ_LENS)
    )
    model.train()
    assert not torch.allclose(
        model(ids, feats, ANCHORS, SEQ_LENS, noise_std=0.5), model(ids, feats, ANCHORS, SEQ_LENS)
    )


def test_hf_config_round_trip():
    spec = tiny_spec()
    d = json.loads(json.dumps(spec.to_hf_config()))
    assert d["architectures"] == ["DFlashDraftModel"]
    assert d["dflash_config"] == {"mask_token_id": 60, "target_layer_ids": spec.target_layer_ids}
    assert d["block_size"] == 4 and d["num_hidden_layers"] == 3
    # Bidirectional inside blocks on every layer: engines must not assume causal sliding layers.
    assert d["is_causal"] is False
    assert DrafterSpec.from_hf_config(d) == spec
    # Causal sliding layers are the engines' reading of a config without is_causal.
    causal = dataclasses.replace(spec, sliding_block_causal=True)
    d_causal = causal.to_hf_config()
    assert "is_causal" not in d_causal and DrafterSpec.from_hf_config(d_causal) == causal
    with pytest.raises(ConfigError, match="is_causal"):
        DrafterSpec.from_hf_config({**d, "is_causal": True})
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(ConfigError, match="dflash_config.mask_token_id"):
        DrafterSpec.from_hf_config(d)


def test_resolve_spec_defaults():
    spec = tiny_spec()
    assert spec.target_layer_ids == [1, 3, 5]  # evenly spaced from 1 to 8-3
    assert spec.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim) == (
        32,
        4,
        2,
        8,
    )
    assert spec.target_hidden_size == 32 and spec.vocab_size == 61
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(4, 5) == [1]
    assert default_target_layer_ids(24, 1) == [12], "one layer: the middle one, as the reference picks"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"target_layer_ids": [1, 8]}, "drafter.target_layer_ids"),
        ({"hidden_size": 64}, "drafter.hidden_size"),
        ({"num_key_value_heads": 3}, "drafter.num_key_value_heads"),
    ],
)
def test_resolve_spec_rejects_impossible_values(overrides, key):
    with pytest.raises(ConfigError) as e:
        tiny_spec(**overrides)
    assert e.value.key == key


def test_resolve_spec_rejects_mask_token_outside_vocab():
    with pytest.raises(ConfigError) as e:
        resolve_spec(DrafterConfig(), tiny_target(), mask_token_id=61)
    assert e.value.key == "drafter.mask_token_id"


def test_bf16_autocast_forward_backward_with_sdpa_and_flex_forward():
    """Mixed precision as on the GPU: q/k norms return float32 under autocast; attention must still run."""
    spec = tiny_spec()
    model = build(spec, "sdpa")
    ids, feats = batch(spec)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(ids, feats, ANCHORS, SEQ_LENS)
        logits = model.lm_head(hidden.flatten(0, 2))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
