"""DFlash attention on FlexAttention with a block-sparse BlockMask.

Compiled ONCE per process, at import, with dynamic=False: each (batch, anchors, context) shape from
the trainer's length buckets compiles once and is then a cache hit; a new mask closure per batch
does not recompile (dynamo guards on the closure tensors' shapes, not their values). Never call
these from more than one thread of a process (field fact: cold-cache compiles deadlock across
threads); workers are processes.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash.step.attention.mask import layer_masks, mask_name
from dflash.step.attention.triton_attention import (
    DEFAULT_FWD_TILES,
    DEFAULT_TILES,
    FwdTiles,
    Tables,
    Tiles,
    attention_backward,
    attention_forward,
    grad_like,
)

flex_attention_compiled = torch.compile(flex_attention, dynamic=False)

SPARSE_BLOCK = 128
"""flex's tile of the block mask (queries x keys): its default, the size its kernels are tuned for."""


def interval_mask_mod(
    ctx_lo_BR: Tensor, ctx_hi_BR: Tensor, own_lo_R: Tensor, own_hi_R: Tensor, name: str
) -> Any:
    """The mask_mod of the per-row intervals: context [lo, hi) or own block [own_lo, own_hi)."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        in_context = (kv_idx >= ctx_lo_BR[b, q_idx]) & (kv_idx < ctx_hi_BR[b, q_idx])
        return in_context | ((kv_idx >= own_lo_R[q_idx]) & (kv_idx < own_hi_R[q_idx]))

    mask_mod.__name__ = name
    return mask_mod


def block_mask_and_tables(
    anchors_BA: Tensor,
    seq_lens_B: Tensor,
    *,
    context_len: int,
    block_size: int,
    window: int | None,
    causal_block: bool,
) -> tuple[BlockMask, Tables]:
    """The DFlash mask's BlockMask computed from the anchors, in closed form, and the tables the
    hand-written kernels (dflash.step.attention.triton_attention) read: the same tile lists and intervals.

    create_block_mask evaluates mask_mod on every (query, key) pair: eagerly that is a [B, Q, KV]
    grid per layer type per batch (2 x 8192 x 12288 at the 8B step: about 8 ms of GPU time and a
    dozen launches per step, measured on the H200), compiled it took minutes to build at that shape.
    Here each query row's allowed keys are two intervals (its context [lo, hi) and its own block),
    so the allowed count per (row, key tile) is interval arithmetic on [B, Q, KV / 128] and a tile is
    full when all its rows allow all its keys, partial when some do. The result equals
    create_block_mask(dflash_mask_mod(...)) exactly (tests/dflash/test_attention.py).

    Its mask_mod, which the kernels evaluate on every pair of a partial tile (forward, and twice in
    the backward), reads the same two intervals per row from [B, rows] tables instead of deriving
    them from the anchors pair by pair: four comparisons where dflash_mask_mod does about a dozen
    integer operations (a clamp, a division, the anchor and sequence-length lookups, the window).
    It allows exactly the pairs dflash_mask_mod allows, on flex's padded grid too (the test)."""
    B, A = anchors_BA.shape
    S, K, T = context_len, block_size, SPARSE_BLOCK
    q_len, kv_len = A * K, S + A * K
    q_tiles, kv_tiles = -(-q_len // T), -(-kv_len // T)
    dev = anchors_BA.device
    q_R = torch.arange(q_tiles * T, device=dev)
    block_R = torch.clamp(q_R // K, max=A - 1)
    anchor_BR = anchors_BA[:, block_R]
    row_ok_R = q_R < q_len
    row_ok_BR = row_ok_R[None, :].expand_as(anchor_BR)
    # Context: lo <= kv < hi (an invalid anchor, -1, has hi < 0: nothing).
    hi_BR = torch.minimum(anchor_BR, seq_lens_B[:, None].clamp(max=S))
    lo_BR = torch.zeros_like(hi_BR) if window is None else (anchor_BR - window).clamp(min=0)
    # Own block: S + block*K <= kv < S + block*K + K (causal: up to and including the row's position).
    own_lo_R = S + block_R * K
    own_hi_R = own_lo_R + ((q_R % K) + 1 if causal_block else K)
    t0_T = torch.arange(kv_tiles, device=dev) * T
    t1_T = t0_T + T

    def overlap(lo: Tensor, hi: Tensor) -> Tensor:  # [..., R] intervals against [T] tiles -> [..., R, T]
        return (torch.minimum(hi[..., None], t1_T) - torch.maximum(lo[..., None], t0_T)).clamp(min=0)

    count_BRT = (overlap(lo_BR, hi_BR) + overlap(own_lo_R, own_hi_R)[None]) * row_ok_BR[..., None]
    count_BQtT = count_BRT.view(B, q_tiles, T, kv_tiles)
    full_BQT = (count_BQtT == T).all(dim=2)
    partial_BQT = (count_BQtT > 0).any(dim=2) & ~full_BQT

    def as_indices(sel_BQT: Tensor) -> tuple[Tensor, Tensor]:
        # Selected tiles first, ascending (a stable sort on "not selected"), as create_block_mask lays them out.
        num = sel_BQT.sum(dim=-1, dtype=torch.int32)[:, None]
        idx = torch.argsort((~sel_BQT).to(torch.int8), dim=-1, stable=True).to(torch.int32)[:, None]
        return num, idx

    kv_num, kv_idx = as_indices(partial_BQT)
    full_num, full_idx = as_indices(full_BQT)
    # Rows past q_len (flex's padding) allow nothing: empty intervals.
    ctx_lo_BR = torch.where(row_ok_BR, lo_BR, 0).to(torch.int32)
    ctx_hi_BR = torch.where(row_ok_BR, hi_BR, 0).to(torch.int32)
    own_lo_R = torch.where(row_ok_R, own_lo_R, 0).to(torch.int32)
    own_hi_R = torch.where(row_ok_R, own_hi_R, 0).to(torch.int32)

    mask_mod = interval_mask_mod(
        ctx_lo_BR, ctx_hi_BR, own_lo_R, own_hi_R, mask_name(block_size, window, causal_block)
    )
    bm = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=T, mask_mod=mask_mod, seq_lengths=(q_len, kv_len)
    )
    lists = (
        *(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices),
        *(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices),
    )
    tables = Tables(*(x.contiguous() for x in (*lists, ctx_lo_BR, ctx_hi_BR, own_lo_R, own_hi_R)))
    return bm, tables


BLOCK_MASK_SECONDS = [0.0]
"""Wall seconds this process spent building block masks (block_mask_and_tables): dflash.cache.warm
reports it in its per-shape compile-time breakdown."""


class FlexPlan(NamedTuple):
    """One layer type's plan: its block mask, which kind of layer it is, and the GPU it runs on (the
    kernel options are picked from these when the layer is traced)."""

    block_mask: BlockMask
    kind: str
    """"full" or "sliding"."""
    capability: tuple[int, int] | None
    """CUDA compute capability of the device, None off CUDA."""
    tables: Tables | None = None
    """The block mask's tile lists and row intervals, for dflash's hand-written kernels (prepare sets
    them)."""


TUNED_TABLE = Path(__file__).with_name("flex_tuned.json")
"""Measured flex kernel options, written by `bench/flex_tune.py --write-table` (docs/BENCHMARKS.md)."""


def load_tuned(path: Path = TUNED_TABLE) -> dict[tuple[tuple[int, int], int, str], dict[str, Any]]:
    """{(compute capability, head dim, layer kind): kernel options} from a table file; {} when absent.
    Options: tile sizes, pipeline stages, warps; fwd_* for the forward kernel, bwd_* for the backward's."""
    try:
        table = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    out = {}
    for entry in table["entries"]:
        cap = tuple(int(x) for x in entry["capability"])
        out[(cap[0], cap[1]), int(entry["head_dim"]), str(entry["kind"])] = dict(entry["options"])
    return out


TUNED_KERNEL_OPTIONS = load_tuned()
"""flex kernel options per (compute capability, head dim, layer kind) for bf16 on the DFlash mask,
chosen by bench/flex_tune.py from measurements on that GPU. Where no entry matches, inductor's own
defaults for the GPU apply."""


def layer_kind(window: int | None) -> str:
    return "full" if window is None else "sliding"


class FlexBackend:
    name = "flex"

    def __init__(
        self,
        *,
        compile: bool = True,
        tuned: bool = True,
        kernel_options: Mapping[str, Mapping[str, Any]] | None = None,
        kernels: str = "flex",
        fused_qk_norm_rope: bool = False,
    ) -> None:
        # compile=False is the unfused fallback: it exists so the degraded-kernel guard can be
        # exercised and so a run can opt out knowingly; it is never chosen silently.
        self.compiled = compile
        self._flex = flex_attention_compiled if compile else flex_attention
        self.tuned = tuned
        """Use TUNED_KERNEL_OPTIONS (attention.tuned_kernels); False: inductor's defaults."""
        self.kernel_options_override = (
            {kind: dict(opts) for kind, opts in kernel_options.items()}
            if kernel_options is not None
            else None
        )
        """{kind: options} in place of TUNED_KERNEL_OPTIONS (bench/flex_tune.py tries candidates so)."""
        if kernels not in KERNELS:
            raise ValueError(f"flex kernels must be one of {', '.join(KERNELS)}, got {kernels!r}")
        self.kernels = kernels
        """flex: flex's compiled kernels; dflash: dflash.step.attention.triton_attention's forward and
        backward (one custom op, dflash_attention)."""
        if fused_qk_norm_rope and kernels != "dflash":
            raise ValueError("the fused q/k norm + rotary kernel goes with dflash's attention kernels only")
        self.fused_qk_norm_rope = fused_qk_norm_rope
        """dflash's kernels take the q/k norm and rotary embedding too (dflash.step.attention.qk_norm_rope)."""

    def kernel_options(self, plan: FlexPlan, head_dim: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The options this layer's flex kernels compile with (None: inductor's defaults); the table's
        kernel_* ones among them (flex's calls leave those out)."""
        return self.options_for(plan.kind, plan.capability, head_dim, dtype)

    def options_for(
        self, kind: str, capability: tuple[int, int] | None, head_dim: int, dtype: torch.dtype
    ) -> dict[str, Any] | None:
        if self.kernel_options_override is not None:
            return dict(self.kernel_options_override.get(kind) or {}) or None
        if not self.tuned or capability is None or dtype != torch.bfloat16:
            return None
        tuned = TUNED_KERNEL_OPTIONS.get((capability, head_dim, kind))
        return dict(tuned) if tuned else None

    def prepare(
        self,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        *,
        context_len: int,
        block_size: int,
        windows: Iterable[int | None],
        sliding_causal: bool = False,
    ) -> dict[int | None, FlexPlan]:
        device = anchors_BA.device
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        plans = {}
        t0 = time.perf_counter()
        for w, causal in layer_masks(windows, sliding_causal).items():
            block_mask, tables = block_mask_and_tables(
                anchors_BA,
                seq_lens_B,
                context_len=context_len,
                block_size=block_size,
                window=w,
                causal_block=causal,
            )
            plans[w] = FlexPlan(block_mask, layer_kind(w), capability, tables)
        BLOCK_MASK_SECONDS[0] += time.perf_counter() - t0
        return plans

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: FlexPlan) -> Tensor:
        options = self.kernel_options(plan, q_BHQD.shape[-1], q_BHQD.dtype)
        if self.kernels == "dflash" and plan.tables is not None:
            fwd, bwd = kernel_tiles(options)
            # Tensors and ints only: the op takes no dicts (a dict or a json.dumps here would break
            # the compiled layer's graph in two).
            out, _ = dflash_attention(q_BHQD, k_BGLD, v_BGLD, list(plan.tables), [*fwd, *bwd])
            return out
        return self._flex(
            q_BHQD,
            k_BGLD,
            v_BGLD,
            block_mask=plan.block_mask,
            enable_gqa=q_BHQD.shape[1] != k_BGLD.shape[1],
            kernel_options=without_kernel_keys(options),
        )


KERNELS = ("flex", "dflash")

KERNEL_PREFIX = "kernel_"
"""Table options for dflash's own kernels (kernel_fwd_BLOCK_M, ... FwdTiles' fields; kernel_bwd_BLOCK_M1,
... Tiles' fields), measured by bench/attention_backward.py; flex never sees them."""


def without_kernel_keys(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The options flex takes: the table's kernel_* ones left out."""
    return {k: v for k, v in (options or {}).items() if not k.startswith(KERNEL_PREFIX)} or None


def kernel_tiles(options: Mapping[str, Any] | None) -> tuple[FwdTiles, Tiles]:
    """dflash's kernels' tiles from a layer's table options: their own kernel_fwd_* / kernel_bwd_*
    entries, else flex's fwd_* / bwd_* ones (the same tile work), else the defaults."""
    o = options or {}

    def pick(prefix: str, default: Any, field: str) -> int:
        return int(
            o.get(f"{KERNEL_PREFIX}{prefix}_{field}", o.get(f"{prefix}_{field}", getattr(default, field)))
        )

    return (
        FwdTiles(**{f: pick("fwd", DEFAULT_FWD_TILES, f) for f in FwdTiles._fields}),
        Tiles(**{f: pick("bwd", DEFAULT_TILES, f) for f in Tiles._fields}),
    )


def _split_tiles(tiles: list[int]) -> tuple[FwdTiles, Tiles]:
    n = len(FwdTiles._fields)
    return FwdTiles(*tiles[:n]), Tiles(*tiles[n:])


@torch.library.custom_op("dflash::attention", mutates_args=())
def dflash_attention(
    q: Tensor, k: Tensor, v: Tensor, tables: list[Tensor], tiles: list[int]
) -> tuple[Tensor, Tensor]:
    """(out, natural-log lse) of the DFlash attention by dflash.step.attention.triton_attention's forward;
    its backward is that module's backward kernel (registered below). tables: the plan's Tables;
    tiles: FwdTiles' then Tiles' fields. One op, opaque to the compiled layer around it."""
    fwd, _ = _split_tiles(tiles)
    return attention_forward(
        q, k, v, Tables(*tables), scale=1.0 / math.sqrt(q.shape[-1]), sparse=SPARSE_BLOCK, tiles=fwd
    )


@dflash_attention.register_fake
def _(q, k, v, tables, tiles):  # noqa: ANN001, ANN202
    B, H, Q, _ = q.shape
    return grad_like(q, v.dtype), q.new_empty((B, H, Q), dtype=torch.float32)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, tables, tiles = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *tables)
    ctx.tiles = tiles


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, *tables = ctx.saved_tensors
    dq, dk, dv = dflash_attention_backward(grad_out, q, k, v, out, lse, tables, ctx.tiles)
    return dq, dk, dv, [None] * len(tables), None


@torch.library.custom_op("dflash::attention_backward", mutates_args=())
def dflash_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tables: list[Tensor],
    tiles: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) by dflash.step.attention.triton_attention's backward (the log-sum-exp's own gradient
    is not taken: dflash_attention's callers never use the lse)."""
    return attention_backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        Tables(*tables),
        scale=1.0 / math.sqrt(q.shape[-1]),
        sparse=SPARSE_BLOCK,
        tiles=_split_tiles(tiles)[1],
    )


@dflash_attention_backward.register_fake
def _(grad_out, q, k, v, out, lse, tables, tiles):  # noqa: ANN001, ANN202
    return grad_like(q), grad_like(k), grad_like(v)


dflash_attention.register_autograd(_backward, setup_context=_setup)
