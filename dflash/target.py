"""The frozen target: a local Hugging Face causal LM that returns only the k hidden states the drafter
conditions on, and a reader for the embedding / LM head alone (drafter processes need just those).

Memory: the model is loaded with its config cut to the last needed layer, so later layers' weights are
never materialised; the final norm is replaced by identity and the LM head is dropped. Forward hooks
copy each needed layer's output into one preallocated [B, L, k*H] tensor, so no other layer's
activations outlive its own forward.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.errors import DFlashError


def check_model_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise DFlashError(
            f"target.path {path} is not a directory; pass a local Hugging Face model directory "
            "(config.json + *.safetensors), or `tiny` for the demo"
        )
    if not (p / "config.json").is_file():
        raise DFlashError(
            f"target.path {path} has no config.json; pass the directory a model was save_pretrained to"
        )
    if not any(p.glob("*.safetensors")):
        raise DFlashError(
            f"target.path {path} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(save_pretrained(..., safe_serialization=True)) and pass that directory"
        )
    return p


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _decoder_layers(base: nn.Module, num_layers: int) -> nn.ModuleList:
    layers = getattr(base, "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    for module in base.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise DFlashError(
        f"cannot find the decoder layers of {type(base).__name__}; this architecture is not supported"
    )


def _placement(device: torch.device | str) -> dict[str, Any]:
    """Load straight onto the GPU when accelerate is installed: several target workers each staging a
    27B model in host memory first would need T x 54 GB of RAM. Without it, load on CPU then move."""
    if torch.device(device).type == "cpu" or importlib.util.find_spec("accelerate") is None:
        return {}
    return {"device_map": {"": str(device)}}


class TargetCapture:
    """Frozen target returning only the hidden states of `layer_ids` (output of decoder layer i, 0-based,
    before the final norm), concatenated in layer_ids order: [B, L, k*H]."""

    def __init__(
        self,
        path: str,
        layer_ids: list[int],
        *,
        dtype: torch.dtype,
        device: torch.device,
        compile: bool = False,
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        model_dir = check_model_dir(path)
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
        text_cfg = _text_config(config)
        n = int(text_cfg.num_hidden_layers)
        if not layer_ids:
            raise DFlashError("drafter.target_layer_ids is empty; give at least one target layer")
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise DFlashError(f"drafter.target_layer_ids {bad} are outside the target's layers 0..{n - 1}")
        self.layer_ids = list(layer_ids)
        keep = max(layer_ids) + 1
        # Load only the layers up to the last needed one: the rest of the checkpoint is never read into memory.
        text_cfg.num_hidden_layers = keep
        if isinstance(getattr(text_cfg, "layer_types", None), list):
            text_cfg.layer_types = text_cfg.layer_types[:keep]
        previous = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the skipped layers' weights are "unused" on purpose
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), config=config, dtype=dtype, local_files_only=True, **_placement(device)
            )
        finally:
            hf_logging.set_verbosity(previous)
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        if isinstance(getattr(base, "norm", None), nn.Module):
            base.norm = nn.Identity()  # skip the final norm: the captured states are pre-norm anyway
        if hasattr(model, "lm_head"):
            del model.lm_head
        self.model = base.to(device).eval().requires_grad_(False)
        self.config = config
        self.hidden_size = int(text_cfg.hidden_size)
        self.device = torch.device(device)
        self.dtype = dtype
        self._out: torch.Tensor | None = None
        layers = _decoder_layers(base, keep)
        for slot, layer_id in enumerate(self.layer_ids):
            layers[layer_id].register_forward_hook(self._make_hook(slot))
        if compile:
            # Regional: each layer's forward is compiled (identical layers share one graph per shape)
            # and the capture hooks run eagerly around it. Compiling the whole module call would trace
            # the hooks too, one graph per captured slot (the slot is a constant of the hook), past
            # the plan's recompile limit (dflash.plan.shapes counts the layer graphs).
            for layer in layers:
                layer.forward = torch.compile(layer.forward, dynamic=False)

    def _make_hook(self, slot: int):  # noqa: ANN202 - a torch hook
        h = self.hidden_size

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            assert self._out is not None
            self._out[..., slot * h : (slot + 1) * h].copy_(hidden)

        return hook

    @torch.no_grad()
    def __call__(self, input_ids_BL: torch.Tensor, seq_lens_B: torch.Tensor) -> torch.Tensor:
        B, L = input_ids_BL.shape
        input_ids_BL = input_ids_BL.to(self.device)
        positions_L = torch.arange(L, device=self.device)
        attention_mask_BL: torch.Tensor | None = (
            positions_L[None, :] < seq_lens_B.to(self.device)[:, None]
        ).long()
        if bool(attention_mask_BL.all()):
            # No padding: a plain causal mask lets SDPA take its flash kernel instead of a masked one.
            attention_mask_BL = None
        position_ids_BL = positions_L[None, :].expand(B, L)
        out = torch.empty(B, L, len(self.layer_ids) * self.hidden_size, dtype=self.dtype, device=self.device)
        self._out = out
        try:
            self.model(
                input_ids=input_ids_BL,
                attention_mask=attention_mask_BL,
                position_ids=position_ids_BL,
                use_cache=False,
            )
        finally:
            self._out = None
        return out


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor name -> the safetensors file holding it (the index json when sharded, else the
    files' headers), read once."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    found: dict[str, Path] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                found[key] = f
    return found


def load_frozen_head(
    path: str, *, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(embed_weight_VH, lm_head_weight_VH, config) read straight from the safetensors files."""
    from safetensors import safe_open
    from transformers import AutoConfig

    model_dir = check_model_dir(path)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    files = _tensor_files(model_dir)
    names = list(files)
    embeds = sorted((n for n in names if n.endswith("embed_tokens.weight")), key=len)
    if not embeds:
        raise DFlashError(
            f"no `*embed_tokens.weight` tensor in {model_dir}; this checkpoint layout is not supported"
        )
    embed_name = embeds[0]
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        tied = getattr(_text_config(config), "tie_word_embeddings", False)
    head_name = None
    if not tied:
        heads = sorted((n for n in names if n.endswith("lm_head.weight")), key=len)
        if not heads:
            raise DFlashError(
                f"{model_dir} has untied embeddings but no `lm_head.weight` tensor; the checkpoint is incomplete"
            )
        head_name = heads[0]
    wanted = [embed_name] + ([head_name] if head_name else [])
    tensors: dict[str, torch.Tensor] = {}
    for name in wanted:
        with safe_open(str(files[name]), framework="pt", device="cpu") as st:
            tensors[name] = st.get_tensor(name).to(dtype=dtype, device=device)
    embed = tensors[embed_name]
    head = tensors[head_name] if head_name else embed
    return embed, head, config
