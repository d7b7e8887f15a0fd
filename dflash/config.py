"""Job configuration: nested dataclasses loaded from TOML, with `--set key=value` overrides.

Precedence, spelled out once: `--set` overrides > the TOML file > the defaults below.

Validation, also once, before any model or data is loaded:
- every numeric field declares its allowed values where it is declared (`Annotated[int, Range(ge=1)]`);
  each section's __post_init__ checks them (check_fields), so a section built any way (TOML,
  --set, dataclasses.replace) is checked. Floats must be finite everywhere: NaN fails every
  comparison, so a bare `x <= 0` check lets it through.
- the rules between fields (config_problems) run once on the built JobConfig (load_config, validate).
Unknown keys and bad values raise ConfigError naming the dotted key and the allowed values
(load_config, the job: the first one); collect_config gathers them all instead (dflash.check).

Why by hand (a Range per field and one finite/range check) and not pydantic v2 or msgspec: the
job's environment is pinned and hash-locked (envs/), and the field incident (FIELD.md) began with
extra packages polluting it; a validator library is one more pinned dependency in every job image
for about 100 lines of checks. The by-hand version rejects NaN/inf in every float field, and
tests/dflash/test_config_sweep.py walks every numeric field of every section to keep it so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import tomllib

from dflash.errors import ConfigError

_INT_MAX = 2**63 - 1
"""Every integer field fits in 64 bits (torch, numpy and the C libraries below them need it)."""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


@dataclass(frozen=True, slots=True)
class Range:
    """The values a numeric field allows, declared with the field: `seed: Annotated[int, Range(ge=0)]`
    (for a list, on its items: `list[Annotated[float, Range(ge=0, lt=1)]]`). Floats must also be
    finite; integers must fit in 64 bits. A special value (0 = derived, -1 = from the tokenizer)
    lies inside the range and is documented in the field's docstring."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def allows(self, x: float) -> bool:
        return (
            (self.ge is None or x >= self.ge)
            and (self.gt is None or x > self.gt)
            and (self.le is None or x <= self.le)
            and (self.lt is None or x < self.lt)
        )

    def describe(self, kind: type) -> str:
        """What the field must be, e.g. "an integer >= 1", "a number in [0, 1] (finite)"."""
        noun = "an integer" if kind is int else "a number"
        lo = self.ge if self.ge is not None else self.gt
        hi = self.le if self.le is not None else self.lt
        if lo == 0 and self.gt is not None and hi is None:
            text = f"a positive {noun.split()[-1]}"
        elif hi is None and lo is not None:
            text = f"{noun} {'>=' if self.ge is not None else '>'} {_num(lo)}"
        elif lo is None and hi is not None:
            text = f"{noun} {'<=' if self.le is not None else '<'} {_num(hi)}"
        elif lo is not None and hi is not None:
            left, right = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
            text = f"{noun} in {left}{_num(lo)}, {_num(hi)}{right}"
        else:
            text = noun
        return text + (" (finite)" if kind is float else "")


def _unwrap(hint: Any) -> tuple[Any, Range | None]:
    """(the type, its Range) of a possibly Annotated hint."""
    if typing.get_origin(hint) is Annotated:
        base, *extras = typing.get_args(hint)
        return base, next((x for x in extras if isinstance(x, Range)), None)
    return hint, None


@functools.cache
def numeric_fields(cls: type) -> dict[str, tuple[type, Range | None, bool]]:
    """{field: (int or float, its Range, whether the field is a list of them)} of a config section."""
    out: dict[str, tuple[type, Range | None, bool]] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        base, rng = _unwrap(hints[f.name])
        is_list = typing.get_origin(base) is list
        if is_list:
            base, rng = _unwrap(typing.get_args(base)[0])
        if base in (int, float):
            out[f.name] = (base, rng, is_list)
    return out


def value_problem(value: Any, kind: type, rng: Range | None) -> str | None:
    """Why `value` is not a valid `kind` (int or float) within `rng`; None when it is."""
    want = (rng or Range()).describe(kind)
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        return f"must be {want}, got {_show(value)}"
    if kind is float and not math.isfinite(value):
        return f"must be {want}, got {value}"
    if kind is int and not -_INT_MAX - 1 <= value <= _INT_MAX:
        return f"must be {want} that fits in 64 bits, got {_show(value)}"
    if rng is not None and not rng.allows(value):
        return f"must be {want}, got {_show(value)}"
    return None


def check_fields(section: Any) -> None:
    """Every numeric field of a config section against its declared Range; ConfigError names the key."""
    for name, (kind, rng, is_list) in numeric_fields(type(section)).items():
        value = getattr(section, name)
        for i, v in enumerate(value) if is_list else [(None, value)]:
            problem = value_problem(v, kind, rng)
            if problem is not None:
                raise ConfigError(
                    f"{section.SECTION}.{name}", problem if i is None else f"entry {i} {problem}"
                )


Positive = Range(gt=0)
AtLeast0 = Range(ge=0)
AtLeast1 = Range(ge=1)
Fraction = Range(ge=0, le=1)

SEED_MAX = 2**32 - 1


def check_tristate(section: Any, *keys: str) -> None:
    """Each key of the section is true, false or auto (any case: the resolvers lowercase it)."""
    for key in keys:
        value = getattr(section, key)
        if str(value).lower() not in ("true", "false", "auto"):
            raise ConfigError(f"{section.SECTION}.{key}", f"must be true, false or auto, got {_show(value)}")


@dataclass(kw_only=True, slots=True)
class RunConfig:
    SECTION: ClassVar[str] = "run"
    name: str = "dflash"
    """Run name; the run id is `<name>-<timestamp>` unless --run-dir is given."""
    seed: Annotated[int, Range(ge=0, le=SEED_MAX)] = 0
    """Seed for model init, anchor sampling and data order, in [0, 2**32 - 1]: the range every RNG
    the job seeds (torch, numpy, the anchor generator at seed * 1000 + rank) accepts."""
    runs_root: str = "runs"
    """Directory under which run directories are created."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    status_interval_s: Annotated[float, Positive] = 10.0
    """Seconds between status lines / metrics.jsonl records."""
    memory_headroom_gb: Annotated[float, AtLeast0] = 4.0
    """Device memory (GiB) kept free beyond the peak that warm-cache measured for the heaviest planned
    shape (the CUDA context, NCCL and the transport are not in that peak). warm-cache refuses a plan
    that does not fit the device less this, and so does the job when a restored artifact says so."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.device not in ("cpu", "cuda", "auto"):
            raise ConfigError("run.device", f"must be cpu, cuda or auto, got {self.device!r}")


@dataclass(kw_only=True, slots=True)
class TargetConfig:
    SECTION: ClassVar[str] = "target"
    path: str = ""
    """Local Hugging Face causal-LM directory (safetensors). `tiny` builds a tiny random Qwen3
    in the run directory (the CPU demo and tests) and loads it through the same path."""
    dtype: str = "bfloat16"
    """Weights dtype: bfloat16 | float16 | float32."""
    compile: str = "auto"
    """true | false | auto: torch.compile each decoder layer of the target (regional; its graphs per
    length bucket are in the shape plan, warm-cache and the fingerprint). auto: on a GPU where
    attention.compile is on (hidden-state capture 43.4K vs 33.0K tok/s, 1.32x, at the 8B batch shape
    on an H200: bench/pipeline.py --batch 12 --target-compile); off on the CPU, where a cold compile
    costs a short run more than it wins (dflash.plan.resolve.resolve_target_compile)."""
    tiny_layers: Annotated[int, AtLeast1] = 8
    """Layers of the `tiny` target."""
    tiny_hidden: Annotated[int, Range(ge=16)] = 64
    """Hidden size of the `tiny` target: a multiple of 16."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_tristate(self, "compile")
        if self.tiny_hidden % 16:
            raise ConfigError("target.tiny_hidden", f"must be a multiple of 16, got {self.tiny_hidden}")
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
    SECTION: ClassVar[str] = "drafter"
    num_layers: Annotated[int, AtLeast1] = 5
    """Drafter decoder layers."""
    block_size: Annotated[int, Range(ge=2)] = 16
    """Tokens proposed per pass: the anchor token followed by block_size-1 mask tokens."""
    target_layer_ids: list[Annotated[int, AtLeast0]] = field(default_factory=list)
    """Target layers whose hidden states are captured; empty = k ids evenly spaced in [1, n-3]."""
    num_target_layers: Annotated[int, AtLeast1] = 5
    """k, used when target_layer_ids is empty."""
    mask_token_id: Annotated[int, Range(ge=-1)] = -1
    """Mask token id; -1 = take it from the tokenizer (an error if it has none)."""
    layer_types: list[str] = field(default_factory=list)
    """sliding_attention | full_attention per layer; empty = all sliding but the last."""
    sliding_window: Annotated[int, AtLeast1] = 2048
    """Window (tokens of context before the anchor) of sliding layers."""
    sliding_block_causal: bool = False
    """Sliding layers attend causally inside each block (full layers stay bidirectional). Off: every
    layer is bidirectional inside a block, and config.json says `is_causal: false`. On: the
    convention engines assume when a config has no `is_causal` (SGLang always serves sliding
    layers this way), so the drafter is served as it was trained everywhere."""
    hidden_size: Annotated[int, AtLeast0] = 0
    """0 = the target's. Likewise for the sizes below."""
    intermediate_size: Annotated[int, AtLeast0] = 0
    num_attention_heads: Annotated[int, AtLeast0] = 0
    num_key_value_heads: Annotated[int, AtLeast0] = 0
    head_dim: Annotated[int, AtLeast0] = 0
    noise_std: Annotated[float, AtLeast0] = 0.0
    """Peak std of Gaussian noise added to the fused target features (0 = off)."""
    noise_schedule: str = "cosine"
    """constant | linear | cosine decay of the noise std over training."""

    def __post_init__(self) -> None:
        check_fields(self)
        for t in self.layer_types:
            if t not in ("sliding_attention", "full_attention"):
                raise ConfigError(
                    "drafter.layer_types", f"entries must be sliding_attention or full_attention, got {t!r}"
                )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(
                "drafter.layer_types", f"has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.noise_schedule not in ("constant", "linear", "cosine"):
            raise ConfigError("drafter.noise_schedule", "must be constant, linear or cosine")


@dataclass(kw_only=True, slots=True)
class AttentionConfig:
    SECTION: ClassVar[str] = "attention"
    backend: str = "auto"
    """flex | sdpa | auto (flex on GPU, sdpa on CPU: flex has no backward on CPU). On the H200 the 8B
    step ran 272.2 ms with flex against 336.4 ms with sdpa (1.24x; docs/BENCHMARKS.md)."""
    compile: bool = True
    """torch.compile the attention kernel (flex), the drafter's layers and create_block_mask; also
    what target.compile, train.fused_loss and attention.fused_qk_norm_rope resolve auto from."""
    strict_kernels: str = "auto"
    """true | false | auto (true on GPU): stop the worker on a degraded kernel."""
    sdpa_chunk_blocks: Annotated[int, AtLeast1] = 64
    """SDPA backend: blocks per chunk for the full-attention layer."""
    tuned_kernels: bool = True
    """flex: compile with the kernel options (tiles, stages, warps) measured best for the DFlash mask
    on this GPU (dflash.step.attention.flex.TUNED_KERNEL_OPTIONS; docs/BENCHMARKS.md); false = inductor's
    defaults. GPUs without a measured entry always get the defaults. On the H200, with the
    closed-form BlockMask, the 8B step went from 289.0 ms to 276.7 ms (docs/BENCHMARKS.md)."""
    flex_kernels: str = "auto"
    """flex | dflash | auto (= dflash on a GPU, flex elsewhere): the flex backend's attention kernels:
    flex's own (compiled by inductor from the mask), or dflash's hand-written Triton forward and
    backward for the DFlash mask (dflash.step.attention.triton_attention: flex's block-sparse tiles and
    arithmetic, their programs run longest first; docs/BENCHMARKS.md has their speed on the H200).
    On the CPU dflash's kernels run only through Triton's interpreter (the tests), so auto is flex."""
    fused_qk_norm_rope: str = "auto"
    """true | false | auto (= true where dflash's attention kernels run: a GPU, the flex backend,
    flex_kernels resolving to dflash, a power-of-two head dim): the layers' q/k RMSNorm and rotary
    embedding as one Triton kernel each way (dflash.step.attention.qk_norm_rope; the module path's
    arithmetic and roundings) instead of inductor's kernels for them. true where those kernels do
    not run is refused. On the H200 it took the 8B step's q/k kernels from about 3.2 ms to 1.9, the
    step 1.8 ms faster (docs/BENCHMARKS.md)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.backend not in ("flex", "sdpa", "auto"):
            raise ConfigError("attention.backend", f"must be flex, sdpa or auto, got {self.backend!r}")
        if self.flex_kernels not in ("flex", "dflash", "auto"):
            raise ConfigError(
                "attention.flex_kernels", f"must be flex, dflash or auto, got {self.flex_kernels!r}"
            )
        check_tristate(self, "strict_kernels", "fused_qk_norm_rope")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    SECTION: ClassVar[str] = "data"
    path: str = ""
    """JSONL file with `text` or chat `messages` records; `demo` = the built-in demo corpus."""
    tokenizer: str = "target"
    """target (AutoTokenizer from the target directory) | byte (built-in byte-level)."""
    max_seq_len: Annotated[int, Range(ge=8)] = 4096
    """Longer sequences are truncated."""
    min_seq_len: Annotated[int, AtLeast1] = 32
    """Shorter sequences are skipped (counted); at most max_seq_len."""
    cache_dir: str = ""
    """Tokenized-data cache; empty = <runs_root>/.tokcache."""
    bucket_multiple: Annotated[int, AtLeast1] = 256
    """Sequence lengths are padded up to a multiple of this: bounds padding and distinct shapes."""
    shuffle: bool = True
    max_bad_fraction: Annotated[float, Fraction] = 0.5
    """Stop with an error when more than this fraction of the records read are bad (not JSON, not a
    text/messages object, wrong types, not encodable; records skipped only for their length do not
    count). Judged after every 1024 lines once 1000 records are read, and at the end of the file.
    0 = any bad record stops the job; 1 = bad records are only skipped and counted."""
    responses: bool = False
    """Train on the target's own responses to data.path's prompts instead of its records' text
    (dflash.data.responses: generated once, at the job's start or by `python -m dflash.responses`, and
    kept as a content-addressed dataset under <cache_dir or runs_root>/.responses)."""
    response_max_new: Annotated[int, AtLeast1] = 64
    """New tokens per response (fewer where the target stops with its eos token)."""
    response_temperature: Annotated[float, AtLeast0] = 0.0
    """0 = greedy responses; above 0, sampled at this temperature (seeded by run.seed)."""
    response_prompt_tokens: Annotated[int, AtLeast1] = 32
    """Of a `text` record, the first this many tokens are the prompt (a `messages` record's prompt
    is its turns before the last assistant turn)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.tokenizer not in ("target", "byte"):
            raise ConfigError("data.tokenizer", f"must be target or byte, got {self.tokenizer!r}")
        if not self.path:  # last, as in TargetConfig
            raise ConfigError("data.path", "is required: a JSONL file, or `demo`")


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    SECTION: ClassVar[str] = "train"
    total_steps: Annotated[int, AtLeast1] = 1000
    """Optimizer steps."""
    lr: Annotated[float, Positive] = 6e-4
    warmup_steps: Annotated[int, AtLeast0] = 100
    """Linear warmup steps (0 = none). More than total_steps is allowed (a smoke run that ends while
    warming up): dflash.check warns about it."""
    min_lr_ratio: Annotated[float, Fraction] = 0.1
    """Cosine decays to lr * min_lr_ratio (0 = down to zero)."""
    weight_decay: Annotated[float, AtLeast0] = 0.0
    """AdamW's decoupled weight decay (0 = off); lr * weight_decay must stay below 1."""
    betas: list[Annotated[float, Range(ge=0, lt=1)]] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: Annotated[float, Positive] = 1.0
    token_budget: Annotated[int, AtLeast1] = 49152
    """Max sequence tokens (padded) per drafter batch: at least data.max_seq_len rounded up to
    data.bucket_multiple, so that the longest sequence fits."""
    block_token_budget: Annotated[int, AtLeast0] = 0
    """Max block tokens (rows x anchors per row x drafter.block_size) per drafter batch: the drafter's
    real work, which a sequence-token budget does not bound (a short bucket fits many more rows,
    each with as many anchors as a long one). 0 = the longest bucket's block tokens, so that no
    bucket is heavier for the drafter than the longest one. See dflash.plan.shapes."""
    max_batch_size: Annotated[int, AtLeast1] = 64
    num_anchors: Annotated[int, AtLeast1] = 512
    """Anchors sampled per sequence among loss positions."""
    gamma: Annotated[float, Positive] = 7.0
    """Loss weight of block position k is exp(-(k-1)/gamma)."""
    checkpoint_every: Annotated[int, AtLeast1] = 500
    keep_last: Annotated[int, AtLeast1] = 3
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    epochs: Annotated[float, Positive] = 1.0
    """Used for the ETA/epoch estimate only; the run stops at total_steps."""
    loss_chunk_tokens: Annotated[int, AtLeast1] = 8192
    """Block tokens per LM-head/cross-entropy chunk (bounds the logits memory; fused, rounded down to
    a multiple of 64). The whole loss in one chunk (16384) measured 260.5 ms against 259.5 with 8192
    on the H200, peak 36.5 GiB against 34.2 (docs/BENCHMARKS.md): the default stays."""
    fused_loss: str = "auto"
    """true | false | auto (true on GPU with attention.compile): each loss chunk's softmax,
    cross-entropy, accuracy and logits gradient as one compiled function (one generated kernel)
    instead of eager elementwise passes over fp32 [chunk, vocab]. Same results, less time and memory:
    on the H200 the 8B step's loss went from 67.2 ms to 8.0 (the step 340.2 -> 289.0 ms) and its peak
    allocated memory from 56.1 GiB to 38.7 (docs/BENCHMARKS.md)."""
    bf16_weights: str = "auto"
    """true | false | auto (true on a GPU for a single drafter): the drafter's linear layers hold bf16
    weights, the ones autocast computes with, and the optimizer keeps their float32 masters and writes
    the bf16 copies in its update; no cast of each weight every forward nor of each weight gradient
    every backward (3.5 ms of the 8B step on the H200). A single drafter computes the same maths
    either way, in another rounding order (inductor fuses the layers differently without the casts):
    results agree to bf16 tolerance, not bitwise (tests/dflash/test_trainer_step.py, on the GPU). In
    a drafter group (pipeline.drafters x nnodes > 1), true averages the gradients in bf16: half the
    all-reduce bytes, and one bf16 rounding more in the averaged gradient, which is why auto leaves a
    group on float32 weights: slower by the casts' 3.5 ms a step, for gradients averaged in float32.
    Needs CUDA."""
    tau_eval: str = "auto"
    """true | false | auto (true): after each checkpoint the pipeline's supervisor measures tau, the
    acceptance length under real speculative decoding (`python -m dflash.eval` on the checkpoint, a
    process of its own at low CPU priority), and writes a `tau` event; watch, report and ps read it.
    It runs on the CPU for a CPU job, else on the first target's GPU, beside the workers: a second,
    full copy of the target and the drafter in bf16, which the eval first checks against the GPU's
    free memory less run.memory_headroom_gb (no room: one `tau_skipped` event says so, and training
    goes on). Paced to train.tau_budget of the wall time. Its cost on the 2-core CPU demo: first
    step -> done 104.5 s off, 106.2 s on (+1.6%; +13% before the pacing); by its parts, training is
    28.3% slower while an eval runs, for 0.57% at the demo's checkpoint interval. At 8B on an H100
    (1 x 4096, the eval beside both workers on cuda:0): 6.8% slower during an eval, 0.14% at
    checkpoint_every 2000 (docs/BENCHMARKS.md)."""
    tau_budget: Annotated[float, Fraction] = 0.02
    """The share of the wall time the in-job tau may take (train.tau_eval): a measurement starts only
    while the finished ones took at most this share of the time since the job started, so a checkpoint
    that comes sooner waits (the newest waiting one is measured when the budget allows, the final
    checkpoint's always). 1 measures every checkpoint."""
    tau_prompts: str = ""
    """The held-out prompts of the in-job tau (a JSONL file of text or messages records that the
    job does not train on); empty = `demo` for the demo corpus (records of another seed), else
    train.tau_prompt_count records held out of data.path itself (spread evenly over it; a pipeline
    job trains on the rest, dflash.data.holdout; the single-process dflash.train measures no tau and
    trains on all), so turning train.tau_eval off or on changes a pipeline's training data by those
    records."""
    tau_prompt_count: Annotated[int, AtLeast1] = 16
    """Prompts per in-job tau measurement."""
    tau_max_new: Annotated[int, AtLeast1] = 32
    """New tokens per prompt in the in-job tau measurement."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_tristate(self, "fused_loss", "bf16_weights", "tau_eval")
        if len(self.betas) != 2:
            raise ConfigError("train.betas", f"must be two numbers in [0, 1), got {_show(self.betas)}")


SPARE_MODES = ("auto", "graphs", "host", "off")
"""pipeline.spare_drafters' values."""


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    SECTION: ClassVar[str] = "pipeline"
    targets: Annotated[int, AtLeast1] = 1
    """Target worker processes (T)."""
    drafters: Annotated[int, AtLeast1] = 1
    """Drafter worker processes (D), one data-parallel group."""
    target_devices: list[str] = field(default_factory=list)
    """Device per target worker, e.g. ["cuda:0", ...]; empty = derived from run.device."""
    drafter_devices: list[str] = field(default_factory=list)
    """Device per local drafter worker; empty = derived."""
    prefetch_depth: Annotated[int, AtLeast1] = 50
    """Data batches each target prefetches (q_pre)."""
    queue_depth: Annotated[int, AtLeast1] = 8
    """Hidden-state batches in the shared transport (q_hs capacity); at least 2 x drafters: each
    drafter holds the batch it trains and the one queued behind it."""
    max_restarts: Annotated[int, AtLeast0] = 3
    """Drafter-group restarts (torchrun --max-restarts); 0 = none."""
    restart_targets: bool = False
    """Restart a dead target worker instead of stopping the job."""
    nnodes: Annotated[int, AtLeast1] = 1
    rdzv_endpoint: str = ""
    """HOST:PORT of host 0's rendezvous, reachable from every host; required when nnodes > 1."""
    rdzv_id: str = ""
    """Empty = run.name: identical on every host (run directories are per host)."""
    rdzv_timeout_s: Annotated[int, AtLeast1] = 600
    """How long the drafter group waits for every host to join before it fails with an error."""
    slot_mb: Annotated[int, AtLeast0] = 0
    """Shared-memory slot size in MiB; 0 = derived from the batch shape."""
    state_copy_every: Annotated[int, AtLeast0] = 1
    """Steps between copies of the drafter group's training state in host shared memory
    (dflash.pipeline.state_copy): a drafter death rolls back at most this many steps instead of to
    the newest checkpoint. Two copies per host (float32 weights and AdamW moments: 12 bytes per
    trainable parameter each); the copy overlaps the next step. 0 = off. A batch is acked once a
    copy holds its step, so each drafter holds up to state_copy_every + 1 batches of the queue (and
    one more for the moment the newest copy takes), which pipeline.queue_depth must leave room for.
    The default keeps a death's loss to one step. Its price, measured on an H100 with the 8B drafter
    (12.6 GB a copy; 0.48 s was the first estimate of a copy): at a 258 ms step (2 x 4096 rows) every
    step cost +84.5% and every 10 steps +8.7%; at 6 x 4096 +27.0% and at 8 x 4096 +22.0%, about 0.21 s
    a copy whatever the step's length, because the step's small reads to the host waited behind the
    copy in the copy engine and stalled the step's stream. The step now writes those reads with a
    kernel (dflash.step.objective.HostCopy, bench/host_reads.py), so the copy should hide behind the
    next forward and backward; that, and the shipped 12 x 4096 step, are not measured yet
    (docs/BENCHMARKS.md). Where a copy costs too much, raise it (and pipeline.queue_depth with it)."""
    spare_drafters: str = "auto"
    """A spare drafter process per local drafter rank, started ahead (dflash.pipeline.spare), that
    takes over when the group restarts, so a new generation skips the imports, CUDA start, frozen
    head load and model build: host (those made on the host, about 4 bytes per trainable parameter
    plus the frozen embedding and head; on the GPU a CUDA context), graphs (also its compiled graphs
    loaded by one warm-up step per planned shape on its device: a second step's peak memory there,
    and a one-rank group only), auto (graphs where that fits, else host), off. On the CPU demo a
    drafter death's kill -> first trained step went from 7.7 s (off) to 0.8 s (auto, graphs);
    docs/BENCHMARKS.md."""

    def __post_init__(self) -> None:
        check_fields(self)
        if str(self.spare_drafters).lower() not in SPARE_MODES:
            raise ConfigError(
                "pipeline.spare_drafters",
                f"must be one of {', '.join(SPARE_MODES)}, got {_show(self.spare_drafters)}",
            )
        self.spare_drafters = str(self.spare_drafters).lower()


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


def config_problems(cfg: JobConfig) -> list[ConfigError]:
    """The rules between fields (each field is already within its own Range), all of them: the
    job refuses the first, dflash.check reports every one."""
    return [problem for problem, _keys in _cross_field_rules(cfg)]


# The shape arithmetic the cross-field rules need; dflash.plan.shapes builds the shape plan on it.
def round_up(n: Any, multiple: int) -> Any:
    """n (an int or an integer array) rounded up to a multiple: the bucket length of a sequence."""
    return -(-n // multiple) * multiple


def anchors_for(length: int, num_anchors: int) -> int:
    """Anchors per row of a bucket: an anchor needs a next token, so a row holds at most length - 1."""
    return max(1, min(num_anchors, length - 1))


def _cross_field_rules(cfg: JobConfig) -> list[tuple[ConfigError, tuple[str, ...]]]:
    """(problem, the keys it involves) of every rule between fields that cfg breaks."""
    d, t = cfg.data, cfg.train
    problems = []
    if d.min_seq_len > d.max_seq_len:
        problem = ConfigError(
            "data.min_seq_len",
            f"({d.min_seq_len}) is above data.max_seq_len ({d.max_seq_len}): every sequence long "
            "enough to keep would be truncated below it; lower data.min_seq_len",
        )
        problems.append((problem, ("data.min_seq_len", "data.max_seq_len")))
    longest = round_up(d.max_seq_len, d.bucket_multiple)
    if t.token_budget < longest:
        problem = ConfigError(
            "train.token_budget",
            f"({t.token_budget}) is smaller than the longest padded sequence, data.max_seq_len "
            f"({d.max_seq_len}) rounded up to data.bucket_multiple ({d.bucket_multiple}) = {longest}; "
            "raise train.token_budget or lower data.max_seq_len",
        )
        problems.append((problem, ("train.token_budget", "data.max_seq_len", "data.bucket_multiple")))
    one_row = anchors_for(longest, t.num_anchors) * cfg.drafter.block_size
    if t.block_token_budget and t.block_token_budget < one_row:
        problem = ConfigError(
            "train.block_token_budget",
            f"({t.block_token_budget}) is smaller than one row of the longest bucket: {one_row} block "
            f"tokens (train.num_anchors {t.num_anchors} x drafter.block_size {cfg.drafter.block_size}); "
            "raise it, lower train.num_anchors, or set 0 to derive it",
        )
        problems.append((problem, ("train.block_token_budget", "train.num_anchors", "drafter.block_size")))
    p = cfg.pipeline
    held = p.state_copy_every + 1
    if p.state_copy_every > 1 and p.queue_depth < held * p.drafters:
        need = held * p.drafters
        problem = ConfigError(
            "pipeline.queue_depth",
            f"({p.queue_depth}) is below {need}: with pipeline.state_copy_every = {p.state_copy_every} "
            f"each of the {p.drafters} drafter(s) holds up to {held} batches until a state copy covers "
            "their steps, so the drafters would wait on each other for batches; raise "
            f"pipeline.queue_depth to at least {need}, or lower pipeline.state_copy_every",
        )
        problems.append((problem, ("pipeline.queue_depth", "pipeline.state_copy_every", "pipeline.drafters")))
    elif p.queue_depth < 2 * p.drafters:
        problem = ConfigError(
            "pipeline.queue_depth",
            f"({p.queue_depth}) is below 2 x pipeline.drafters ({p.drafters}): each drafter holds two "
            "batches (the step it trains and the one queued behind it on the GPU), so with fewer slots "
            f"drafters wait on each other for batches; raise pipeline.queue_depth to at least {2 * p.drafters}",
        )
        problems.append((problem, ("pipeline.queue_depth", "pipeline.drafters")))
    if t.lr * t.weight_decay >= 1:
        problem = ConfigError(
            "train.weight_decay",
            f"({t.weight_decay}) times train.lr ({t.lr}) is {t.lr * t.weight_decay:.3g}, at least 1: "
            "AdamW would zero or flip the sign of every weight each step; lower train.weight_decay",
        )
        problems.append((problem, ("train.weight_decay", "train.lr")))
    return problems


def config_warnings(cfg: JobConfig) -> list[ConfigError]:
    """Legal but probably unintended settings: dflash.check reports them, the job runs."""
    t = cfg.train
    warnings = []
    if t.warmup_steps >= t.total_steps:
        warnings.append(
            ConfigError(
                "train.warmup_steps",
                f"({t.warmup_steps}) is not below train.total_steps ({t.total_steps}): the run ends "
                f"during warmup, at {t.total_steps / t.warmup_steps:.0%} of train.lr",
            )
        )
    return warnings


def validate(cfg: JobConfig) -> JobConfig:
    """The job's side of config_problems: the first problem is raised."""
    problems = config_problems(cfg)
    if problems:
        raise problems[0]
    return cfg


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """A TOML / --set value as the field's type (ranges are check_fields' job, in __post_init__)."""
    hint, rng = _unwrap(hint)
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a table, got {type(value).__name__}")
        return _build(hint, value, key)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list, got {_show(value)}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_coerce(key, v, item))
            except ConfigError as e:  # the list is the key (what --set and collect_config address)
                raise ConfigError(key, f"entry {i} {e.problem}") from None
        return out
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(key, value, args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"must be true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be {(rng or Range()).describe(int)}, got {_show(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be {(rng or Range()).describe(float)}, got {_show(value)}")
        try:
            return float(value)
        except OverflowError:  # an integer beyond float range
            raise ConfigError(
                key, f"must be {(rng or Range()).describe(float)}, got {_show(value)}"
            ) from None
    if hint is str:
        if isinstance(value, bool):
            return "true" if value else "false"
        if not isinstance(value, (str, int, float)):
            raise ConfigError(key, f"must be a string, got {_show(value)}")
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
    # ValueError: an integer past Python's int-string digit limit; RecursionError: absurd nesting.
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, ValueError, RecursionError):
        pass
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
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
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(p), f"cannot be read: {e.strerror or e}") from None
    # ValueError: not UTF-8, or an integer past the digit limit; RecursionError: absurd nesting.
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as e:
        raise ConfigError(str(p), f"is not valid TOML: {e}") from None


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, data: dict[str, Any] | None = None
) -> JobConfig:
    if data is None:
        data = {}
    if path is not None:
        data = read_config_file(path)
    data = apply_overrides(data, overrides or [])
    return validate(_build(JobConfig, data))


def collect_config(data: dict[str, Any]) -> tuple[JobConfig | None, list[ConfigError]]:
    """Every error of a config at once, for dflash.check (load_config stops at the first): a bad or
    unknown key is recorded and left at its default, and each section is built again until it
    builds; then every config_problems rule is reported. The config is None when a section cannot
    be built at all (a required value missing)."""
    errors: list[ConfigError] = []
    cfg = _collect(JobConfig, data, "", errors)
    if cfg is not None:
        # A key already reported was reset to its default: rules about it would judge the default.
        reported = {e.key for e in errors}
        errors.extend(p for p, keys in _cross_field_rules(cfg) if not reported.intersection(keys))
    return cfg, errors


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
    return validate(_build(JobConfig, json.loads(json.dumps(data))))


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
