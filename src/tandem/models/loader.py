"""Load a Hugging Face model directory (config.json + safetensors) into a fused `LlamaModel`.

Every failure a user can cause (missing directory, unsupported architecture, a truncated or
corrupt safetensors file, a missing or misshapen tensor) becomes a `ModelLoadError` naming it; a
quantized checkpoint (FP8, GPTQ, AWQ, bitsandbytes, compressed-tensors, ...) an
`UnsupportedQuantizationError` naming the method and what to load instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.errors import ModelLoadError, UnsupportedQuantizationError
from tandem.models.arch import ArchConfig
from tandem.models.llama import Linear, LlamaModel


def load_arch(model_dir: Path) -> ArchConfig:
    from transformers import AutoConfig

    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    check_quantization(model_dir, raw)          # before transformers, which may want the method's package
    try:
        hf = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"cannot read {cfg_path}: {e}") from e
    return ArchConfig.from_hf(hf)


# What to do instead, per quantization method (quant_method in config.json's quantization_config).
_QUANT_ADVICE = {
    "fp8": "FP8 checkpoints need FP8 kernels; use the BF16/FP16 model it was made from",
    "fbgemm_fp8": "FP8 checkpoints need FP8 kernels; use the BF16/FP16 model it was made from",
    "gptq": "GPTQ stores packed int4/int8 weights with scales and zeros; use the unquantized model, or a GGUF "
            "of it (Q4_1/Q8_0 stay quantized on CPU)",
    "awq": "AWQ stores packed int4 weights with scales; use the unquantized model, or a GGUF of it "
           "(Q4_1/Q8_0 stay quantized on CPU)",
    "bitsandbytes": "bitsandbytes packs 4/8-bit weights for its own CUDA kernels; use the unquantized model "
                    "(transformers' load_in_4bit quantizes at load, so the original checkpoint is what to give)",
    "compressed-tensors": "compressed-tensors (llm-compressor: FP8, INT8 W8A8, INT4 W4A16...) stores packed "
                          "weights and scales; use the unquantized model it was compressed from",
}


def check_quantization(model_dir: Path, raw: dict) -> None:
    """UnsupportedQuantizationError for a checkpoint whose weights are quantized by a method this
    loader would misread: its packed weights and scales would load as plain tensors, or be dropped.
    Every method is refused (Tandem runs float weights, and GGUF blocks through its converter); the
    message names the method and what to give instead."""
    quant = raw.get("quantization_config") if isinstance(raw, dict) else None
    source = "config.json quantization_config"
    if not quant and (model_dir / "quantize_config.json").is_file():   # AutoGPTQ's older layout
        try:
            quant = json.loads((model_dir / "quantize_config.json").read_text())
        except (ValueError, OSError):
            quant = {}
        quant = dict(quant) if isinstance(quant, dict) else {}
        quant.setdefault("quant_method", "gptq")
        source = "quantize_config.json"
    if not quant:
        return
    method = str(quant.get("quant_method") or "unknown") if isinstance(quant, dict) else "unknown"
    bits = quant.get("bits") if isinstance(quant, dict) else None
    advice = _QUANT_ADVICE.get(method.lower(), "use the unquantized model")
    raise UnsupportedQuantizationError(
        f"{model_dir} is a {method!r}-quantized checkpoint ({source}{f', {bits}-bit' if bits else ''}), which "
        f"Tandem cannot run: it runs float weights (float32/bfloat16/float16) and GGUF files (Q4_1/Q8_0 "
        f"run quantized on CPU, other types are dequantized at load). {advice}.", method)


class _Weights:
    """Tensors of all *.safetensors files, read one at a time (memory-mapped) when asked for."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        from safetensors import safe_open

        self.dtype = dtype
        self.files = sorted(model_dir.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{model_dir} has no .safetensors weights" + (
                "; it is a configuration only: run it with random weights (--load-format dummy, "
                "LLM(load_format='dummy'))" if (model_dir / "config.json").is_file() else ""))
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
    """The model of `model_dir` with float weights (written first from its GGUF where a conversion
    left them out: tandem.models.gguf_convert.ensure_float_weights)."""
    from tandem.models.gguf_convert import ensure_float_weights

    arch = load_arch(model_dir)
    ensure_float_weights(model_dir)
    w = _Weights(model_dir, dtype)
    return build_model(arch, dtype, device, max_positions, lambda m: _fill_globals(m, arch, w),
                       lambda layer, i: _fill_layer(layer, i, arch, w), prepack)


def build_model(arch: ArchConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                fill_globals, fill_layer, prepack: bool = True) -> LlamaModel:
    """A LlamaModel whose weights `fill_globals(model)` and `fill_layer(layer, i)` write, layer by
    layer: fill, move, prepack (freeing plain weights), so peak memory stays near the final size."""
    model = LlamaModel(arch, dtype, max_positions)
    fill_globals(model)
    for i, layer in enumerate(model.layers):
        fill_layer(layer, i)
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


def linear_parts(a: ArchConfig, i: int) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Layer i's fused linear layers (attribute name) -> the Hugging Face weights stacked into each,
    with their shapes (biases: the same names with "bias", where the architecture has them)."""
    h, p, ff = a.hidden_size, f"model.layers.{i}.", a.intermediate_size
    return {"qkv": [(p + f"self_attn.{x}_proj.weight", (n, h)) for x, n in (("q", a.q_size), ("k", a.kv_size),
                                                                            ("v", a.kv_size))],
            "o": [(p + "self_attn.o_proj.weight", (h, a.q_size))],
            "gate_up": [(p + "mlp.gate_proj.weight", (ff, h)), (p + "mlp.up_proj.weight", (ff, h))],
            "down": [(p + "mlp.down_proj.weight", (h, ff))]}


def fill_linear(linear: Linear, parts: list[tuple[str, tuple[int, ...]]], w: _Weights, weight: bool = True) -> None:
    """Read a (fused) linear layer's weight (unless `weight` is False), and its bias if it has one, from `w`."""
    if weight:
        linear.weight.data = w.cat([n for n, _ in parts], [s for _, s in parts])
    if linear.bias is not None:
        linear.bias.data = w.cat([n[:-len("weight")] + "bias" for n, _ in parts], [s[:1] for _, s in parts])


def fill_norms(layer, i: int, a: ArchConfig, w: _Weights) -> None:
    h, d, p = a.hidden_size, a.head_dim, f"model.layers.{i}."
    layer.input_norm.data = w.get(p + "input_layernorm.weight", (h,))
    layer.post_norm.data = w.get(p + "post_attention_layernorm.weight", (h,))
    if a.qk_norm:
        layer.q_norm.data = w.get(p + "self_attn.q_norm.weight", (d,))
        layer.k_norm.data = w.get(p + "self_attn.k_norm.weight", (d,))


def _fill_layer(layer, i: int, a: ArchConfig, w: _Weights) -> None:
    fill_norms(layer, i, a, w)
    for attr, parts in linear_parts(a, i).items():
        fill_linear(getattr(layer, attr), parts, w)
