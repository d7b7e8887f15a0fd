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
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from dflash.attention.flex_backward import DEFAULT_TILES, Tables, Tiles, attention_backward, grad_like
from dflash.attention.mask import layer_masks, mask_name

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
    hand-written backward (dflash.attention.flex_backward) reads: the same tile lists and intervals.

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
"""Wall seconds this process spent building block masks (block_mask_and_tables): dflash.warm
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
    """The block mask's tile lists and row intervals, for the hand-written backward (prepare sets
    them)."""
    mask_name: str = ""
    """The mask_mod's name (dflash.attention.mask.mask_name)."""


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
        backward: str = "flex",
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
        if backward not in BACKWARDS:
            raise ValueError(f"flex backward must be one of {', '.join(BACKWARDS)}, got {backward!r}")
        self.backward = backward
        # What decides the op's options, as a string: equal backends share a key (a compiled layer's
        # graph holds it as a constant, so it must not depend on how many backends a process made).
        self.key = json.dumps(
            {"compile": compile, "tuned": tuned, "options": self.kernel_options_override}, sort_keys=True
        )
        _BACKENDS[self.key] = self
        if backward == "kernel":
            allow_nested_flex_in_compiled_graphs()
        """flex: flex's own backward kernel; kernel: dflash.attention.flex_backward's (the forward
        is flex's either way)."""

    def kernel_options(self, plan: FlexPlan, head_dim: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The options this layer's flex kernels compile with (None: inductor's defaults); the table's
        kernel_bwd_* ones among them (flex_options leaves those out)."""
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
            plans[w] = FlexPlan(
                block_mask, layer_kind(w), capability, tables, mask_name(block_size, w, causal)
            )
        BLOCK_MASK_SECONDS[0] += time.perf_counter() - t0
        return plans

    def attend(self, q_BHQD: Tensor, k_BGLD: Tensor, v_BGLD: Tensor, plan: FlexPlan) -> Tensor:
        if (
            self.backward == "kernel"
            and plan.tables is not None
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q_BHQD, k_BGLD, v_BGLD))
        ):
            # Strings and tensors only: the op's options are looked up when it runs (a dict or a
            # json.dumps here would break the compiled layer's graph in two).
            out, _ = flex_with_kernel_backward(
                q_BHQD, k_BGLD, v_BGLD, list(plan.tables), plan.mask_name, self.key, plan.kind
            )
            return out
        options = self.kernel_options(plan, q_BHQD.shape[-1], q_BHQD.dtype)
        return self._flex(
            q_BHQD,
            k_BGLD,
            v_BGLD,
            block_mask=plan.block_mask,
            enable_gqa=q_BHQD.shape[1] != k_BGLD.shape[1],
            kernel_options=without_kernel_keys(options),
        )

    def op_options(self, kind: str, q: Tensor) -> tuple[dict[str, Any] | None, Tiles]:
        """(flex's forward options, the kernel's tiles) for flex_with_kernel_backward on q."""
        capability = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        options = self.options_for(kind, capability, q.shape[-1], q.dtype)
        fwd = {k: v for k, v in (options or {}).items() if not k.startswith(("bwd_", KERNEL_PREFIX))}
        return fwd or None, kernel_tiles(options)


BACKWARDS = ("flex", "kernel")
_BACKENDS: dict[str, FlexBackend] = {}
"""FlexBackends by their key (their settings): flex_with_kernel_backward finds its options here."""


def without_kernel_keys(options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The options flex takes: the table's kernel_bwd_* ones left out."""
    return {k: v for k, v in (options or {}).items() if not k.startswith(KERNEL_PREFIX)} or None


def allow_nested_flex_in_compiled_graphs() -> None:
    """flex_with_kernel_backward's forward runs flex (compiled on its own) inside the compiled
    layer's graph. AOTAutograd's first run of each graph checks its custom ops for aliasing under a
    dispatch mode (torch._functorch.config.check_custom_op_aliasing, where torch has it), and flex
    cannot run under that mode; the op's outputs are new tensors, so the check is turned off."""
    import torch._functorch.config as functorch_config

    if hasattr(functorch_config, "check_custom_op_aliasing"):
        functorch_config.check_custom_op_aliasing = False


KERNEL_PREFIX = "kernel_bwd_"
"""Table options for the hand-written backward (kernel_bwd_BLOCK_M1, ...: Tiles' fields), measured
by bench/attention_backward.py; flex never sees them."""


def kernel_tiles(options: Mapping[str, Any] | None) -> Tiles:
    """The hand-written backward's tiles from a layer's table options: its own kernel_bwd_* entries,
    else flex's bwd_* ones (the same tile work), else DEFAULT_TILES."""
    o = options or {}

    def pick(field: str, flex_key: str) -> int:
        return int(o.get(KERNEL_PREFIX + field, o.get(flex_key, getattr(DEFAULT_TILES, field))))

    return Tiles(**{f: pick(f, "bwd_" + f) for f in Tiles._fields})


def _block_mask_of(q: Tensor, k: Tensor, tables: list[Tensor], name: str) -> BlockMask:
    """The plan's BlockMask again from its tables (a custom op takes tensors, not a BlockMask)."""
    t = Tables(*tables)
    return BlockMask(
        (q.shape[2], k.shape[2]),
        *t.tile_lists,
        BLOCK_SIZE=(SPARSE_BLOCK, SPARSE_BLOCK),
        mask_mod=interval_mask_mod(t.ctx_lo, t.ctx_hi, t.own_lo, t.own_hi, name),
    )


@torch.library.custom_op("dflash::flex_with_kernel_backward", mutates_args=())
def flex_with_kernel_backward(
    q: Tensor, k: Tensor, v: Tensor, tables: list[Tensor], mask_name: str, backend: str, kind: str
) -> tuple[Tensor, Tensor]:
    """flex's forward (compiled with the layer kind's fwd_* options of FlexBackend `backend`)
    returning (out, natural-log lse); its backward is dflash.attention.flex_backward's kernel
    (registered below). One op, opaque to the compiled layer around it: the forward compiles on its
    own, as flex_attention_compiled."""
    owner = _BACKENDS[backend]
    fwd_options, _ = owner.op_options(kind, q)
    flex = flex_attention_compiled if owner.compiled else flex_attention
    q, k, v = q.detach(), k.detach(), v.detach()  # the op's autograd is registered: flex traces no backward
    out, aux = flex(
        q,
        k,
        v,
        block_mask=_block_mask_of(q, k, tables, mask_name),
        scale=1.0 / math.sqrt(q.shape[-1]),
        enable_gqa=q.shape[1] != k.shape[1],
        kernel_options=fwd_options,
        return_aux=AuxRequest(lse=True),
    )
    if out.stride() != q.stride():  # the fake's layout: empty_like(q)
        out = torch.empty_like(q, dtype=v.dtype).copy_(out)
    return out, aux.lse.contiguous()


@flex_with_kernel_backward.register_fake
def _(q, k, v, tables, mask_name, backend, kind):  # noqa: ANN001, ANN202
    B, H, Q, _ = q.shape
    return torch.empty_like(q, dtype=v.dtype), q.new_empty((B, H, Q), dtype=torch.float32)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, tables, _, backend, kind = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *tables)
    ctx.tiles = _BACKENDS[backend].op_options(kind, q)[1]


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, out, lse, *tables = ctx.saved_tensors
    dq, dk, dv = kernel_backward(grad_out, q, k, v, out, lse, tables, list(ctx.tiles))
    return dq, dk, dv, [None] * len(tables), None, None, None


@torch.library.custom_op("dflash::flex_kernel_backward", mutates_args=())
def kernel_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tables: list[Tensor],
    tiles: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) by dflash.attention.flex_backward (the log-sum-exp's own gradient is not taken:
    flex_with_kernel_backward's callers never use the lse)."""
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
        tiles=Tiles(*tiles),
    )


@kernel_backward.register_fake
def _(grad_out, q, k, v, out, lse, tables, tiles):  # noqa: ANN001, ANN202
    return grad_like(q), grad_like(k), grad_like(v)


flex_with_kernel_backward.register_autograd(_backward, setup_context=_setup)
