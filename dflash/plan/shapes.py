"""The shape plan: every shape the job can take, and every compiled graph that follows from them.

One module decides it, from the config alone (no model, no data): the batcher fills batches to a
bucket's rows, the trainer pads to them and samples that bucket's anchors per row, warm-cache
compiles exactly these shapes, the fingerprint keys on them, and the recompile limit is set from
the number of graphs they make. Nothing else may invent a shape.

A length bucket is a padded sequence length: a multiple of data.bucket_multiple from min_seq_len
up to max_seq_len, both rounded up. Its rows are bounded three ways:
  - train.max_batch_size;
  - train.token_budget, in sequence tokens (rows x length: the target's work and the transport's);
  - train.block_token_budget, in block tokens (rows x anchors x block_size: the drafter's work,
    every layer's MLP, projections and attention queries, and the loss). 0 = the longest bucket's
    block tokens, so no bucket is heavier for the drafter than the longest one.
Anchors per row are train.num_anchors, but never more than a row of that bucket can hold: an anchor
needs a next token, so at most length - 1.

Compiled graphs: the drafter's decoder layers are compiled one by one and share one code object;
dynamo keeps one graph per (length bucket, layer type, input requires grad): the sliding window is
a constant the layer's graph is specialised on, and the first layer's input (the frozen embedding's
output) needs no grad while every later layer's does. The target's regional compile (target.compile) keeps two per bucket
(unpadded and padded batches) per target layer type. The fused loss (train.fused_loss) is one
graph of its own code where it is compiled (its row count is dynamic); on a GPU a Triton kernel of
its own runs it instead (dflash.step.loss_kernel: no dynamo graph, its binary in the triton cache). The two norms outside the
layers (the context's and the final one, compiled with the layers on a GPU) have dynamic row counts
too: one code, a graph per input dtype, at most
OUTER_NORM_GRAPHS. With dflash's own attention kernels (attention.flex_kernels, a GPU's default) the
attention is one custom op inside the layer's graph: no graph of its own (its Triton kernels are
compiled per tile shape into the triton cache, as the loss kernel's). The recompile limit is set to the largest of these counts: every planned graph fits, and a shape outside the plan hits the limit, which
dflash.step.guard reports as a degraded kernel (and strict mode refuses).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash.config import JobConfig, anchors_for, round_up
from dflash.errors import DFlashError
from dflash.plan.spec import drafter_layer_types

OUTER_NORM_GRAPHS = 2
"""Graphs of the compiled outer norms' code (dflash.step.model.rms_norm): the context's norm takes the fc's
output (bf16 under autocast), the final norm the fp32 residual stream; their row counts are dynamic."""

TARGET_VARIANTS = 2
"""Graphs the target's compiled layer takes per bucket: unpadded (causal mask only) and padded."""


@dataclass(frozen=True, slots=True)
class Shape:
    """One batch shape of the drafter: `rows` sequences padded to `length`, `anchors` blocks per row."""

    length: int
    rows: int
    anchors: int
    block_size: int

    @property
    def seq_tokens(self) -> int:
        return self.rows * self.length

    @property
    def block_tokens(self) -> int:
        return self.rows * self.anchors * self.block_size

    @property
    def name(self) -> str:
        """How errors and events name it: rows x length."""
        return f"{self.rows}x{self.length}"

    def to_dict(self) -> dict[str, int]:
        return {
            "rows": self.rows,
            "length": self.length,
            "anchors": self.anchors,
            "block_tokens": self.block_tokens,
            "seq_tokens": self.seq_tokens,
        }


@dataclass(frozen=True, slots=True)
class ShapePlan:
    bucket_multiple: int
    shapes: tuple[Shape, ...]
    """One per length bucket, shortest first."""
    token_budget: int
    block_token_budget: int
    """Resolved (never 0)."""
    layer_types: tuple[str, ...]
    """The drafter's layer types, one per layer."""
    target_layer_types: int = 1
    """Distinct layer types of the target (from its config.json when known)."""
    target_compile: bool = False

    @property
    def lengths(self) -> list[int]:
        return [s.length for s in self.shapes]

    def shape_for(self, length: int) -> Shape:
        """The planned shape of a bucket length; an error for a length the plan does not have."""
        for s in self.shapes:
            if s.length == length:
                return s
        raise DFlashError(
            f"a batch of padded length {length} is outside the shape plan (buckets {self.lengths}); "
            "the data and the config disagree: re-run with the config the data was prepared for"
        )

    def rows_for(self, length: int) -> int:
        return self.shape_for(length).rows

    def check_batch(self, rows: int, length: int) -> Shape:
        """The planned shape of a batch about to be compiled or run; refuses anything unplanned."""
        shape = self.shape_for(length)
        if rows != shape.rows:
            raise DFlashError(
                f"a batch of {rows} rows x {length} is outside the shape plan ({shape.rows} rows for "
                f"that bucket); batches must come padded by the job's batcher"
            )
        return shape

    @property
    def layer_variants(self) -> int:
        """Graphs of the drafter's decoder-layer code per bucket: one per (layer type, whether its
        input requires grad). The first layer's input is the frozen embedding's output (no grad), every
        later layer's is not, and dynamo guards on requires_grad: a type that is first and also comes
        later is two graphs (measured on the H200: the 8B drafter's 4 sliding + 1 full layers make 3)."""
        types = self.layer_types
        return len({(types[0], False), *((t, True) for t in types[1:])}) if types else 0

    @property
    def drafter_graphs(self) -> int:
        """Graphs of the drafter's (shared) decoder-layer code: buckets x layer variants."""
        return len(self.shapes) * self.layer_variants

    @property
    def target_graphs(self) -> int:
        """Graphs of the target's compiled decoder layer (0 when target.compile is off)."""
        if not self.target_compile:
            return 0
        return len(self.shapes) * TARGET_VARIANTS * self.target_layer_types

    @property
    def recompile_limit(self) -> int:
        """dynamo's per-code recompile limit for this plan: exactly what the plan compiles."""
        return max(OUTER_NORM_GRAPHS, self.drafter_graphs, self.target_graphs)

    def buckets(self) -> list[list[int]]:
        """[[rows, length], ...]: the fingerprint's and the warm protocol's form."""
        return [[s.rows, s.length] for s in self.shapes]

    def to_dict(self) -> dict[str, Any]:
        return {
            "bucket_multiple": self.bucket_multiple,
            "token_budget": self.token_budget,
            "block_token_budget": self.block_token_budget,
            "shapes": [s.to_dict() for s in self.shapes],
            "drafter_graphs": self.drafter_graphs,
            "target_graphs": self.target_graphs,
            "recompile_limit": self.recompile_limit,
        }


def bucket_lengths(min_seq_len: int, max_seq_len: int, bucket_multiple: int) -> list[int]:
    m = bucket_multiple
    return list(range(max(m, round_up(min_seq_len, m)), round_up(max_seq_len, m) + 1, m))


def _seq_rows(length: int, token_budget: int, max_batch_size: int) -> int:
    return max(1, min(max_batch_size, token_budget // length))


def derived_block_budget(
    lengths: Sequence[int], *, token_budget: int, max_batch_size: int, num_anchors: int, block_size: int
) -> int:
    """train.block_token_budget = 0: the longest bucket's block tokens under the other two bounds."""
    if not lengths:
        return 0  # min_seq_len above max_seq_len: config_problems names it
    longest = max(lengths)
    return _seq_rows(longest, token_budget, max_batch_size) * anchors_for(longest, num_anchors) * block_size


def make_plan(
    *,
    min_seq_len: int,
    max_seq_len: int,
    bucket_multiple: int,
    token_budget: int,
    max_batch_size: int,
    num_anchors: int,
    block_size: int,
    block_token_budget: int = 0,
    layer_types: Sequence[str] = ("full_attention",),
    target_layer_types: int = 1,
    target_compile: bool = False,
) -> ShapePlan:
    lengths = bucket_lengths(min_seq_len, max_seq_len, bucket_multiple)
    budget = block_token_budget or derived_block_budget(
        lengths,
        token_budget=token_budget,
        max_batch_size=max_batch_size,
        num_anchors=num_anchors,
        block_size=block_size,
    )
    shapes = []
    for length in lengths:
        if length > token_budget:
            continue  # config_problems refuses a token budget below the longest bucket
        anchors = anchors_for(length, num_anchors)
        rows = min(_seq_rows(length, token_budget, max_batch_size), budget // (anchors * block_size))
        shapes.append(Shape(length=length, rows=max(1, rows), anchors=anchors, block_size=block_size))
    return ShapePlan(
        bucket_multiple=bucket_multiple,
        shapes=tuple(shapes),
        token_budget=token_budget,
        block_token_budget=budget,
        layer_types=tuple(layer_types),
        target_layer_types=max(1, target_layer_types),
        target_compile=target_compile,
    )


def shape_plan(cfg: JobConfig, *, target_path: str | None = None, target_compile: bool = False) -> ShapePlan:
    """The plan of a config's shapes; target_compile: whether the target's layers are compiled (the
    job plan's, dflash.plan.builder, resolved on the job's device); target_path: the target's directory,
    whose config.json tells how many layer types its compiled layers have (read only then)."""
    d, t = cfg.data, cfg.train
    target_layer_types = 1
    if target_compile and target_path:
        types = read_target_config(target_path).get("layer_types")
        target_layer_types = len(set(types)) if isinstance(types, list) and types else 1
    return make_plan(
        min_seq_len=d.min_seq_len,
        max_seq_len=d.max_seq_len,
        bucket_multiple=d.bucket_multiple,
        token_budget=t.token_budget,
        max_batch_size=t.max_batch_size,
        num_anchors=t.num_anchors,
        block_size=cfg.drafter.block_size,
        block_token_budget=t.block_token_budget,
        layer_types=drafter_layer_types(cfg.drafter),
        target_layer_types=target_layer_types,
        target_compile=target_compile,
    )


def read_target_config(target_path: str) -> dict[str, Any]:
    """The target's config.json (what its compiled layers are built from); an error naming the file."""
    import json
    from pathlib import Path

    path = Path(target_path) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DFlashError(f"target.compile needs the target's config: cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def apply_recompile_limit(plan: ShapePlan) -> int:
    """Set dynamo's recompile limit from the plan (before anything compiles); returns it."""
    import torch._dynamo

    limit = plan.recompile_limit
    torch._dynamo.config.recompile_limit = limit
    return limit
