"""Load a Hugging Face model directory (config.json + safetensors) into a fused `LlamaModel`.

Every failure a user can cause (missing directory, unsupported architecture, a truncated or
corrupt safetensors file, a missing or misshapen tensor) becomes a `ModelLoadError` naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.errors import ModelLoadError
from tandem.models.arch import ArchConfig
from tandem.models.llama import LlamaModel


def load_arch(model_dir: Path) -> ArchConfig:
    from transformers import AutoConfig

    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        json.loads(cfg_path.read_text())
        hf = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    return ArchConfig.from_hf(hf)


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no .safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {f}: {e}") from e
    return tensors


class _Weights:
    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.tensors = tensors
        self.dtype = dtype

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelLoadError(f"weight {name!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(self.dtype)

    def cat(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes)], dim=0)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               prepack: bool = True) -> LlamaModel:
    arch = load_arch(model_dir)
    w = _Weights(_read_tensors(model_dir), dtype)
    model = LlamaModel(arch, dtype, max_positions)
    _fill(model, arch, w)
    model = model.to(device).eval()
    if device.type == "cpu" and prepack:
        model.prepack()
    return model


def _fill(model: LlamaModel, a: ArchConfig, w: _Weights) -> None:
    h, d = a.hidden_size, a.head_dim
    qkv_shapes = [(a.q_size, h), (a.kv_size, h), (a.kv_size, h)]
    model.embed.data = w.get("model.embed_tokens.weight", (a.vocab_size, h))
    model.norm.data = w.get("model.norm.weight", (h,))
    if a.tie_word_embeddings:
        model.lm_head.weight = model.embed
    else:
        model.lm_head.weight.data = w.get("lm_head.weight", (a.vocab_size, h))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        layer.input_norm.data = w.get(p + "input_layernorm.weight", (h,))
        layer.post_norm.data = w.get(p + "post_attention_layernorm.weight", (h,))
        names = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        layer.qkv.weight.data = w.cat(names, qkv_shapes)
        if a.qkv_bias:
            layer.qkv.bias.data = w.cat([n.replace("weight", "bias") for n in names],
                                        [(a.q_size,), (a.kv_size,), (a.kv_size,)])
        layer.o.weight.data = w.get(p + "self_attn.o_proj.weight", (h, a.q_size))
        if a.o_bias:
            layer.o.bias.data = w.get(p + "self_attn.o_proj.bias", (h,))
        if a.qk_norm:
            layer.q_norm.data = w.get(p + "self_attn.q_norm.weight", (d,))
            layer.k_norm.data = w.get(p + "self_attn.k_norm.weight", (d,))
        ff = a.intermediate_size
        layer.gate_up.weight.data = w.cat([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(ff, h), (ff, h)])
        layer.down.weight.data = w.get(p + "mlp.down_proj.weight", (h, ff))
        if a.mlp_bias:
            layer.gate_up.bias.data = w.cat([p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"], [(ff,), (ff,)])
            layer.down.bias.data = w.get(p + "mlp.down_proj.bias", (h,))
