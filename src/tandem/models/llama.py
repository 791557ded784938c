"""The Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

Weights are fused for speed (q/k/v in one matmul, gate/up in one matmul) and the residual stream
is updated in place with a fused add + RMSNorm. The model sees a flat batch of N tokens from many
requests; attention is delegated to a paged-attention backend that reads and writes the KV cache
through the step's `AttentionMetadata`; small per-layer ops go through `ops` (fused C++ kernels on
CPU, plain PyTorch elsewhere). The model knows nothing of requests, scheduling or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.arch import ArchConfig
from tandem.runner.attention import AttentionBackend, AttentionMetadata
from tandem.runner.kernels import TorchOps


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T + b. On CPU the weight is prepacked once at load (`prepack`) for Tandem's own
    kernels where they run: float32 weights into the 16-column panels of `packed_linear`
    (csrc/packed_linear.cpp), bfloat16 weights on CPUs with AVX512-BF16 into the 32-column pair panels
    of `packed_linear_bf16` (csrc/linear_bf16.cpp, which runs steps of 2+ rows on AMX tiles where the
    CPU has them); anything else (or without the compiled kernels) for oneDNN. The packed kernels
    are chosen where they beat oneDNN: at decode's few rows (at prefill's many the two are level,
    and on AMX the tiles on the panels lead)."""

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self._packed: torch.Tensor | None = None       # oneDNN's layout
        self._panels: torch.Tensor | None = None       # Tandem's [N/16, K, 16] layout (float32)
        self._panels_bf16: torch.Tensor | None = None  # Tandem's [N/32, K/2, 64] layout (bfloat16)
        self._kernels = None
        self.quant = None           # tandem.models.quant.QuantWeight: GGUF blocks for small steps
        self.quant_ops = None
        self.float_released = False  # the 8-bit kernel serves every step: float weights freed (quant.release_layer)

    def prepack(self, release: bool = True) -> bool:
        """Switch to prepacked weights if a packed path is available and numerically equal.

        `release` frees the plain weight afterwards (not for a weight shared with the embedding)."""
        if self.weight.device.type != "cpu":
            return False
        if not ((self.weight.dtype == torch.float32 and self._pack_panels())
                or (self.weight.dtype == torch.bfloat16 and self._pack_panels_bf16()) or self._pack_onednn()):
            return False
        if release:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)
        return True

    def _pack_panels(self) -> bool:
        from tandem.runner.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if kernels is None or not hasattr(kernels, "packed_linear"):
            return False
        panels = kernels.pack_linear(self.weight.data.contiguous())
        x = torch.randn(7, self.in_features)
        got = kernels.packed_linear(x, panels, self.bias, self.out_features)
        if not torch.allclose(got, F.linear(x, self.weight, self.bias), rtol=1e-4, atol=1e-4):
            return False
        self._panels, self._kernels = panels, kernels
        return True

    def _pack_panels_bf16(self) -> bool:
        from tandem.runner.kernels import load_cpu_kernels

        kernels = load_cpu_kernels()
        if (kernels is None or not hasattr(kernels, "bf16_linear_available") or not kernels.bf16_linear_available()
                or self.in_features % 2):
            return False
        panels = kernels.pack_linear_bf16(self.weight.data)
        x = torch.randn(7, self.in_features, dtype=torch.bfloat16)
        got = kernels.packed_linear_bf16(x, panels, self.bias, self.out_features).float()
        ref = F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        if not torch.allclose(got, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max())):
            return False
        self._panels_bf16, self._kernels = panels, kernels
        return True

    def _pack_onednn(self) -> bool:
        if not torch.backends.mkldnn.is_available():
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
        return ok

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quant
        if q is not None:
            if x.shape[0] <= q.i8_max_rows:
                # forward_i8, inlined: a decode step makes 4 such calls per layer, and at one row
                # each Python frame is a tenth of the kernel's time
                if q.i8_parts:
                    return self.quant_ops.quant_linear_i8_parts(x, q.i8, self.bias, q.i8_parts)
                return self.quant_ops.quant_linear_i8(x, q.i8, self.bias, self.out_features, q.i8_qtype)
            if x.shape[0] <= q.max_rows:
                return self.forward_quant(x)
        return self.forward_dense(x)

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        if self.float_released:
            raise RuntimeError("this layer's float weights were released: its 8-bit kernel serves every step size")
        if self._panels is not None:
            return self._kernels.packed_linear(x.contiguous(), self._panels, self.bias, self.out_features)
        if self._panels_bf16 is not None:
            return self._kernels.packed_linear_bf16(x.contiguous(), self._panels_bf16, self.bias, self.out_features)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def forward_i8(self, x: torch.Tensor) -> torch.Tensor:
        """Q4_1 / Q8_0 / Q6_K weights times x rounded to 8 bits per block of 32, llama.cpp's arithmetic
        (see tandem.models.quant); float32 or bfloat16 in, the same out."""
        q = self.quant
        if q.i8_parts:
            return self.quant_ops.quant_linear_i8_parts(x, q.i8, self.bias, q.i8_parts)
        return self.quant_ops.quant_linear_i8(x, q.i8, self.bias, self.out_features, q.i8_qtype)

    def forward_quant(self, x: torch.Tensor) -> torch.Tensor:
        """The weight-only quantized kernel on the GGUF blocks (see tandem.models.quant)."""
        if self.float_released:
            raise RuntimeError("this layer's GGUF blocks were released: its 8-bit kernel serves every step size")
        if self.quant.packed_bf16:
            return self.quant_ops.quant_linear_bf16(x.contiguous().to(torch.bfloat16), self.quant.data, self.bias,
                                                    self.quant.qtype, self.out_features).to(x.dtype)
        bias = None if self.bias is None else self.bias.float()
        y = self.quant_ops.quant_linear(x.contiguous().float(), self.quant.data, bias, self.quant.qtype)
        return y if y.dtype == x.dtype else y.to(x.dtype)


@dataclass(frozen=True)
class DecoderStack:
    """A model's decoder layers as one C++ object (`LlamaModel.decoder_stack`) and the steps it
    serves: decode-only steps (every row in the batched group, no prefill chunk) of at most
    `max_rows` rows, the most at which every layer still runs the 8-bit kernel."""
    stack: object
    max_rows: int

    def applies(self, meta: AttentionMetadata, num_rows: int) -> bool:
        return (meta.batched is not None and not meta.prefills and meta.num_batched_tokens == num_rows
                and num_rows <= self.max_rows)


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

    def attention(self, h: torch.Tensor, rope: tuple, attn: AttentionBackend, meta: AttentionMetadata,
                  layer_idx: int, ops) -> torch.Tensor:
        """Self-attention block on normed input h: [N, hidden] -> [N, hidden] (before the residual)."""
        cfg = self.cfg
        n, heads, kv = h.shape[0], cfg.num_heads, cfg.num_kv_heads
        qkv = self.qkv(h).view(n, heads + 2 * kv, cfg.head_dim)          # [N, H + 2 KV, D]
        cos, sin, positions = rope
        if self.q_norm is None:
            ops.rope_(qkv, heads + kv, cos, sin, positions)                # q and k heads, in place
            q, k = qkv[:, :heads], qkv[:, heads:heads + kv]
        else:   # Qwen3: per-head RMSNorm of q and k before RoPE
            q = ops.add_rms_norm(qkv[:, :heads].contiguous(), None, self.q_norm, cfg.rms_norm_eps)
            k = ops.add_rms_norm(qkv[:, heads:heads + kv].contiguous(), None, self.k_norm, cfg.rms_norm_eps)
            ops.rope_(q, heads, cos, sin, positions)
            ops.rope_(k, kv, cos, sin, positions)
        v = qkv[:, heads + kv:]
        return self.o(attn.forward(layer_idx, q, k, v, meta))              # attn: [N, H * D]

    def mlp(self, h: torch.Tensor, ops) -> torch.Tensor:
        return self.down(ops.silu_and_mul(self.gate_up(h)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.ops = TorchOps()
        self.embed = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        # A GGUF model's token embedding and LM head rows read from the file (tandem.models.gguf_load):
        # tandem.models.quant.RowTable, or None (the float tensors above).
        self.embed_table = None
        self.head_table = None
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
                meta: AttentionMetadata, num_layers: int | None = None, exit_layer: int | None = None,
                exit_hook=None, stack=None) -> torch.Tensor:
        """Hidden states (before the final norm) of every input token: [N, hidden].

        `num_layers` runs only the first layers (layer-skip self-speculation). `exit_hook(x)` is
        called with the residual stream after `exit_layer` layers; it may return (rows to keep,
        their positions, their attention metadata), and the deeper layers then compute only those
        rows (early pruning of predicted-rejected drafts); the result has the kept rows only.
        Its one caller is ForwardPass.run_with_exit, which builds the hook and returns the kept inputs.
        `stack`: this model's `decoder_stack(attn)`, for a decode-only step it applies to (the
        caller checks: `DecoderStack.applies`); the same result from one C++ call."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        layers = self.layers if num_layers is None else self.layers[:num_layers]
        rope = (self.rope_cos, self.rope_sin, positions)
        x = self.embed_table.rows(input_ids) if self.embed_table is not None else \
            F.embedding(input_ids, self.embed)                            # the residual stream [N, hidden]
        if stack is not None:
            g = meta.batched
            return stack.stack.forward(x, self.rope_cos, self.rope_sin, positions, meta.slot_mapping, g.table,
                                       g.query_seq, g.query_pos, attn.cache.block_size, attn.scale, len(layers))
        h = ops.add_rms_norm(x, None, layers[0].input_norm, eps)
        for i, layer in enumerate(layers):
            h = ops.add_rms_norm(x, layer.attention(h, rope, attn, meta, i, ops), layer.post_norm, eps)
            out = layer.mlp(h, ops)
            if i + 1 == exit_layer and exit_hook is not None and i + 1 < len(layers):
                x.add_(out)
                pruned = exit_hook(x)
                if pruned is not None:
                    keep, positions, meta = pruned
                    x = x.index_select(0, keep)
                    rope = (self.rope_cos, self.rope_sin, positions)
                h = ops.add_rms_norm(x, None, layers[i + 1].input_norm, eps)
            elif i + 1 < len(layers):
                h = ops.add_rms_norm(x, out, layers[i + 1].input_norm, eps)
            else:
                x.add_(out)
        return x

    def decoder_stack(self, attn: AttentionBackend) -> DecoderStack | None:
        """The decoder layers over `attn`'s cache as one C++ call (csrc/decoder_stack.cpp), where
        every layer's linear layers run the 8-bit kernel (a GGUF model with quantization "gguf")
        and attention has the paged decode kernel; None elsewhere."""
        m = getattr(self.ops, "m", None)
        if (m is None or not hasattr(m, "DecoderStack") or attn.kernel is None or attn.kv_write is None
                or self.cfg.qk_norm or self.embed.device.type != "cpu"):
            return None
        parts = [(layer.qkv, layer.o, layer.gate_up, layer.down) for layer in self.layers]
        flat = [lin for group in parts for lin in group]
        if any(lin.quant is None or lin.quant.i8 is None or lin.bias is not None for lin in flat):
            return None
        max_rows = min(lin.quant.i8_max_rows for lin in flat)
        if max_rows < 1:
            return None
        cfg = self.cfg
        stack = m.DecoderStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        for i, (layer, group) in enumerate(zip(self.layers, parts)):
            stack.add_layer(layer.input_norm, layer.post_norm, attn.cache.k[i], attn.cache.v[i],
                            [lin.quant.i8 for lin in group], [lin.out_features for lin in group],
                            [[t for t, _ in lin.quant.i8_parts] or [lin.quant.i8_qtype] for lin in group],
                            [[n for _, n in lin.quant.i8_parts] or [lin.out_features] for lin in group])
        return DecoderStack(stack, max_rows)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the LM head's weight matrix, [len(ids), hidden], wherever they are kept:
        the plain weight, the GGUF rows, the tied embedding, or the float32 panels (16 rows of
        [N/16, K, 16] each); a RuntimeError for a head kept only in another packed layout."""
        head = self.lm_head
        if head.weight.numel():
            return head.weight.index_select(0, ids)
        if self.head_table is not None:
            return self.head_table.rows(ids).to(self.embed.device)
        if self.cfg.tie_word_embeddings and self.embed.numel():
            return self.embed.index_select(0, ids)
        if head._panels is not None:
            return head._panels[ids // 16, :, ids % 16]
        raise RuntimeError("the LM head's rows are not kept in a readable layout (bfloat16 panels or oneDNN's)")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on selected rows: [M, hidden] -> [M, vocab] (float32)."""
        h = self.ops.add_rms_norm(hidden.contiguous(), None, self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()

    def prepack(self) -> int:
        """Prepack every linear layer for the CPU backend; returns how many were packed."""
        shared = self.lm_head.weight is self.embed
        return sum(m.prepack(release=not (m is self.lm_head and shared))
                   for m in self.modules() if isinstance(m, Linear))
