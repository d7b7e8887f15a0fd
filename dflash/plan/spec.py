"""The drafter's resolved sizes (`DrafterSpec`) and how they follow from the config and the target's
config (`resolve_spec`), apart from the model: the launcher, the fingerprint and export decide sizes
without importing transformers' Qwen3 modeling (about 3 s of CPU per process) or building anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from dflash.errors import ConfigError

if TYPE_CHECKING:
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(kw_only=True, slots=True)
class DrafterSpec:
    """Fully resolved drafter sizes: what config.json stores (see to_hf_config)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    layer_types: list[str]
    sliding_window: int
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_hidden_size: int
    target_num_hidden_layers: int = 0
    """Layers of the target (engines use it to re-derive layer ids); 0 = unknown."""
    hidden_act: str = field(default="silu")
    sliding_block_causal: bool = False
    """Sliding layers causal inside a block (see DrafterConfig.sliding_block_causal)."""

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(
                "drafter.layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise ConfigError("drafter.layer_types", f"entries must be one of {LAYER_TYPES}, got {t!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "drafter.num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                "drafter.mask_token_id",
                f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})",
            )
        if not self.target_layer_ids:
            raise ConfigError("drafter.target_layer_ids", "is empty")

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def to_hf_config(self) -> dict[str, Any]:
        """config.json in the layout DFlash drafters are published and served with: a Qwen3-style
        config (model_type qwen3, num_hidden_layers, layer_types, sliding_window, sizes) with
        architectures ["DFlashDraftModel"], top-level block_size, and dflash_config{mask_token_id,
        target_layer_ids}, which is where SGLang and vLLM read the DFlash fields. num_target_layers
        is the target's depth (as in released checkpoints); target_hidden_size is ours (fc input is
        len(target_layer_ids) * target_hidden_size) and harmless to engines that ignore it."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "max_window_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "num_target_layers": self.target_num_hidden_layers,
            "target_hidden_size": self.target_hidden_size,
            # How attention inside a block was trained. Absent, engines (z-lab's reference, vLLM,
            # SGLang) treat sliding layers as causal inside the block and full layers as
            # bidirectional: exactly sliding_block_causal. Otherwise every layer was bidirectional,
            # which `is_causal: false` tells the engines that read it.
            **({} if self.sliding_block_causal else {"is_causal": False}),
        }

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> DrafterSpec:
        def need(key: str, where: dict[str, Any] = d, prefix: str = "") -> Any:
            if key not in where:
                raise ConfigError(
                    f"config.json:{prefix}{key}", "is missing; is this a DFlash drafter config?"
                )
            return where[key]

        dflash = need("dflash_config")
        rope_theta = d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta"))
        if rope_theta is None:
            raise ConfigError(
                "config.json:rope_theta", "is missing (neither rope_theta nor rope_parameters.rope_theta)"
            )
        num_layers = need("num_hidden_layers")
        if d.get("is_causal") is True:
            raise ConfigError(
                "config.json:is_causal",
                "is true (causal attention inside blocks on every layer); DFlash drafters here train "
                "bidirectional blocks, optionally causal on sliding layers (drafter.sliding_block_causal)",
            )
        return cls(
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"),
            head_dim=d.get("head_dim") or need("hidden_size") // need("num_attention_heads"),
            num_layers=num_layers,
            layer_types=list(d.get("layer_types") or ["full_attention"] * num_layers),
            sliding_window=d.get("sliding_window") or 0,
            block_size=need("block_size"),
            target_layer_ids=list(need("target_layer_ids", dflash, "dflash_config.")),
            mask_token_id=need("mask_token_id", dflash, "dflash_config."),
            vocab_size=need("vocab_size"),
            rms_norm_eps=need("rms_norm_eps"),
            rope_theta=float(rope_theta),
            max_position_embeddings=need("max_position_embeddings"),
            target_hidden_size=d.get("target_hidden_size") or need("hidden_size"),
            target_num_hidden_layers=d.get("num_target_layers") or 0,
            hidden_act=d.get("hidden_act", "silu"),
            # The engines' reading of a config without is_causal (see to_hf_config).
            sliding_block_causal="is_causal" not in d,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def qwen3_config(self) -> Qwen3Config:
        """The transformers config the reused Qwen3 blocks (MLP, rotary) are built from."""
        from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
        )


def _target_rope_theta(target_config: Any) -> float:
    params = getattr(target_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(target_config, "rope_theta", 10000.0))


def drafter_head_dim(
    cfg: Any, hidden: int, target_heads: int | None, target_head_dim: int | None
) -> int | None:
    """The drafter's head dim: drafter.head_dim, else the target's, else hidden / heads (None where
    the heads are unknown too: dflash.check reads the target's config.json alone)."""
    heads = cfg.num_attention_heads or target_heads
    return (
        cfg.head_dim
        or (int(target_head_dim) if target_head_dim else None)
        or (hidden // heads if heads else None)
    )


def resolve_spec(cfg: Any, target_config: Any, mask_token_id: int) -> DrafterSpec:
    """DrafterConfig (0 / empty = take it from the target) + the target's PretrainedConfig -> sizes."""
    n_target = int(target_config.num_hidden_layers)
    target_hidden = int(target_config.hidden_size)
    ids = target_layer_ids(cfg, n_target)
    hidden = cfg.hidden_size or target_hidden
    if hidden != target_hidden:
        raise ConfigError(
            "drafter.hidden_size",
            f"{hidden} differs from the target's {target_hidden}; the drafter shares the target's embedding "
            "and LM head, so leave it 0 (= the target's)",
        )
    heads = cfg.num_attention_heads or int(target_config.num_attention_heads)
    kv_heads = cfg.num_key_value_heads or int(getattr(target_config, "num_key_value_heads", None) or heads)
    head_dim = drafter_head_dim(cfg, hidden, heads, getattr(target_config, "head_dim", None))
    layer_types = drafter_layer_types(cfg)
    vocab = int(target_config.vocab_size)  # DrafterSpec checks mask_token_id against it
    return DrafterSpec(
        hidden_size=hidden,
        intermediate_size=cfg.intermediate_size or int(target_config.intermediate_size),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        num_layers=cfg.num_layers,
        layer_types=layer_types,
        sliding_window=cfg.sliding_window,
        sliding_block_causal=cfg.sliding_block_causal,
        block_size=cfg.block_size,
        target_layer_ids=ids,
        mask_token_id=mask_token_id,
        vocab_size=vocab,
        rms_norm_eps=float(getattr(target_config, "rms_norm_eps", 1e-6)),
        rope_theta=_target_rope_theta(target_config),
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 32768)),
        target_hidden_size=target_hidden,
        target_num_hidden_layers=n_target,
        hidden_act=str(getattr(target_config, "hidden_act", "silu")),
    )


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


def drafter_layer_types(drafter: Any) -> list[str]:
    """A DrafterConfig's layer types: as listed, or all sliding but the last (the published layout)."""
    return list(drafter.layer_types) or ["sliding_attention"] * (drafter.num_layers - 1) + ["full_attention"]
