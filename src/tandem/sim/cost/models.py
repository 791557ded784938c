"""Transformer shapes of the models the analytic cost model knows (written from public knowledge).

The numbers are those of each model's published Hugging Face `config.json` (layers, hidden size,
attention heads, KV heads, head dim, MLP intermediate size, vocabulary, tied embeddings), written
out here from memory of those public files, not downloaded; parameter counts computed from them
match the published sizes (Qwen3-32B 32.8B, Llama-3.1-8B 8.0B, GPT-J 6.05B, ...). Owns shapes and
the byte/FLOP counts derived from them; knows nothing of hardware or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelArch:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    gated_mlp: bool = True          # SwiGLU (gate, up, down) vs GPT-J's two-matrix MLP
    bytes_per_param: int = 2        # bf16 weights
    kv_bytes_per_value: int = 2     # bf16 KV cache

    @property
    def layer_params(self) -> int:
        """Weights of the transformer blocks (attention + MLP; norms are negligible)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return self.num_layers * (attn + mlp)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.layer_params + embed + (0 if self.tied_embeddings else self.lm_head_params)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes_per_value

    @property
    def attention_width(self) -> int:
        """num_heads * head_dim: the query width, which sets attention FLOPs per query-key pair."""
        return self.num_heads * self.head_dim


def _m(name: str, layers: int, hidden: int, heads: int, kv: int, hd: int, inter: int, vocab: int,
       tied: bool = False, gated: bool = True) -> ModelArch:
    return ModelArch(name, layers, hidden, heads, kv, hd, inter, vocab, tied, gated)


MODELS: dict[str, ModelArch] = {m.name: m for m in (
    _m("qwen3-0.6b", 28, 1024, 16, 8, 128, 3072, 151936, tied=True),
    _m("qwen3-1.7b", 28, 2048, 16, 8, 128, 6144, 151936, tied=True),
    _m("qwen3-4b", 36, 2560, 32, 8, 128, 9728, 151936, tied=True),
    _m("qwen3-8b", 36, 4096, 32, 8, 128, 12288, 151936),
    _m("qwen3-14b", 40, 5120, 40, 8, 128, 17408, 151936),
    _m("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936),
    _m("llama3-1b", 16, 2048, 32, 8, 64, 8192, 128256, tied=True),      # Llama 3.2 1B
    _m("llama3-3b", 28, 3072, 24, 8, 128, 8192, 128256, tied=True),     # Llama 3.2 3B
    _m("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256),               # Llama 3 / 3.1 8B
    _m("llama3-70b", 80, 8192, 64, 8, 128, 28672, 128256),              # Llama 3 / 3.1 / 3.3 70B
    _m("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000),               # 7B-class with full MHA KV
    _m("llama2-13b", 40, 5120, 40, 40, 128, 13824, 32000),              # the 13B-class config
    _m("gpt-j-6b", 28, 4096, 16, 16, 256, 16384, 50400, gated=False),
    _m("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied=True),      # Tandem's default (CPU) model
)}


def get_model(name_or_dict: str | dict) -> ModelArch:
    """A known model by name, or a custom one from a dict of ModelArch fields."""
    if isinstance(name_or_dict, dict):
        return ModelArch(**name_or_dict)
    key = name_or_dict.lower()
    if key not in MODELS:
        raise ValueError(f"unknown model {name_or_dict!r}; known: {', '.join(MODELS)} "
                         "(or give a dict of ModelArch fields)")
    return MODELS[key]
