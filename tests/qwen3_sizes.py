"""Target sizes the tests share (plain data: the runner's tests import it too, without torch)."""

from __future__ import annotations

QWEN3_8B = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "layer_types": ["full_attention"] * 36,
    "max_window_layers": 36,
}
"""Qwen3-8B's sizes (its config.json): every shipped drafter.mask_token_id is a row of its vocabulary,
and its head dim is one the job's CUDA kernels take."""
