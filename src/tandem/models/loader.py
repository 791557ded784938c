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
from tandem.models.llama import Linear, LlamaModel


def load_arch(model_dir: Path) -> ArchConfig:
    from transformers import AutoConfig

    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_path.read_text())
        hf = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quant:
        # FP8, GPTQ, AWQ, bitsandbytes...: the safetensors hold packed weights and scales this loader
        # would read as plain tensors (or drop): refuse rather than serve garbage.
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else "unknown"
        raise ModelLoadError(f"{model_dir} is a {method!r}-quantized checkpoint (config.json quantization_config), "
                             "which Tandem cannot run; use the unquantized model, or a GGUF file "
                             "(Q4_0/Q4_1/Q8_0 run quantized, other types are dequantized at load)")
    return ArchConfig.from_hf(hf)


class _Weights:
    """Tensors of all *.safetensors files, read one at a time (memory-mapped) when asked for."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{model_dir} has no .safetensors weights")
        self.handles = {}
        self.where: dict[str, Path] = {}
        for f in self.files:
            try:
                h = safe_open(str(f), framework="pt")
                for name in h.keys():
                    self.where[name] = f
                self.handles[f] = h
            except Exception as e:  # SafetensorError, OSError, ... on damaged headers
                raise ModelLoadError(f"corrupt or truncated safetensors file {f}: {e}") from e

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        f = self.where.get(name)
        if f is None:
            raise ModelLoadError(f"weight {name!r} is missing")
        try:
            t = self.handles[f].get_tensor(name)
        except Exception as e:  # data past the end of a truncated file
            raise ModelLoadError(f"corrupt or truncated safetensors file {f} (tensor {name!r}): {e}") from e
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.to(self.dtype, copy=True)

    def cat(self, names: list[str], shapes: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.cat([self.get(n, s) for n, s in zip(names, shapes)], dim=0)


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
               prepack: bool = True) -> LlamaModel:
    arch = load_arch(model_dir)
    w = _Weights(model_dir, dtype)
    model = LlamaModel(arch, dtype, max_positions)
    # Layer by layer: fill, move, prepack (freeing plain weights), so peak memory stays near the final size.
    _fill_globals(model, arch, w)
    for i, layer in enumerate(model.layers):
        _fill_layer(layer, i, arch, w)
        layer.to(device)
        if device.type == "cpu" and prepack:
            for m in layer.modules():
                if isinstance(m, Linear):
                    m.prepack()
    model = model.to(device).eval()
    if device.type == "cpu" and prepack:
        model.lm_head.prepack(release=not arch.tie_word_embeddings)
    return model


def _fill_globals(model: LlamaModel, a: ArchConfig, w: _Weights) -> None:
    h = a.hidden_size
    model.embed.data = w.get("model.embed_tokens.weight", (a.vocab_size, h))
    model.norm.data = w.get("model.norm.weight", (h,))
    if a.tie_word_embeddings:
        model.lm_head.weight = model.embed
    else:
        model.lm_head.weight.data = w.get("lm_head.weight", (a.vocab_size, h))


def _fill_layer(layer, i: int, a: ArchConfig, w: _Weights) -> None:
    h, d = a.hidden_size, a.head_dim
    qkv_shapes = [(a.q_size, h), (a.kv_size, h), (a.kv_size, h)]
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
