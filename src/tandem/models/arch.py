"""What Tandem needs to know of a model's architecture, read from a Hugging Face config.

Supported: the Llama family (Llama 2/3, SmolLM2, Mistral-style grouped-query attention), Qwen2
(q/k/v bias) and Qwen3 (per-head q/k RMSNorm); tied or untied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    hf_config: Any  # the transformers config, for RoPE parameters

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """RoPE inverse frequencies and attention scaling, computed by transformers' own functions
        (Llama 3's rope_scaling included), divided by `rope_freq_factors` where a converted GGUF
        carries llama.cpp divisors that are not Llama 3's scheme (tandem.models.gguf_convert)."""
        inv, scaling = self._rope_inv_freq()
        factors = getattr(self.hf_config, "rope_freq_factors", None)
        if factors:
            if len(factors) != inv.numel():
                raise ModelLoadError(f"rope_freq_factors has {len(factors)} values, RoPE has {inv.numel()} "
                                     "frequencies")
            inv = inv / torch.tensor(factors, dtype=inv.dtype)
        return inv, scaling

    def _rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(self.hf_config, "rope_parameters", None) or getattr(self.hf_config, "rope_scaling", None) or {}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            inv = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
            return inv, 1.0
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ModelLoadError(f"unsupported rope type {rope_type!r}")
        if rope_type == "dynamic":
            raise ModelLoadError("dynamic NTK RoPE is not supported (its frequencies depend on the sequence length)")
        return ROPE_INIT_FUNCTIONS[rope_type](self.hf_config)

    @classmethod
    def from_hf(cls, hf: Any) -> "ArchConfig":
        model_type = getattr(hf, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"unsupported model type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        attention_bias = bool(getattr(hf, "attention_bias", False))
        window = getattr(hf, "sliding_window", None)
        if model_type == "qwen2" and not getattr(hf, "use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=window,
            hf_config=hf,
        )
