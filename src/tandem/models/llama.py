"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are fused for speed (q/k/v in one matmul, gate/up in one matmul). The model sees a flat
batch of N tokens from many requests; attention is delegated to a paged-attention backend that
reads and writes the KV cache through the step's `AttentionMetadata`. The model knows nothing of
requests, scheduling or sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.arch import ArchConfig
from tandem.runner.attention import AttentionBackend, AttentionMetadata


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight can be prepacked for oneDNN (`prepack`), which measured
    1.3-2x faster than MKL's sgemm on this project's 2-core AVX2 machine at 1-64 rows."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self._packed: torch.Tensor | None = None

    def prepack(self, release: bool = True) -> bool:
        """Switch to oneDNN prepacked weights if available and numerically equal.

        `release` frees the plain weight afterwards (not for a weight shared with the embedding)."""
        if self.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.data, 8)
            x = torch.randn(3, self.weight.shape[1], dtype=self.weight.dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
            ok = torch.allclose(got, F.linear(x, self.weight, self.bias), rtol=1e-3, atol=1e-3)
        except (RuntimeError, AttributeError):
            return False
        if ok:
            self._packed = packed
            if release:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return ok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
        self.input_norm = _param(h, dtype=dtype)
        self.post_norm = _param(h, dtype=dtype)
        self.qkv = Linear(qkv, h, cfg.qkv_bias, dtype)
        self.o = Linear(h, cfg.q_size, cfg.o_bias, dtype)
        self.q_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype) if cfg.qk_norm else None
        self.gate_up = Linear(2 * cfg.intermediate_size, h, cfg.mlp_bias, dtype)
        self.down = Linear(h, cfg.intermediate_size, cfg.mlp_bias, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend,
                meta: AttentionMetadata, layer_idx: int) -> torch.Tensor:
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        n = x.shape[0]                                                    # x: [N, hidden]
        h = F.rms_norm(x, (cfg.hidden_size,), self.input_norm, eps)
        qkv = self.qkv(h)                # [N, (H + 2 KV) * D]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(n, cfg.num_heads, cfg.head_dim)
        k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q = F.rms_norm(q, (cfg.head_dim,), self.q_norm, eps)
            k = F.rms_norm(k, (cfg.head_dim,), self.k_norm, eps)
        q = q * cos + rotate_half(q) * sin                                # cos/sin: [N, 1, D]
        k = k * cos + rotate_half(k) * sin
        o = attn.forward(layer_idx, q, k, v, meta)                        # [N, H * D]
        x = x + self.o(o)
        h = F.rms_norm(x, (cfg.hidden_size,), self.post_norm, eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        self.lm_head = Linear(cfg.vocab_size, cfg.hidden_size, False, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed
        inv_freq, scaling = cfg.rope_inv_freq()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)                           # [P, D]
        self.register_buffer("rope_cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("rope_sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                meta: AttentionMetadata, num_layers: int | None = None) -> torch.Tensor:
        """Hidden states (before the final norm) of every input token: [N, hidden].

        `num_layers` runs only the first layers (layer-skip self-speculation)."""
        x = F.embedding(input_ids, self.embed)                            # [N, hidden]
        cos = self.rope_cos[positions].unsqueeze(1)                       # [N, 1, D]
        sin = self.rope_sin[positions].unsqueeze(1)
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        for i, layer in enumerate(layers):
            x = layer(x, cos, sin, attn, meta, i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on selected rows: [M, hidden] -> [M, vocab] (float32)."""
        h = F.rms_norm(hidden, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def prepack(self) -> int:
        """Prepack every linear layer for the CPU backend; returns how many were packed."""
        shared = self.lm_head.weight is self.embed
        return sum(m.prepack(release=not (m is self.lm_head and shared))
                   for m in self.modules() if isinstance(m, Linear))
