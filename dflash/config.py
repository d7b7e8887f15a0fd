"""Job configuration: nested dataclasses loaded from TOML, with `--set key=value` overrides.

Precedence, spelled out once: `--set` overrides > the TOML file > the defaults below.
Unknown keys and bad values raise ConfigError naming the dotted key (load_config, the job: the first
one); collect_config gathers them all instead (dflash.check, before a job starts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from dflash.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "dflash"
    """Run name; the run id is `<name>-<timestamp>` unless --run-dir is given."""
    seed: int = 0
    """Seed for model init, anchor sampling and data order."""
    runs_root: str = "runs"
    """Directory under which run directories are created."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    status_interval_s: float = 10.0
    """Seconds between status lines / metrics.jsonl records."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError("run.device", f"must be cpu, cuda or auto, got {self.device!r}")
        if self.status_interval_s <= 0:
            raise ConfigError("run.status_interval_s", "must be > 0")


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    path: str = ""
    """Local Hugging Face causal-LM directory (safetensors). `tiny` builds a tiny random Qwen3
    in the run directory (the CPU demo and tests) and loads it through the same path."""
    dtype: str = "bfloat16"
    """Weights dtype: bfloat16 | float16 | float32."""
    compile: bool = False
    """torch.compile each decoder layer of the target (regional; one graph per length bucket)."""
    tiny_layers: int = 8
    """Layers of the `tiny` target."""
    tiny_hidden: int = 64
    """Hidden size of the `tiny` target."""

    def __post_init__(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError("target.dtype", f"must be bfloat16, float16 or float32, got {self.dtype!r}")
        # Required values are checked last: collect_config resets a bad key to its default and
        # retries, which a missing required value ends, so every other check must have run first.
        if not self.path:
            raise ConfigError(
                "target.path", "is required: a local HF model directory, or `tiny` for the demo"
            )


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    num_layers: int = 5
    """Drafter decoder layers."""
    block_size: int = 16
    """Tokens proposed per pass: the anchor token followed by block_size-1 mask tokens."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Target layers whose hidden states are captured; empty = k ids evenly spaced in [1, n-3]."""
    num_target_layers: int = 5
    """k, used when target_layer_ids is empty."""
    mask_token_id: int = -1
    """Mask token id; -1 = take it from the tokenizer (an error if it has none)."""
    layer_types: list[str] = field(default_factory=list)
    """sliding_attention | full_attention per layer; empty = all sliding but the last."""
    sliding_window: int = 2048
    """Window (tokens of context before the anchor) of sliding layers."""
    sliding_block_causal: bool = False
    """Sliding layers attend causally inside each block (full layers stay bidirectional). Off: every
    layer is bidirectional inside a block, and config.json says `is_causal: false`. On: the
    convention engines assume when a config has no `is_causal` (SGLang always serves sliding
    layers this way), so the drafter is served as it was trained everywhere."""
    hidden_size: int = 0
    """0 = the target's. Likewise for the sizes below."""
    intermediate_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    noise_std: float = 0.0
    """Peak std of Gaussian noise added to the fused target features (0 = off)."""
    noise_schedule: str = "cosine"
    """constant | linear | cosine decay of the noise std over training."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ConfigError("drafter.num_layers", "must be >= 1")
        if self.block_size < 2:
            raise ConfigError("drafter.block_size", "must be >= 2")
        if self.num_target_layers < 1:
            raise ConfigError("drafter.num_target_layers", "must be >= 1")
        for t in self.layer_types:
            if t not in ("sliding_attention", "full_attention"):
                raise ConfigError(
                    "drafter.layer_types", f"entries must be sliding_attention or full_attention, got {t!r}"
                )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                "drafter.layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.sliding_window < 1:
            raise ConfigError("drafter.sliding_window", "must be >= 1")
        if self.noise_std < 0:
            raise ConfigError("drafter.noise_std", "must be >= 0")
        if self.noise_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError("drafter.noise_schedule", "must be constant, linear or cosine")


@dataclass(kw_only=True, slots=True)
class AttentionConfig:
    backend: str = "auto"
    """flex | sdpa | auto (flex on GPU, sdpa on CPU: flex has no backward on CPU)."""
    compile: bool = True
    """torch.compile the attention kernel (flex) and create_block_mask."""
    strict_kernels: str = "auto"
    """true | false | auto (true on GPU): stop the worker on a degraded kernel."""
    sdpa_chunk_blocks: int = 64
    """SDPA backend: blocks per chunk for the full-attention layer."""

    def __post_init__(self) -> None:
        if self.backend not in ("flex", "sdpa", "auto"):
            raise ConfigError("attention.backend", f"must be flex, sdpa or auto, got {self.backend!r}")
        if str(self.strict_kernels) not in ("true", "false", "auto", "True", "False"):
            raise ConfigError("attention.strict_kernels", "must be true, false or auto")
        if self.sdpa_chunk_blocks < 1:
            raise ConfigError("attention.sdpa_chunk_blocks", "must be >= 1")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    path: str = ""
    """JSONL file with `text` or chat `messages` records; `demo` = the built-in demo corpus."""
    tokenizer: str = "target"
    """target (AutoTokenizer from the target directory) | byte (built-in byte-level)."""
    max_seq_len: int = 4096
    """Longer sequences are truncated."""
    min_seq_len: int = 32
    """Shorter sequences are skipped (counted)."""
    cache_dir: str = ""
    """Tokenized-data cache; empty = <runs_root>/.tokcache."""
    bucket_multiple: int = 256
    """Sequence lengths are padded up to a multiple of this: bounds padding and distinct shapes."""
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.tokenizer not in ("target", "byte"):
            raise ConfigError("data.tokenizer", f"must be target or byte, got {self.tokenizer!r}")
        if self.max_seq_len < 8:
            raise ConfigError("data.max_seq_len", "must be >= 8")
        if self.bucket_multiple < 1:
            raise ConfigError("data.bucket_multiple", "must be >= 1")
        if not self.path:  # last, as in TargetConfig
            raise ConfigError("data.path", "is required: a JSONL file, or `demo`")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    total_steps: int = 1000
    """Optimizer steps."""
    lr: float = 6e-4
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0
    token_budget: int = 49152
    """Max sequence tokens (padded) per drafter batch."""
    max_batch_size: int = 64
    num_anchors: int = 512
    """Anchors sampled per sequence among loss positions."""
    gamma: float = 7.0
    """Loss weight of block position k is exp(-(k-1)/gamma)."""
    checkpoint_every: int = 500
    keep_last: int = 3
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    epochs: float = 1.0
    """Used for the ETA/epoch estimate only; the run stops at total_steps."""
    loss_chunk_tokens: int = 8192
    """Block tokens per LM-head/cross-entropy chunk (bounds the logits memory)."""

    def __post_init__(self) -> None:
        for name in (
            "total_steps",
            "token_budget",
            "max_batch_size",
            "num_anchors",
            "checkpoint_every",
            "keep_last",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}", "must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError("train.lr", "must be a positive number")
        if self.warmup_steps < 0:
            raise ConfigError("train.warmup_steps", "must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError("train.betas", "must be two numbers in [0, 1)")
        if self.gamma <= 0:
            raise ConfigError("train.gamma", "must be > 0")
        if self.grad_clip <= 0:
            raise ConfigError("train.grad_clip", "must be > 0")


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    targets: int = 1
    """Target worker processes (T)."""
    drafters: int = 1
    """Drafter worker processes (D), one data-parallel group."""
    target_devices: list[str] = field(default_factory=list)
    """Device per target worker, e.g. ["cuda:0", ...]; empty = derived from run.device."""
    drafter_devices: list[str] = field(default_factory=list)
    """Device per local drafter worker; empty = derived."""
    prefetch_depth: int = 50
    """Data batches each target prefetches (q_pre)."""
    queue_depth: int = 8
    """Hidden-state batches in the shared transport (q_hs capacity)."""
    max_restarts: int = 3
    """Drafter-group restarts (torchrun --max-restarts)."""
    restart_targets: bool = False
    """Restart a dead target worker instead of stopping the job."""
    nnodes: int = 1
    rdzv_endpoint: str = ""
    """HOST:PORT of host 0's rendezvous, reachable from every host; required when nnodes > 1."""
    rdzv_id: str = ""
    """Empty = run.name: identical on every host (run directories are per host)."""
    rdzv_timeout_s: int = 600
    """How long the drafter group waits for every host to join before it fails with an error."""
    slot_mb: int = 0
    """Shared-memory slot size in MiB; 0 = derived from the batch shape."""

    def __post_init__(self) -> None:
        for name in ("targets", "drafters", "prefetch_depth", "queue_depth", "nnodes", "rdzv_timeout_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"pipeline.{name}", "must be >= 1")
        if self.max_restarts < 0:
            raise ConfigError("pipeline.max_restarts", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class JobConfig:
    run: RunConfig = field(default_factory=RunConfig)
    target: TargetConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a table, got {type(value).__name__}")
        return _build(hint, value, key)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            where = f"{prefix}.{k}" if prefix else k
            raise ConfigError(where, f"unknown key; known keys here: {', '.join(sorted(names))}")
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            where = f"{prefix}.{missing[0]}" if prefix else missing[0]
            raise ConfigError(where, "is required") from e
        raise


def _parse_value(text: str) -> Any:
    """A --set value: TOML/JSON literal when it parses as one, else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "--set takes key=value, e.g. --set train.total_steps=100")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, "is not a table")
        node[parts[-1]] = _parse_value(text.strip())
    return data


def read_config_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(str(p), "config file not found; pass a TOML file such as configs/demo-cpu.toml")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(p), f"is not valid TOML: {e}") from e


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, data: dict[str, Any] | None = None
) -> JobConfig:
    if data is None:
        data = {}
    if path is not None:
        data = read_config_file(path)
    data = apply_overrides(data, overrides or [])
    cfg = _build(JobConfig, data)
    return cfg


def collect_config(data: dict[str, Any]) -> tuple[JobConfig | None, list[ConfigError]]:
    """Every error of a config at once, for dflash.check (load_config stops at the first): a bad or
    unknown key is recorded and left at its default, and each section is built again until it
    builds. The config is None when a section cannot be built at all (a required value missing)."""
    errors: list[ConfigError] = []
    return _collect(JobConfig, data, "", errors), errors


def _collect(cls: type, data: dict[str, Any], prefix: str, errors: list[ConfigError]) -> Any:
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    buildable = True
    for name, f in fields.items():
        if dataclasses.is_dataclass(hints[name]):  # a section: built even when absent, to name its keys
            value = data.get(name, {})
            if isinstance(value, dict):
                kwargs[name] = _collect(hints[name], value, f"{prefix}{name}.", errors)
                buildable = buildable and kwargs[name] is not None
            else:
                errors.append(ConfigError(f"{prefix}{name}", f"must be a table, got {type(value).__name__}"))
                buildable = buildable and f.default_factory is not dataclasses.MISSING
    for key, value in data.items():
        if key not in fields:
            known = ", ".join(sorted(fields))
            errors.append(ConfigError(f"{prefix}{key}", f"unknown key; known keys here: {known}"))
        elif not dataclasses.is_dataclass(hints[key]):
            try:
                kwargs[key] = _coerce(f"{prefix}{key}", value, hints[key])
            except ConfigError as e:
                errors.append(e)
    if not buildable:
        return None
    while True:
        try:
            return cls(**kwargs)
        except ConfigError as e:
            errors.append(e)
            name = e.key.removeprefix(prefix)
            if name not in kwargs:  # the default itself is refused: a required value is missing
                return None
            del kwargs[name]


def config_from_dict(data: dict[str, Any]) -> JobConfig:
    return _build(JobConfig, json.loads(json.dumps(data)))


def add_config_args(
    parser: Any,
    *,
    run_dir: str | None = "run directory; an existing one is resumed",
    run_dir_required: bool = False,
) -> None:
    """The arguments every job entry point shares: CONFIG, repeatable --set KEY=VALUE (into
    `overrides`, applied by load_config after the file) and, unless run_dir is None, --run-dir."""
    parser.add_argument("config", help="job config (TOML), e.g. configs/demo-cpu.toml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.total_steps=50 (repeatable)",
    )
    if run_dir is not None:
        parser.add_argument("--run-dir", required=run_dir_required, help=run_dir)


def set_args(overrides: list[str]) -> list[str]:
    """The command-line form of parsed overrides: ["--set", "k=v", ...] (add_config_args reads it)."""
    return [arg for override in overrides for arg in ("--set", override)]
