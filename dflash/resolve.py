"""What a job config resolves to on this machine, decided without building a model: device,
attention backend, kernel strictness, rows per length bucket and the captured target layers.

The trainer, the launcher, the fingerprint and the config check (dflash.check) all ask here, so
they cannot disagree. Deliberately light (no transformers import): dflash.check runs it before
anything starts.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash.config import JobConfig
from dflash.data import bucket_rows
from dflash.errors import ConfigError


def resolve_device(cfg: JobConfig) -> torch.device:
    if cfg.run.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.run.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device", "is cuda but no CUDA device is visible; use cpu or auto")
    return torch.device(cfg.run.device)


def resolve_backend(cfg: JobConfig, device: torch.device) -> str:
    """flex on GPU, sdpa on CPU (FlexAttention has no backward on CPU)."""
    backend = cfg.attention.backend
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type == "cpu":
        raise ConfigError(
            "attention.backend", "flex cannot train on CPU (no backward there); use sdpa or auto"
        )
    return backend


def resolve_strict(cfg: JobConfig, device: torch.device) -> bool:
    s = str(cfg.attention.strict_kernels).lower()
    return device.type == "cuda" if s == "auto" else s == "true"


def rows_for_length(cfg: JobConfig, length: int) -> int:
    """Rows of every batch of one length bucket: batches are padded up to it so each bucket is one shape."""
    return bucket_rows(cfg.train.token_budget, cfg.train.max_batch_size, length)


def default_target_layer_ids(n_target_layers: int, k: int) -> list[int]:
    """k ids evenly spaced from 1 to n-3 (the published choice), rounded, deduplicated, sorted."""
    start = 1 if n_target_layers > 1 else 0
    end = max(start, n_target_layers - 3)
    if k == 1:
        return [n_target_layers // 2]  # the reference's choice for a single layer: the middle one
    return sorted({round(start + i * (end - start) / (k - 1)) for i in range(k)})


def target_layer_ids(drafter: Any, n_target_layers: int) -> list[int]:
    """The target layers a DrafterConfig captures (sorted), checked against the target's depth."""
    ids = list(drafter.target_layer_ids) or default_target_layer_ids(
        n_target_layers, drafter.num_target_layers
    )
    for i in ids:
        if not 0 <= i < n_target_layers:
            raise ConfigError(
                "drafter.target_layer_ids",
                f"layer {i} does not exist: the target has {n_target_layers} layers (0..{n_target_layers - 1})",
            )
    if len(set(ids)) != len(ids):
        raise ConfigError("drafter.target_layer_ids", f"has duplicates: {ids}")
    return sorted(ids)
