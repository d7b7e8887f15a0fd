"""The DFlash drafter (the published design), built from transformers' Qwen3 blocks.

A block = [token at the anchor, mask x (K-1)], embedded with the target's frozen embedding. The k
captured target hidden states are fused once: RMSNorm(Linear(k*H_t -> H)). Every layer projects the
SAME fused context into extra keys/values (context features are not updated across layers), so
the context's keys and values of all layers are one product (context_kv), the layers' k_proj and
v_proj weights side by side: one [S, H] x [H, layers * 2 * kv] product forward and one input
gradient backward, where a product per layer over [context; block] rows needed the context's copy
in every layer's input and (layers - 1) adds of its gradient. Queries come from the block tokens
only. Per-head q/k RMSNorm, RoPE at true positions (context 0..S-1, block token j of anchor a at
a + j), GQA, pre-norm residuals. The attention backend
(flex | sdpa | eager) is chosen per run; all share one mask definition (dflash.step.attention.mask).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from dflash.errors import ConfigError

# The spec lives in dflash.plan.spec (no torch model there); importable from here as before.
from dflash.plan.spec import LAYER_TYPES as LAYER_TYPES
from dflash.plan.spec import DrafterSpec as DrafterSpec
from dflash.plan.spec import default_target_layer_ids as default_target_layer_ids  # importable from here
from dflash.plan.spec import resolve_spec as resolve_spec
from dflash.step.attention import BACKENDS, AttentionBackend, qk_norm_rope
from dflash.step.attention.qk_norm_rope import fused_qk_head_dim_problem


def norm_rope(x_BTHD: Tensor, norm: Qwen3RMSNorm, rope: tuple[Tensor, Tensor], fused: bool) -> Tensor:
    """The attention's per-head RMSNorm, then the rotary embedding, of q or k [B, T, heads, D] ->
    [B, heads, T, D]. fused: dflash's kernel (dflash.step.attention.qk_norm_rope: the same arithmetic and
    roundings, one kernel each way; inputs it would not compute so are refused, never passed to the
    module path silently), its output in x's dtype; else the module path (float32 under autocast)."""
    if fused:
        return qk_norm_rope.qk_norm_rope(x_BTHD, norm.weight, *rope, norm.variance_epsilon).transpose(1, 2)
    y_BHTD = norm(x_BTHD).transpose(1, 2)
    y_BHTD, _ = apply_rotary_pos_emb(y_BHTD, y_BHTD, *rope)
    return y_BHTD


class DrafterAttention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            spec.num_attention_heads,
            spec.num_key_value_heads,
            spec.head_dim,
        )
        self.q_proj = nn.Linear(spec.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(spec.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, spec.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=spec.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=spec.rms_norm_eps)

    def forward(
        self,
        block_BQH: Tensor,
        ctx_kv_BSC: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        backend: AttentionBackend,
        plan: Any,
    ) -> Tensor:
        """ctx_kv_BSC: this layer's context keys then values, [B, S, 2 * kv_heads * head_dim]
        (DFlashDrafter.context_kv); the block's own are projected here."""
        B, Q, _ = block_BQH.shape
        ctx_k_BSC, ctx_v_BSC = ctx_kv_BSC.chunk(2, dim=-1)
        q_BQHD = self.q_proj(block_BQH).view(B, Q, self.heads, self.head_dim)
        k_BLC = torch.cat([ctx_k_BSC, self.k_proj(block_BQH)], dim=1)
        v_BLC = torch.cat([ctx_v_BSC, self.v_proj(block_BQH)], dim=1)
        L = k_BLC.shape[1]
        k_BLGD = k_BLC.view(B, L, self.kv_heads, self.head_dim)
        v_BGLD = v_BLC.view(B, L, self.kv_heads, self.head_dim).transpose(1, 2)
        fused = backend.fused_qk_norm_rope
        q_BHQD = norm_rope(q_BQHD, self.q_norm, rope_q, fused)
        k_BGLD = norm_rope(k_BLGD, self.k_norm, rope_kv, fused)
        # Under autocast the q/k RMSNorms return float32 (fp32 weight x bf16): attend in v's dtype.
        o_BHQD = backend.attend(q_BHQD.to(v_BGLD.dtype), k_BGLD.to(v_BGLD.dtype), v_BGLD.contiguous(), plan)
        return self.o_proj(o_BHQD.transpose(1, 2).reshape(B, Q, self.heads * self.head_dim))


class DrafterLayer(nn.Module):
    def __init__(self, spec: DrafterSpec, qwen3: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.self_attn = DrafterAttention(spec)
        self.post_attention_layernorm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.mlp = Qwen3MLP(qwen3)

    def forward(
        self,
        h_BQH: Tensor,
        ctx_kv_BSC: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_kv: tuple[Tensor, Tensor],
        backend: AttentionBackend,
        plan: Any,
    ) -> Tensor:
        h_BQH = h_BQH + self.self_attn(
            self.input_layernorm(h_BQH), ctx_kv_BSC, rope_q, rope_kv, backend, plan
        )
        return h_BQH + self.mlp(self.post_attention_layernorm(h_BQH))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3RMSNorm's forward as a function of its input and weight (the same operations, in order)."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(input_dtype)


@functools.cache
def _rms_norm_compiled() -> Any:
    """rms_norm compiled, made at first use (torch.compile imports inductor: seconds a process that
    only reads the drafter's spec, such as the supervisor, must not pay). Its row count is marked
    dynamic: one graph per input dtype for every bucket (dflash.plan.shapes counts them)."""
    return torch.compile(rms_norm)


class LayerInputs(NamedTuple):
    """What the decoder layers read besides their own state (DFlashDrafter.layer_inputs)."""

    windows: list[int | None]
    """Each layer's attention window (None: full)."""
    plans: dict[int | None, Any]
    """The attention backend's plan per window."""
    ctx_BSH: Tensor
    """The fused context: RMSNorm(fc(target features)), noise added in training when asked."""
    h_BQH: Tensor
    """The blocks' embeddings: the first layer's input."""
    rope_q: tuple[Tensor, Tensor]
    rope_kv: tuple[Tensor, Tensor]


class DFlashDrafter(nn.Module):
    """Parameter names follow released DFlash drafters (fc, hidden_norm, layers.N..., norm), so
    trainable_state_dict() is what an engine loads next to the target's embedding and head."""

    def __init__(
        self,
        spec: DrafterSpec,
        embed_weight_VH: Tensor,
        lm_head_weight_VH: Tensor,
        *,
        backend: str,
        sdpa_chunk_blocks: int = 64,
        compile: bool = True,
        tuned_kernels: bool = True,
        flex_kernels: str = "flex",
        fused_qk_norm_rope: bool = False,
    ) -> None:
        super().__init__()
        for name, w in (("embedding", embed_weight_VH), ("lm_head", lm_head_weight_VH)):
            if tuple(w.shape) != (spec.vocab_size, spec.hidden_size):
                raise ConfigError(
                    f"target.{name}",
                    f"shape {tuple(w.shape)} != (vocab {spec.vocab_size}, hidden {spec.hidden_size})",
                )
        self.spec = spec
        self.backend = make_backend(
            backend,
            sdpa_chunk_blocks=sdpa_chunk_blocks,
            compile=compile,
            tuned_kernels=tuned_kernels,
            flex_kernels=flex_kernels,
            fused_qk_norm_rope=fused_qk_norm_rope,
        )
        if fused_qk_norm_rope and (problem := fused_qk_head_dim_problem(spec.head_dim)):
            raise ConfigError("attention.fused_qk_norm_rope", problem)
        qwen3 = spec.qwen3_config()
        # The target's, frozen: non-persistent buffers are outside state_dict and never get grads.
        self.register_buffer("embed_weight_VH", embed_weight_VH.detach(), persistent=False)
        self.register_buffer("lm_head_weight_VH", lm_head_weight_VH.detach(), persistent=False)
        self.fc = nn.Linear(
            len(spec.target_layer_ids) * spec.target_hidden_size, spec.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(spec, qwen3) for _ in range(spec.num_layers))
        self.norm = Qwen3RMSNorm(spec.hidden_size, eps=spec.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)
        self.compiled_norms = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)

    def block_ids(self, input_ids_BS: Tensor, anchors_BA: Tensor) -> Tensor:
        """[token at anchor, mask x (K-1)] per block, flattened to [B, A*K]."""
        B, A = anchors_BA.shape
        K = self.spec.block_size
        first_BA = torch.gather(input_ids_BS, 1, anchors_BA.clamp(min=0))
        ids_BAK = torch.full(
            (B, A, K), self.spec.mask_token_id, dtype=input_ids_BS.dtype, device=input_ids_BS.device
        )
        ids_BAK[:, :, 0] = first_BA
        return ids_BAK.view(B, A * K)

    def forward(
        self,
        input_ids_BS: Tensor,
        target_hidden_BSF: Tensor,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        noise_std: float = 0.0,
    ) -> Tensor:
        B, A, K = *anchors_BA.shape, self.spec.block_size
        windows, plans, ctx_BSH, h_BQH, rope_q, rope_kv = self.layer_inputs(
            input_ids_BS, target_hidden_BSF, anchors_BA, seq_lens_B, noise_std
        )
        ctx_kv = self.context_kv(ctx_BSH).chunk(len(self.layers), dim=-1)
        for layer, window, ctx_kv_BSC in zip(self.layers, windows, ctx_kv, strict=True):
            h_BQH = layer(h_BQH, ctx_kv_BSC, rope_q, rope_kv, self.backend, plans[window])
        return self.outer_norm(self.norm, h_BQH).view(B, A, K, -1)

    def layer_inputs(
        self,
        input_ids_BS: Tensor,
        target_hidden_BSF: Tensor,
        anchors_BA: Tensor,
        seq_lens_B: Tensor,
        noise_std: float = 0.0,
    ) -> LayerInputs:
        """Everything forward's layers read but their own state: the attention plans, the fused
        context, the blocks' embeddings and the rotary tables."""
        B, S = input_ids_BS.shape
        A, K = anchors_BA.shape[1], self.spec.block_size
        autocast = torch.is_autocast_enabled(target_hidden_BSF.device.type)
        # The attention plans first: they depend on the anchors alone, and the sdpa backend reads its
        # slice bounds back to the host, which here waits only for the anchors, not for the fc.
        windows = [self.spec.window(i) for i in range(self.spec.num_layers)]
        plans = self.backend.prepare(
            anchors_BA,
            seq_lens_B,
            context_len=S,
            block_size=K,
            windows=windows,
            sliding_causal=self.spec.sliding_block_causal,
        )
        # Without autocast, compute in the parameters' dtype; under it, autocast picks (no fp32 copies).
        ctx_BSH = self.outer_norm(
            self.hidden_norm,
            self.fc(target_hidden_BSF if autocast else target_hidden_BSF.to(self.fc.weight.dtype)),
        )
        if self.training and noise_std > 0:
            ctx_BSH = ctx_BSH + torch.randn_like(ctx_BSH) * noise_std
        h_BQH = F.embedding(self.block_ids(input_ids_BS, anchors_BA), self.embed_weight_VH).to(ctx_BSH.dtype)

        offsets_K = torch.arange(K, device=anchors_BA.device)
        pos_BQ = (anchors_BA.clamp(min=0)[:, :, None] + offsets_K).view(B, A * K)
        pos_BL = torch.cat([torch.arange(S, device=pos_BQ.device).expand(B, S), pos_BQ], dim=1)
        rope_kv = self.rotary_emb(h_BQH, pos_BL)
        rope_q = (rope_kv[0][:, S:], rope_kv[1][:, S:])
        return LayerInputs(windows, plans, ctx_BSH, h_BQH, rope_q, rope_kv)

    def context_rows(self, target_hidden_BSF: Tensor) -> Tensor:
        """The context's keys and values of every layer for these target positions (context_kv of
        the fused context): a function of each position alone, so a decoding loop keeps the rows
        of the tokens verified so far and appends the newly accepted ones (dflash.specdec)."""
        autocast = torch.is_autocast_enabled(target_hidden_BSF.device.type)
        ctx_BSH = self.outer_norm(
            self.hidden_norm,
            self.fc(target_hidden_BSF if autocast else target_hidden_BSF.to(self.fc.weight.dtype)),
        )
        return self.context_kv(ctx_BSH)

    def draft_block(self, rows_BSC: Tensor, first_B: Tensor) -> Tensor:
        """One block's final hidden states [B, K, H] at the position after the context: [first token,
        mask x (K-1)] anchored at S = rows' length, seeing every context row (within each sliding
        layer's window) and its own block, as in training. rows: context_rows of positions 0..S-1."""
        B, S = rows_BSC.shape[:2]
        K = self.spec.block_size
        anchors_BA = torch.full((B, 1), S, dtype=torch.long, device=rows_BSC.device)
        seq_lens_B = torch.full((B,), S, dtype=torch.long, device=rows_BSC.device)
        windows = [self.spec.window(i) for i in range(self.spec.num_layers)]
        plans = self.backend.prepare(
            anchors_BA,
            seq_lens_B,
            context_len=S,
            block_size=K,
            windows=windows,
            sliding_causal=self.spec.sliding_block_causal,
        )
        ids_BK = torch.full((B, K), self.spec.mask_token_id, dtype=torch.long, device=rows_BSC.device)
        ids_BK[:, 0] = first_B
        h_BQH = F.embedding(ids_BK, self.embed_weight_VH).to(self.fc.weight.dtype)
        pos_BL = torch.arange(S + K, device=rows_BSC.device).expand(B, S + K)
        rope_kv = self.rotary_emb(h_BQH, pos_BL)
        rope_q = (rope_kv[0][:, S:], rope_kv[1][:, S:])
        for layer, window, rows in zip(
            self.layers, windows, rows_BSC.chunk(len(self.layers), dim=-1), strict=True
        ):
            h_BQH = layer(h_BQH, rows, rope_q, rope_kv, self.backend, plans[window])
        return self.outer_norm(self.norm, h_BQH)

    def context_kv(self, ctx_BSH: Tensor) -> Tensor:
        """The context's keys and values of every layer, [B, S, layers * 2 * kv_heads * head_dim]:
        layer i's k_proj then v_proj outputs, layer after layer, in one product (the weights
        concatenated; their gradients flow back to each layer's k_proj and v_proj)."""
        w = torch.cat(
            [p.weight for layer in self.layers for p in (layer.self_attn.k_proj, layer.self_attn.v_proj)]
        )
        if not torch.is_autocast_enabled(ctx_BSH.device.type):
            ctx_BSH = ctx_BSH.to(w.dtype)
        return F.linear(ctx_BSH, w)

    def outer_norm(self, norm: Qwen3RMSNorm, x: Tensor) -> Tensor:
        """The norms outside the decoder layers (the context's and the final one), compiled when the
        layers are (compile_outer_norms): eagerly each is about ten kernels over the [tokens, H]
        activations forward and backward."""
        if not self.compiled_norms:
            return norm(x)
        x_NH = x.reshape(-1, x.shape[-1])
        torch._dynamo.mark_dynamic(x_NH, 0)  # tokens vary with the bucket: one graph for all of them
        return _rms_norm_compiled()(x_NH, norm.weight, norm.variance_epsilon).view(x.shape)

    def compile_outer_norms(self) -> None:
        """Compile the outer norms (dflash.step.trainer.apply_compile does on a GPU)."""
        self.compiled_norms = True

    def lm_head(self, hidden_NH: Tensor) -> Tensor:
        if torch.is_autocast_enabled(hidden_NH.device.type):
            return F.linear(hidden_NH, self.lm_head_weight_VH)  # autocast casts; no fp32 copy of [V, H]
        return F.linear(hidden_NH, self.lm_head_weight_VH.to(hidden_NH.dtype))

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}


def make_backend(
    name: str,
    *,
    sdpa_chunk_blocks: int = 64,
    compile: bool = True,
    tuned_kernels: bool = True,
    flex_kernels: str = "flex",
    fused_qk_norm_rope: bool = False,
) -> AttentionBackend:
    """flex | sdpa | eager. Imports lazily: flex compiles at import, which sdpa-only runs skip.
    tuned_kernels: flex uses the kernel options measured for this GPU (flex.TUNED_KERNEL_OPTIONS);
    flex_kernels: flex's own kernels or dflash's hand-written ones (dflash.step.attention.triton_attention);
    fused_qk_norm_rope: with dflash's, the q/k norm + rotary embedding too (dflash.step.attention.qk_norm_rope)."""
    if name == "flex":
        from dflash.step.attention.flex import FlexBackend

        return FlexBackend(
            compile=compile, tuned=tuned_kernels, kernels=flex_kernels, fused_qk_norm_rope=fused_qk_norm_rope
        )
    if name == "sdpa":
        from dflash.step.attention.sdpa import SdpaBackend

        return SdpaBackend(chunk_blocks=sdpa_chunk_blocks)
    if name == "eager":
        from dflash.step.attention.reference import EagerBackend

        return EagerBackend()
    raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
