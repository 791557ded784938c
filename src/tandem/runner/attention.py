"""Paged attention over a block-structured KV cache, in plain PyTorch (any device).

KV layout per layer: `k[kv_head, slot, head_dim]` with slot = block_id * block_size + offset, so
gathering a sequence's context yields `[kv_head, T, D]` directly in the layout batched matmul
wants. Each step first writes the new tokens' K/V into their slots, then attends: requests with a
few query tokens (decodes, speculative verification) go through one padded, batched matmul
attention; long prefill chunks go one by one through SDPA with a causal mask offset by the
cached context, or through the fused flash-style kernel where it applies (bfloat16 on AVX512-BF16).
The cache may be stored in a 16-bit dtype under a float32 model (kv_cache_dtype, see
tandem.runner.device.resolve_kv_dtype): K/V are rounded when written and widened when read.
A step's KV is written before any of its attention reads it, which is what lets a
request share prefix blocks that another request fills in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# Requests with at most this many query tokens in a step use the batched path.
MAX_BATCHED_QUERY = 16


@dataclass
class BatchedGroup:
    """Requests attended together: B requests, up to Lq query tokens each, up to T context tokens.

    The paged kernel reads blocks in place through (table, query_seq, query_pos); the plain PyTorch
    path gathers contexts into a padded batch (gather_slots, mask, pad/unpad indices). Only the
    fields of the path in use are built."""

    num_seqs: int
    max_query: int
    max_context: int
    table: torch.Tensor | None = None          # [B, max_blocks] int32 block ids
    query_seq: torch.Tensor | None = None      # [Nb] int32 row of `table` of each query
    query_pos: torch.Tensor | None = None      # [Nb] int32 position of each query
    gather_slots: torch.Tensor | None = None   # [B * T] slots of each request's context, padded with slot 0
    mask: torch.Tensor | None = None           # [1, B, Lq, 1, T] additive (0 or -inf)
    pad_index: torch.Tensor | None = None      # [B * Lq] flat token row of each padded query (None: no padding)
    unpad_index: torch.Tensor | None = None    # [Nb] padded query position of each flat token row


@dataclass
class PrefillSeq:
    q_start: int                        # rows q_start:q_end of the flat batch
    q_end: int
    ctx_slots: torch.Tensor             # [T] slots of the whole context (cached + this chunk)
    mask: torch.Tensor | None           # [q, T] bool (True = attend), None = plain causal
    start: int = 0                      # position of the chunk's first query
    blocks: torch.Tensor | None = None  # int32 block ids covering the context (for the fused kernel)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor          # [N] slot to write each new token's K/V
    num_batched_tokens: int             # the first rows belong to the batched group
    batched: BatchedGroup | None = None
    prefills: list[PrefillSeq] = field(default_factory=list)


class PagedKVCache:
    """The KV tensors of all layers: k[layer] and v[layer] are [num_kv_heads, num_slots, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, pin: bool = False) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class AttentionBackend:
    """Writes a step's K/V into the paged cache and computes attention for every query row."""

    def __init__(self, cache: PagedKVCache, num_heads: int, num_kv_heads: int, head_dim: int, ops=None) -> None:
        self.cache = cache
        self.kernel = getattr(ops, "paged_attention", None)   # fused paged attention, if the ops have it
        self.prefill_kernel = getattr(ops, "prefill_attention", None)
        self.kv_write = getattr(ops, "kv_write_", None)           # fused K/V write into the cache, if any
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, KV, D] (new tokens) -> [N, H * D]."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self.kv_write is not None:
            self.kv_write(kc, vc, k, v, meta.slot_mapping)
        else:
            kc.index_copy_(1, meta.slot_mapping, k.transpose(0, 1).to(kc.dtype))   # rounded if the cache is 16-bit
            vc.index_copy_(1, meta.slot_mapping, v.transpose(0, 1).to(vc.dtype))
        n = q.shape[0]
        nb = meta.num_batched_tokens
        g = meta.batched
        if g is not None and self.kernel is not None and nb == n and not meta.prefills:
            # a decode-only step: the kernel's output is the layer's, with no copy
            return self.kernel(q, kc, vc, g.table, g.query_seq, g.query_pos, self.cache.block_size, self.scale)
        out = q.new_empty(n, self.num_heads * self.head_dim)
        if g is not None:
            if self.kernel is not None:
                out[:nb] = self.kernel(q[:nb], kc, vc, g.table, g.query_seq, g.query_pos,
                                       self.cache.block_size, self.scale)
            else:
                out[:nb] = self._batched(q[:nb], kc, vc, g)
        for p in meta.prefills:
            out[p.q_start:p.q_end] = self._prefill(q[p.q_start:p.q_end], kc, vc, p)
        return out

    def _batched(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, g: BatchedGroup) -> torch.Tensor:
        b, lq, t, kv, grp, d = g.num_seqs, g.max_query, g.max_context, self.num_kv_heads, self.group, self.head_dim
        if g.pad_index is not None:
            q = q.index_select(0, g.pad_index)                            # [B * Lq, H, D]
        # [B, Lq, KV, G, D] -> [KV, B, Lq * G, D]
        qg = q.view(b, lq, kv, grp, d).permute(2, 0, 1, 3, 4).reshape(kv, b, lq * grp, d)
        keys = kc.index_select(1, g.gather_slots).view(kv, b, t, d).to(q.dtype)   # [KV, B, T, D]
        vals = vc.index_select(1, g.gather_slots).view(kv, b, t, d).to(q.dtype)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(self.scale)  # [KV, B, Lq * G, T]
        scores = scores.view(kv, b, lq, grp, t).add_(g.mask).view(kv, b, lq * grp, t)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, vals)                                     # [KV, B, Lq * G, D]
        o = o.view(kv, b, lq, grp, d).permute(1, 2, 0, 3, 4).reshape(b * lq, kv * grp * d)
        if g.unpad_index is not None:
            o = o.index_select(0, g.unpad_index)
        return o

    def _prefill(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, p: PrefillSeq) -> torch.Tensor:
        if self.prefill_kernel is not None and p.blocks is not None:
            out = self.prefill_kernel(q.contiguous(), kc, vc, p.blocks, p.start, self.cache.block_size, self.scale)
            if out is not None:
                return out
        keys = kc.index_select(1, p.ctx_slots).unsqueeze(0).to(q.dtype)   # [1, KV, T, D]
        vals = vc.index_select(1, p.ctx_slots).unsqueeze(0).to(q.dtype)
        qh = q.transpose(0, 1).unsqueeze(0)                               # [1, H, q, D]
        o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=p.mask, is_causal=p.mask is None,
                                           scale=self.scale, enable_gqa=self.group > 1)
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)
